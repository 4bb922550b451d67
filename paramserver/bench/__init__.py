"""``paramserver bench NAME``: measurements that print ratios taken side by side in one run,
with PyTorch DDP as the baseline where one applies. One folder a family:

- ``throughput/``: a worker's step against a local step (``step``), samples/s of 1 to 4
  workers (``scaling``), a straggler (``straggler``), time to 88% (``accuracy``);
- ``wire/``: bytes on the way: push and pull against raw TCP (``transport``), the
  same-host wake-up (``wakeup``), the pushes a shard absorbs (``server``, driven by
  ``pusher`` processes), shaped links between network namespaces (``network``, training
  across them in ``network_training``);
- ``tables/``: sparse embedding tables (``sparse``; its processes in ``ranks``, a shard's
  memory per row in ``row_memory``);
- ``criteo/``: ``bench sparse``'s recommender case: the Criteo-like ``stream``, its DLRM
  (``model``), the case (``case``) and its processes (``ranks``);
- ``report/``: docs/RESULTS.md and README's figures from the runs' JSON (``results``,
  ``readme``: ``make results``) and the plots of docs/bench (``figures``);
- here: ``common`` (timing, a server child, the report) and ``ddp`` (the DDP baseline, and
  the helpers every bench's rank processes start and report with).

Rooms, lowest first: ``report``; ``common`` and ``ddp``; ``criteo``, then ``tables``;
``throughput``, then ``wire``. A room may import the rooms below it, never one above, and
``criteo``/``tables`` never import ``throughput``/``wire`` or the other way round.

May import: ``cluster``, ``training``, ``api``, ``server``, ``worker`` and everything below
them. Never ``cli``.
"""

# ``paramserver bench NAME`` -> the module whose ``run`` measures it.
BENCHMARKS = {
    "transport": "paramserver.bench.wire.transport",
    "step": "paramserver.bench.throughput.step",
    "straggler": "paramserver.bench.throughput.straggler",
    "scaling": "paramserver.bench.throughput.scaling",
    "accuracy": "paramserver.bench.throughput.accuracy",
    "wakeup": "paramserver.bench.wire.wakeup",
    "sparse": "paramserver.bench.tables.sparse",
    "network": "paramserver.bench.wire.network",
    "server": "paramserver.bench.wire.server",
}
