"""Sparse embedding tables held by the servers (issue 12), built in steps.

Built so far, the server's side of one table, tested against torch's own sparse training:
- ``rows``: which shard holds a row (``splitmix64(id) mod S``) and a row's initial value, a
  deterministic function of (seed, table, id) whatever the number of shards;
- ``index``: row ids to storage slots, a vectorised open-addressing hash table;
- ``optim``: row-wise sgd, adagrad and lazy adam (torch's SGD, Adagrad and SparseAdam on
  the touched rows);
- ``table``: one shard's rows of a table: created on first touch, pulled and pushed by id,
  checked before anything changes, saved and restored.

Built beside it: ``--dataset clicks`` (``paramserver/clicks.py``, Zipf ids and a hidden
teacher, with AUC) and ``--model dlrm`` (``models.DLRM``), which train today with their
tables as dense parameters.

Not yet: the wire (tables in the manifest, row pulls and pushes), the worker's row cache,
the coordinator's clocks over sparse pushes, checkpoints, metrics, and ``bench sparse``.
"""
