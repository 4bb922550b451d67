"""Everything that carries bytes between a worker and a server, both ends of it:

- ``stub``: the gRPC channel and stub a worker (or the CLI) talks through, with retries,
  TLS and the token;
- ``security``: TLS credentials and the token interceptor that refuses a client without it
  (answered on a small side pool, the request unread);
- ``handlers``: gRPC method handlers of the four shapes, made and wrapped in one place (the
  interceptors build on it);
- ``health``: the gRPC health service bounded against unauthenticated watchers, and the
  side pool;
- ``shm``: the shared-memory segments a same-host worker's payloads travel in;
- ``pinned``: page-locking a CUDA worker's payload buffers (segments registered with CUDA),
  with a counted, logged fallback to pageable memory;
- ``segment_io``, ``pieces``: the server's reads and writes of a worker's segment, and the
  pool that splits large copies and checks over the server's threads;
- ``channels``: the worker's payload channels (``GrpcStreamChannel``, the control-socket
  client), one interface for push, pull and both;
- ``shm_channel``: ``ShmChannel``, payloads and table rows through the shared segment;
- ``ports``: binding the server's gRPC port, a port in use refused in one sentence;
- ``tcp``: the data port's client (``TcpChannel``), what workers on other hosts step over;
- ``client``: the ``Channel`` seam, everything a worker's session sends to one server
  (membership, queries and payloads), and ``GrpcChannel``, a stub with a payload channel
  (``open_channel`` picks it: the segment, the data port, or streams).

May import: ``codec``, ``config``, ``errors``, ``_proto``. Never ``server`` or ``worker``:
both sit above it.
"""
