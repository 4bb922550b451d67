"""Rows on the wire: ``TableSpec`` and ``RowGradients`` to and from their messages. Ids are
int64 and values the table's dtype, both little-endian; a message whose bytes do not fit
its table is refused (``InvalidRequest``) before anything reads it as rows."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import InvalidRequest
from paramserver.sparse.table import TableSpec
from paramserver.sparse.tableset import RowGradients

IDS = np.dtype("<i8")


def spec_to_proto(spec: TableSpec, optimizer: str = "", lr: float = 0.0) -> pb.TableSpec:
    return pb.TableSpec(name=spec.name, rows=spec.rows, dim=spec.dim, dtype=spec.dtype,
                        optimizer=optimizer, lr=lr)  # fmt: skip


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    return TableSpec(msg.name, msg.rows, msg.dim, msg.dtype or "float32")


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
        raise InvalidRequest(f"{what} of table {spec.name!r}: {len(data)} bytes for {n} rows of "
                             f"{spec.dim} {spec.dtype} values.")  # fmt: skip
    return torch.from_numpy(np.frombuffer(data, dtype=dtype).reshape(n, spec.dim).copy())


def gradients_to_proto(push: RowGradients) -> pb.RowGradients:
    return pb.RowGradients(table=push.table, ids=ids_to_bytes(push.ids),
                           values=rows_to_bytes(push.grads))  # fmt: skip


def gradients_from_proto(
    messages: Iterable[pb.RowGradients], specs: dict[str, TableSpec]
) -> list[RowGradients]:
    """The rows of a push header, or InvalidRequest (an unknown table, bytes that do not
    fit it)."""
    out = []
    for msg in messages:
        spec = specs.get(msg.table)
        if spec is None:
            raise InvalidRequest(f"A push names table {msg.table!r}, which is not held here.")
        ids = ids_from_bytes(msg.ids, f"A push of table {msg.table!r}")
        out.append(RowGradients(msg.table, ids, rows_from_bytes(msg.values, len(ids), spec,
                                                                 "A push")))  # fmt: skip
    return out
