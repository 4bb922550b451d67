"""A worker: ``Worker`` (and ``ShardedWorker``) in ``worker``, which a training loop calls
``step()`` on; a ``Session`` per server shard, owning its channel (join, heartbeat, rejoin;
``session``, ``shards``); joining them all (``joining``), and each shard's payload path
over its range (``attach``); a step's stages: stage the push, exchange it for the next
weights, load them (``stages``), over the ``Pipeline`` that overlaps pushes and pulls
(``pipeline``, ``view``); the model's replica over the flat buffer (``replica``; for a
GPU model ``flat``: its state as flat device tensors, gradients copied out in buckets
during backward by ``device_copies``); its sparse tables' side (``rows``), the retry
policy (``waits``) and a sync round's norm relayed between shards (``norm_relay``).

May import: ``transport``, ``models``, ``sparse``, ``codec``, ``policy``, ``config``,
``errors``, ``_proto``. Never ``server``, ``training``, ``cluster``, ``bench`` or ``cli``.
"""
