"""``bench sparse``: a DLRM whose table is server rows against the same table dense, one
local process and DDP (``sparse``; its processes in ``ranks``, each run in ``runs``), and a
shard's memory per row held (``row_memory``).

May import: ``criteo``, ``bench``'s ``common`` and ``ddp``, ``report``. Never ``throughput``
or ``wire``.
"""
