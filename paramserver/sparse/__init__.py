"""Sparse embedding tables held by the servers.

A model's trainable ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True`` is a table:
outside the flat buffer, its rows held by the server shards and moved only when a batch
touches them.

- ``rows``: which shard holds a row (``splitmix64(id) mod S``) and a row's initial value, a
  deterministic function of (seed, table, id) whatever the number of shards;
- ``index``: row ids to storage slots, a vectorised open-addressing hash table;
- ``optim``: row-wise sgd, adagrad (torch's SGD and Adagrad on the touched rows),
  rowwise-adagrad (one accumulator a row), sparse-adam (torch's SparseAdam: bias-corrected
  by the table's steps) and lazy adam (each row bias-corrected by its own steps);
- ``table``: one shard's rows of a table: a module's own rows loaded at start-up, a
  declared table's created by their first push (a pull creates nothing), pulled and
  pushed by id, checked before anything changes, saved and restored;
- ``tableset``: every table a shard holds, as the coordinator uses them: a push's rows
  checked whole before any table changes, each table's optimizer (``--table-optimizer``,
  else the server's), a module's own rows as the start (``start_from``);
- ``row_round``: the sync round's row gradients, averaged like the dense part's;
- ``client``: ``Tables`` (pull and push rows by id, one request per shard that holds
  them) and ``LocalTables``, every shard in this process;
- ``embedding``: ``TableEmbedding`` in place of a sparse ``nn.Embedding`` or
  ``nn.EmbeddingBag`` (rows on demand, gradients coalesced per id, a bounded cache of rows,
  ``prefetch``), and ``attach_tables`` that swaps them into a model;
- ``remote``: ``RemoteTables`` over a worker's sessions (``PullRows``, joining a restarted
  server again), and ``stage_rows``: a step's row gradients for each shard's push header;
- ``memory``: the worker's glibc mmap threshold, so large row buffers are not kept;
- ``declared``: ``Embedding`` and ``EmbeddingBag``, tables declared in a model and never
  allocated (in a cluster the servers hold them; on their own they train on an in-process
  row store), exported here;
- ``lifecycle``: admission, capacity with LRU or LFU eviction, TTL and their counters.

Their wire format is ``codec/rows.py``; the worker's side of them is ``worker/rows.py``
(attach, prefetch, a step's rows).

May import: ``codec``, ``config``, ``errors``, ``_proto``. Never ``server``, ``worker`` or
anything above them.
"""

from paramserver.sparse.declared import Embedding, EmbeddingBag, name_tables
from paramserver.sparse.lifecycle import Lifecycle

__all__ = ["Embedding", "EmbeddingBag", "Lifecycle", "name_tables"]
