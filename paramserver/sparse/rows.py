"""Where a row lives and what it starts as: pure functions of its id.

- Shard: row ``id`` of every table is held by shard ``splitmix64(id) mod S`` of ``--shard
  I/S`` (splitmix64 is the 64-bit finaliser of Steele, Lea and Flood's SplittableRandom; it
  spreads consecutive and Zipf-skewed ids evenly).
- Initial value: element j of row ``id`` is a standard normal (``nn.Embedding``'s default)
  drawn by Box-Muller from two counter-based uniforms, splitmix64 of (id * dim + j) mixed
  with the run's seed and the table's name. So the initial table is a function of the seed
  alone: no shard count, order of touch or process changes it, and an untouched row costs
  nothing.
"""

from __future__ import annotations

import hashlib

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of every element (uint64 in, uint64 out, wrapping)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, np.uint64) + GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
    """The shard (0..shards-1) holding each row id."""
    return (splitmix64(np.asarray(ids).astype(np.uint64)) % np.uint64(shards)).astype(np.int64)


def table_key(seed: int, name: str) -> np.uint64:
    """A 64-bit key of (seed, table name) that salts the table's initial rows."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def initial_rows(key: np.uint64, ids: np.ndarray, dim: int, dtype: str = "float32") -> np.ndarray:
    """The initial values of rows ``ids`` of the table salted by ``key``: (len(ids), dim)."""
    with np.errstate(over="ignore"):
        cells = np.asarray(ids).astype(np.uint64)[:, None] * np.uint64(dim)
        cells = (cells + np.arange(dim, dtype=np.uint64)[None, :]) * np.uint64(2)
        a = splitmix64(cells ^ key)
        b = splitmix64((cells + np.uint64(1)) ^ key)
    # 53 random bits each: u in (0, 1], v in [0, 1)
    u = ((a >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    v = (b >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return (np.sqrt(-2.0 * np.log(u)) * np.cos(2.0 * np.pi * v)).astype(dtype)
