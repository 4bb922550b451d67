"""Rows on the wire: ``TableSpec`` and ``RowGradients`` to and from their messages. Ids are
int64 and values the table's dtype, both little-endian; a message whose bytes do not fit
its table is refused (``InvalidRequest``) before anything reads it as rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import InvalidRequest

DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class TableSpec:
    """A table as the manifest describes it: ``rows`` 0 is an unbounded table (ids any
    int64, hashed to shards); ``init`` its rows' initialiser (``sparse.rows.Init``)."""

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    init: str = "normal"

    def __post_init__(self) -> None:
        if self.rows < 0 or self.dim < 1:
            raise ValueError(
                f"Table {self.name!r} needs rows >= 0 (0: unbounded) and dim >= 1; got "
                f"{self.rows} x {self.dim}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"Table {self.name!r}: dtype {self.dtype} is not one of {DTYPES}.")


@dataclass(frozen=True)
class RowGradients:
    """One table's part of a push: distinct ``ids`` and one gradient row each."""

    table: str
    ids: np.ndarray
    grads: torch.Tensor


IDS = np.dtype("<i8")
# A push's row gradients larger than this follow its header as several messages (gRPC
# refuses a message over 64 MiB).
ROWS_IN_HEADER = 8 << 20


def spec_to_proto(spec: TableSpec, optimizer: str = "", lr: float = 0.0) -> pb.TableSpec:
    return pb.TableSpec(
        name=spec.name,
        rows=spec.rows,
        dim=spec.dim,
        dtype=spec.dtype,
        optimizer=optimizer,
        lr=lr,
        init=spec.init,
    )


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    return TableSpec(msg.name, msg.rows, msg.dim, msg.dtype or "float32", msg.init or "normal")


def ids_to_bytes(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype=IDS).tobytes()


def ids_from_bytes(data: bytes, what: str) -> np.ndarray:
    if len(data) % IDS.itemsize:
        raise InvalidRequest(f"{what}: {len(data)} bytes of ids are not whole int64 values.")
    return np.frombuffer(data, dtype=IDS)


def rows_to_bytes(rows: torch.Tensor) -> bytes:
    arr = rows.detach().cpu().contiguous().numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def rows_from_bytes(data: bytes, n: int, spec: TableSpec, what: str) -> torch.Tensor:
    dtype = np.dtype(spec.dtype).newbyteorder("<")
    if len(data) != n * spec.dim * dtype.itemsize:
        raise InvalidRequest(
            f"{what} of table {spec.name!r}: {len(data)} bytes for {n} rows of "
            f"{spec.dim} {spec.dtype} values."
        )
    return torch.from_numpy(np.frombuffer(data, dtype=dtype).reshape(n, spec.dim).copy())


def gradients_to_proto(push: RowGradients) -> pb.RowGradients:
    return pb.RowGradients(
        table=push.table, ids=ids_to_bytes(push.ids), values=rows_to_bytes(push.grads)
    )


def split_rows(
    header: pb.PushHeader, limit: int | None = None
) -> tuple[pb.PushHeader, list[pb.RowGradients]]:
    """The header to send and the row chunks to send after it: none when its rows fit in
    ``limit`` bytes, else a copy of the header without rows and its rows in pieces of at
    most ``limit`` bytes (at least one row each). ``header`` is not changed (a retry sends
    it again). ``limit`` defaults to ``ROWS_IN_HEADER``."""
    limit = ROWS_IN_HEADER if limit is None else limit
    if not header.rows or header.ByteSize() <= limit:
        return header, []
    out = pb.PushHeader()
    out.CopyFrom(header)
    del out.rows[:]
    chunks = [piece for msg in header.rows for piece in _pieces(msg, limit)]
    out.row_chunks = len(chunks)
    return out, chunks


def _pieces(msg: pb.RowGradients, limit: int) -> list[pb.RowGradients]:
    n = len(msg.ids) // IDS.itemsize
    if n == 0:
        return [msg]
    size = len(msg.values) // n  # one row's values
    framing = pb.RowGradients(table=msg.table).ByteSize() + 2 * 11  # the name, two lengths
    step = max(1, (limit - framing) // (IDS.itemsize + size))  # rows a piece
    return [
        pb.RowGradients(
            table=msg.table,
            ids=msg.ids[lo * IDS.itemsize : hi * IDS.itemsize],
            values=msg.values[lo * size : hi * size],
        )
        for lo, hi in ((lo, lo + step) for lo in range(0, n, step))
    ]


def gradients_from_proto(
    messages: Iterable[pb.RowGradients],
    specs: dict[str, TableSpec],
    chunks: Sequence[pb.RowGradients] = (),
) -> list[RowGradients]:
    """The rows of a push: its header's ``messages`` (a table once each), or the row
    ``chunks`` that followed it (a table's rows may span several); InvalidRequest for an
    unknown table or bytes that do not fit it."""
    if chunks:
        messages = _merged(chunks)
    out = []
    for msg in messages:
        spec = specs.get(msg.table)
        if spec is None:
            raise InvalidRequest(f"A push names table {msg.table!r}, which is not held here.")
        ids = ids_from_bytes(msg.ids, f"A push of table {msg.table!r}")
        out.append(
            RowGradients(msg.table, ids, rows_from_bytes(msg.values, len(ids), spec, "A push"))
        )
    return out


def _merged(chunks: Sequence[pb.RowGradients]) -> list[pb.RowGradients]:
    """One message a table, its chunks' ids and values in order (duplicate ids across
    chunks are then refused as duplicates within one message are)."""
    ids: dict[str, list[bytes]] = {}
    values: dict[str, list[bytes]] = {}
    for c in chunks:
        ids.setdefault(c.table, []).append(c.ids)
        values.setdefault(c.table, []).append(c.values)
    return [pb.RowGradients(table=t, ids=b"".join(ids[t]), values=b"".join(values[t])) for t in ids]
