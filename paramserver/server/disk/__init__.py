"""A server's files: checkpoints, the tables' row folders, re-partitioning for another
shard count, and the whole model exported from a run's checkpoints.

- ``checkpoint``: the checkpoint file format (atomic, loads with plain ``torch.load``);
- ``checkpoint_writer``: the thread that writes a server's checkpoints and cuts, and the
  newest saved state a server is built from;
- ``row_format``: the tables' row folders on disk (deltas and merged bases) and writing one;
- ``row_reader``: reading them back (``Folder``, ``RowChain``), a chunk at a time;
- ``row_writer``: a shard's chain of row folders as its checkpoints write them;
- ``reshard_plan``: a run's state re-partitioned for another shard count, as decisions on
  states already read (no I/O);
- ``reshard``: reading the old shards' files and writing the new ones;
- ``export``: the whole model from a run's checkpoints, without the servers.

May import: ``bookkeeping``, ``engine``; below ``server``: ``transport``, ``models``,
``sparse``, ``codec``, ``policy``, ``config``, ``errors``, ``_proto``. Never ``doors`` or
the process modules.
"""
