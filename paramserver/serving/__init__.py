"""Serving a trained model with no server running.

- ``snapshot``: ``paramserver export --snapshot DIR`` writes a run's model from its
  servers' checkpoints as a versioned snapshot: a manifest with every file's checksum, the
  dense part, and each table's rows by shard as mappable sorted ids and values, streamed;
- ``served``: ``load(DIR)`` checks every file against the manifest and gives the model,
  its tables answering lookups from the mapped files (``ServedTable``).

May import everything below ``api`` (``server``'s export for which checkpoints to read).
"""

from paramserver.serving.served import ServedTable, load

__all__ = ["ServedTable", "load"]
