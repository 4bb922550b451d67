"""A server shard: the global model's range and its optimizer, behind gRPC, a same-host
control socket and a data port.

- wiring: ``app`` (model -> store -> coordinator -> gRPC, start and stop), ``servicer``
  (decode, call, encode; no decisions), ``listener`` (what the socket doors share),
  ``doorbell`` (the control socket), ``dataport`` (other hosts' steps), ``steps`` (a
  worker's step whichever door it came in by), ``payloads`` (where a payload's bytes are),
  ``metrics`` (Prometheus);
- decisions under one lock: ``coordinator``, the only code that assigns its fields, and
  the parts it holds, each owning its state: ``members`` (who is in, their clocks and
  batches), ``arrival`` (what of a push reaches the model and when: a sync round or on
  arrival, chosen once from the policy), ``saving`` (the cuts waiting for the disk, the
  checkpointer's writes); the bookkeeping they hold: ``membership`` (leases, clocks),
  ``dataplan`` (the batch queue), ``rounds`` (the sync round), ``ledger`` (batches
  applied), ``buffers`` (BatchNorm statistics), ``store`` (the flat model and its
  optimizer), ``applies`` (the dense apply off the lock: gradients pending, ``--coalesce``,
  the version pulls read meanwhile); ``checks`` (a push checked before the lock), ``pulls`` (whether a
  waiting pull may have its answer now), ``answers`` (a push's and a pull's results),
  ``applier`` (``--optimizer-thread``), ``status``;
- the disk: ``checkpoint`` (the file format), ``checkpointer`` (the writer thread, and the
  newest saved state a server is built from), ``cuts`` and ``saves`` (when to write and
  what was written), ``state`` (``CoordinatorSnapshot``: the coordinator's state as a
  checkpoint holds it), ``export`` (the whole model from a run's checkpoints).

May import: ``transport``, ``models``, ``sparse``, ``codec``, ``policy``, ``config``,
``errors``, ``_proto``. Never ``worker``, ``training``, ``cluster``, ``bench`` or ``cli``.
"""
