"""The only code that turns tensors into bytes and back, one module a job: ``layout`` (the
flat buffer, its manifest and its shards), ``wire`` (framing on gRPC streams) and
``compression`` (the wire element types, by registry)."""
