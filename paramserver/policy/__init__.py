"""Staleness policies: pure decisions, no I/O and no gRPC. ``staleness`` parses ``sync``,
``async``, ``delay-1`` and ``ssp:K`` into a ``Policy`` that says whether a worker may pull
iteration t+1 given every live clock.

May import: ``errors``. Imported by ``config``, ``server`` and ``worker``.
"""
