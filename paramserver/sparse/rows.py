"""Where a row lives and what it starts as: pure functions of its id.

- Shard: row ``id`` of every table is held by shard ``splitmix64(id) mod S`` of ``--shard
  I/S`` (splitmix64 is the 64-bit finaliser of Steele, Lea and Flood's SplittableRandom; it
  spreads consecutive and Zipf-skewed ids evenly).
- Initial value: element j of row ``id`` is a standard normal (``nn.Embedding``'s default)
  drawn by Box-Muller from two counter-based uniforms, splitmix64 of (id * dim + j) mixed
  with the run's seed and the table's name. So the initial table is a function of the seed
  alone: no shard count, order of touch or process changes it, and an untouched row costs
  nothing.
- Other initialisers (``Init``, a table's declared ``init``): ``normal:STD``, ``uniform:B``
  (in [-B, B)), ``uniform:LO:HI``, ``zeros`` and ``constant:V``, from the same uniforms.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Init:
    """How a table's rows start: ``kind`` normal (``a`` the mean, ``b`` the std), uniform
    (in [a, b)) or constant (``a``; zeros: 0)."""

    kind: str = "normal"
    a: float = 0.0
    b: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Init:
        """``normal``, ``normal:STD``, ``uniform:B``, ``uniform:LO:HI``, ``zeros`` or
        ``constant:V``; ValueError naming what is wrong."""
        kind, *args = str(text).strip().lower().split(":")
        try:
            values = [float(a) for a in args]
        except ValueError:
            raise ValueError(f"An initialiser's arguments are numbers; got {text!r}.") from None
        arity = {"normal": (0, 1), "uniform": (1, 2), "zeros": (0,), "constant": (1,)}
        if kind not in arity or len(values) not in arity[kind]:
            raise ValueError(
                f"An initialiser is normal, normal:STD, uniform:B, uniform:LO:HI, zeros or "
                f"constant:V; got {text!r}."
            )
        if not all(np.isfinite(values)):
            raise ValueError(f"An initialiser's arguments are finite numbers; got {text!r}.")
        if kind == "normal":
            std = values[0] if values else 1.0
            if std < 0:
                raise ValueError(f"A normal initialiser's std is at least 0; got {text!r}.")
            return cls("normal", 0.0, std)
        if kind == "uniform":
            lo, hi = (-abs(values[0]), abs(values[0])) if len(values) == 1 else values
            if not lo < hi:
                raise ValueError(f"A uniform initialiser needs LO < HI; got {text!r}.")
            return cls("uniform", lo, hi)
        return cls("constant", values[0] if values else 0.0, 0.0)

    def text(self) -> str:
        """The spelling ``parse`` takes back."""
        if self.kind == "normal":
            return "normal" if self.b == 1.0 else f"normal:{self.b!r}"
        if self.kind == "uniform":
            return f"uniform:{self.a!r}:{self.b!r}"
        return "zeros" if self.a == 0 else f"constant:{self.a!r}"


NORMAL = Init()


def initial_rows(
    key: np.uint64 | np.ndarray,
    ids: np.ndarray,
    dim: int,
    dtype: str = "float32",
    init: Init = NORMAL,
) -> np.ndarray:
    """The initial values of rows ``ids`` of the table salted by ``key``: (len(ids), dim).
    ``key`` may also be one per id (uint64), for rows of several tables at once."""
    if init.kind == "constant":
        return np.full((len(ids), dim), init.a, dtype=dtype)
    salt = np.asarray(key, np.uint64)
    if salt.ndim:
        salt = salt[:, None]
    with np.errstate(over="ignore"):
        cells = np.asarray(ids).astype(np.uint64)[:, None] * np.uint64(dim)
        cells = (cells + np.arange(dim, dtype=np.uint64)[None, :]) * np.uint64(2)
        a = splitmix64(cells ^ salt)
        b = splitmix64((cells + np.uint64(1)) ^ salt)
    # 53 random bits each: u in (0, 1], v in [0, 1)
    u = ((a >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    v = (b >> np.uint64(11)).astype(np.float64) * 2.0**-53
    if init.kind == "uniform":
        return (init.a + (init.b - init.a) * v).astype(dtype)
    normal = np.sqrt(-2.0 * np.log(u)) * np.cos(2.0 * np.pi * v)
    if init.b != 1.0:
        normal *= init.b
    return normal.astype(dtype)
