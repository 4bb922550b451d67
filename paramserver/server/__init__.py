"""A server shard: the global model's range and its optimizer, behind gRPC and a same-host
control socket.

- wiring: ``app`` (model -> store -> coordinator -> gRPC, start and stop), ``servicer``
  (decode, call, encode; no decisions), ``doorbell`` (the control socket), ``steps`` (a
  worker's step whichever door it came in by), ``payloads`` (where a payload's bytes are),
  ``metrics`` (Prometheus);
- decisions under one lock: ``coordinator`` with its parts ``members`` and ``saving``,
  and the bookkeeping they hold: ``membership`` (leases, clocks), ``dataplan`` (the batch
  queue), ``rounds`` (the sync round), ``ledger`` (batches applied), ``buffers``
  (BatchNorm statistics), ``checks`` (a push checked before the lock), ``store`` (the flat
  model and its optimizer), ``applier`` (``--optimizer-thread``), ``status``;
- the disk: ``checkpoint`` (the file format), ``checkpointer`` (the writer thread),
  ``cuts`` and ``saves`` (when to write and what was written), ``state`` (the coordinator
  to and from a checkpoint), ``export`` (the whole model from a run's checkpoints).

May import: ``transport``, ``models``, ``sparse``, ``codec``, ``policy``, ``config``,
``errors``, ``_proto``. Never ``worker``, ``training``, ``cluster``, ``bench`` or ``cli``.
"""
