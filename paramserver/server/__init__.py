"""A server shard: the global model's range and its optimizer, behind gRPC, a same-host
control socket and a data port. Five rooms, lowest first, and the process around them:

- ``optim/``: the optimizer's rules (clip, decay, a step's parameters without a gradient,
  Delayed Nesterov, a user's schedule or optimizer factory, what a resume takes);
- ``bookkeeping/``: the state a shard keeps, as plain records (leases, the batch queue,
  the sync round, the ledger, buffers, the store, cuts, the write record, the snapshot,
  the status);
- ``engine/``: the state machine: the coordinator and the decisions under its lock;
- ``disk/``: checkpoints, row folders, resharding, export;
- ``doors/``: gRPC, the control socket, the data port;
- here, the process: ``build`` (what a coordinator starts from: model, store, saved
  state), ``app`` (build -> doors -> start, ready, stop), ``metrics`` (Prometheus) and
  ``metrics_http`` (its HTTP server, what a peer may hold of it bounded).

A room may import the rooms below it; ``disk`` and ``doors`` never import each other;
only the process modules here import ``disk`` and ``doors`` together
(``tests/unit/test_layering.py`` checks it).

May import: ``transport``, ``models``, ``sparse``, ``codec``, ``policy``, ``config``,
``errors``, ``_proto``. Never ``worker``, ``training``, ``cluster``, ``bench`` or ``cli``.
"""
