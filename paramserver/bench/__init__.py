"""``paramserver bench NAME``: measurements that print ratios taken side by side in one run
(transport, step, straggler, scaling, accuracy, wakeup, sparse), with PyTorch DDP as the
baseline where one applies (``ddp``).

May import: ``cluster``, ``training``, ``api``, ``server``, ``worker`` and everything below
them. Never ``cli``.
"""
