"""How a worker's requests come in and its answers go out: gRPC, the same-host control
socket, the data port other hosts use. Decode, call the engine, encode: no decisions.

- ``servicer``: the gRPC servicer;
- ``listener``: what the two socket doors share (accepting, the hello, a thread each);
- ``doorbell``: the same-host control socket;
- ``dataport``: the data port, for workers on other hosts;
- ``steps``: a worker's step whichever door it came in by;
- ``payloads``: where a payload's bytes are (the worker's shared segment, or the stream);
- ``optimizer_thread``: ``--optimizer-thread``, every push's apply on one thread.

May import: ``bookkeeping``, ``engine``; below ``server``: ``transport``, ``models``,
``sparse``, ``codec``, ``policy``, ``config``, ``errors``, ``_proto``. Never ``disk`` or the
process modules.
"""
