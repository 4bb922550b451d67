"""Sparse embedding tables held by the servers (issue 12), built in steps.

Built so far, the server's side of one table, tested against torch's own sparse training:
- ``rows``: which shard holds a row (``splitmix64(id) mod S``) and a row's initial value, a
  deterministic function of (seed, table, id) whatever the number of shards;
- ``index``: row ids to storage slots, a vectorised open-addressing hash table;
- ``optim``: row-wise sgd, adagrad and lazy adam (torch's SGD, Adagrad and SparseAdam on
  the touched rows);
- ``table``: one shard's rows of a table: created on first touch, pulled and pushed by id,
  checked before anything changes, saved and restored;
- ``tableset``: every table a shard holds, as the coordinator will use them: a push's rows
  checked whole before any table changes, the sync round's row gradients averaged like the
  dense part's, the tables' optimizer chosen from the server's;

and the worker's side, tested against in-process shards:
- ``client``: ``Tables`` (pull and push rows by id, one request per shard that holds
  them) and ``LocalTables``, every shard in this process;
- ``embedding``: ``TableEmbedding`` in place of a sparse ``nn.Embedding`` or
  ``nn.EmbeddingBag`` (rows on demand, gradients coalesced per id, a bounded cache of rows,
  ``prefetch``), and ``attach_tables`` that swaps them into a model.

Built beside it: ``--dataset clicks`` (``paramserver/clicks.py``, Zipf ids and a hidden
teacher, with AUC) and ``--model dlrm`` (``models.DLRM``), which train today with their
tables as dense parameters.

Not yet: the wire (tables in the manifest, row pulls and pushes over gRPC), ``Worker.step``
pushing the tables' rows with its dense push under one clock, the daemon's prefetch,
checkpoints and ``model_state_dict`` of the tables, metrics, and ``bench sparse``.
"""
