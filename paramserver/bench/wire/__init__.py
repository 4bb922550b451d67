"""Bytes on the way: push and pull against raw TCP and memcpy (``transport``), the same-host
wake-up candidates (``wakeup``), the pushes one shard absorbs (``server``, driven by
``pusher`` processes), and shaped links between network namespaces (``network``, with
training across them in ``network_training``).

May import: ``throughput``, ``bench``'s ``common`` and ``ddp``, ``report``. Never ``tables``
or ``criteo``.
"""
