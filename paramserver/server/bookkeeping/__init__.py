"""The state a server shard keeps, as plain bookkeeping: no locks, no threads, no I/O, no
gRPC. The coordinator (``engine/``) holds these and guards them with its lock.

- ``leases``: who is in the run (leases, clocks, ranks), with an injectable clock;
- ``batch_queue``: which batches each worker computes (the run's batch plan);
- ``sync_round``: the sync round in progress (its contributors' gradients, summed);
- ``ledger``: which handed-out batches this shard applied, so each is applied once;
- ``buffers``: the model's shared buffers (BatchNorm statistics) per worker;
- ``store``: the flat model, its version and the server-side optimizer (whose rules are
  ``server/optim/``'s);
- ``cuts``: when a shard of a sharded run cuts its state (pure decisions);
- ``write_record``: what the server knows of its own checkpoint writes;
- ``snapshot``: ``CoordinatorSnapshot``, the coordinator's state as a checkpoint holds it;
- ``status``: ``ServerStatus``, the one status the Status RPC, metrics and ``status`` read,
  and the counters the engine keeps.

May import: of ``server``, ``optim`` only; below it ``models``, ``sparse``, ``codec``,
``policy``, ``config``, ``errors``, ``_proto``.
"""
