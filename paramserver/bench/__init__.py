"""``paramserver bench NAME``: measurements that print ratios taken side by side in one run
(transport, step, straggler, scaling, accuracy, wakeup, sparse with its ranks in
``sparse_ranks``, network), with PyTorch DDP as the baseline where one applies (``ddp``);
``common`` (timing, a server child, the report), ``figures`` (the plots of docs/bench) and
``results`` (docs/RESULTS.md from measured runs' JSON: ``make results``).

May import: ``cluster``, ``training``, ``api``, ``server``, ``worker`` and everything below
them. Never ``cli``.
"""
