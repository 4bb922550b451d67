"""The only code that turns tensors into bytes and back, one module a job: ``layout`` (the
flat buffer, its manifest and its shards), ``wire`` (framing of dense payloads on gRPC
streams), ``rows`` (sparse tables' specs and row gradients to and from their messages),
``records`` (the control socket's frames), ``idle`` (a push's parameters without a
gradient, as ranges) and ``compression`` (the wire element types, by
registry: the dense codecs of ``elements``, the error-feedback ones of ``feedback``).

May import: ``errors`` and ``_proto`` only: every other package sits above it.
"""
