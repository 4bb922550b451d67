"""The server's state machine: the decisions taken under the coordinator's one lock, and
the dense apply beside it. No gRPC, no sockets, no files.

- ``coordinator``: the lock, the condition pulls wait on, and with ``state_io`` the only
  code that assigns its fields; it orchestrates the parts below;
- ``state_io``: the coordinator's state in and out (its base class): the cuts that fall,
  the copy a checkpoint or a cut holds, and such a copy taken over (a start, a rewind);
- ``members``: who is in, their clocks and batches, joins and departures, exactly once;
- ``arrival``: what of a push reaches the model and when (a sync round, or on arrival),
  chosen once from the policy;
- ``dense_apply``: the dense apply off the lock (gradients pending, ``--coalesce``, the
  version pulls read meanwhile);
- ``pulls``: whether a waiting pull may have its answer now, and why it timed out;
- ``answers``: a push's and a pull's results;
- ``checks``: a push's gradient checked before the lock is taken;
- ``saving``: the coordinator's side of the disk: cuts waiting to be written, and what the
  checkpoint writer reports.

May import: ``bookkeeping``; below ``server``: ``transport``, ``models``, ``sparse``,
``codec``, ``policy``, ``config``, ``errors``, ``_proto``. Never ``disk``, ``doors`` or the
process modules (``app``, ``build``, ``metrics``).
"""
