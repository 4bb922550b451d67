"""``ShmChannel``: a session's payloads through the worker's shared-memory segment
(``shm.py``) that the server mapped at Join; a push and the next pull are one PushPull,
carried by the server's same-host control socket when it offered one (``ControlSocket``),
else by a gRPC call. Table rows go through the segment's rows parts: a row pull's values
(stamped with the pull they answer) and a push's row gradients (all or none of them),
written there from the gradients when the push's header is made (``row_messages``).
"""

from __future__ import annotations

import logging
import secrets
import sys
import threading
from collections.abc import Sequence

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, records, wire
from paramserver.codec import rows as sparse_wire
from paramserver.transport import pinned
from paramserver.transport import shm as shmem
from paramserver.transport.channels import ControlSocket, PayloadChannel
from paramserver.transport.stub import Stub

log = logging.getLogger("paramserver.transport.channels")


class ShmChannel(PayloadChannel):
    """Payloads in the worker's segment, mapped by the server: headers alone on the wire,
    through the control socket if there is one."""

    shm = True

    def __init__(
        self,
        stub: Stub,
        segment: shmem.Segment,
        control: ControlSocket | None = None,
        codec: compression.Codec | None = None,
        pin: bool = False,
        locker: pinned.Locker | None = None,
    ):
        self.stub = stub
        self.segment = segment
        # a CUDA worker's copies to and from the segment run at the bus's speed, async
        what = f"the shared segment {segment.name}"
        self._locked = (locker or pinned.Locker()).register(segment.memory, what) if pin else None
        self.control = control
        # with --compress: gradients and weights rounded in place, as the wire would
        self.codec = codec
        self.weights = torch.from_numpy(segment.weights)
        self.slots = [torch.from_numpy(a) for a in segment.slots]
        self._rows_pull = threading.Lock()  # one row pull at a time uses the pulls' part

    @property
    def description(self) -> str:
        via = "the control socket" if self.control is not None else "gRPC"
        locked = " (page-locked)" if self._locked is not None else ""
        return f"in shared memory{locked}, steps over {via}"

    def pull_rows(
        self, stub: Stub, request: pb.RowsRequest, timeout: float | None
    ) -> pb.RowsResponse:
        """A row pull whose values the server may write into the segment's rows part for
        pulls (``RowsResponse.shm``): they are copied out into the reply's ``values`` and
        ``more``, as if they had come in it. Values whose stamp is not this pull's (a late
        writer of an earlier pull that timed out, or a segment this session left after a
        rejoin) are not used: the pull is made again with the values in the reply."""
        rows = self.segment.rows
        if not rows:
            reply: pb.RowsResponse = stub.PullRows(request, timeout=timeout)
            return reply
        stamp = secrets.randbits(63) | 1
        request.shm, request.shm_stamp = True, stamp
        with self._rows_pull:
            reply = stub.PullRows(request, timeout=timeout)
            if not reply.shm:
                return reply
            values = _stamped(rows[0], stamp, list(reply.shm_sizes))
        if values is None or len(values) != 1 + len(reply.more):
            log.info("a row pull's values in shared memory were not its own; pulling again")
            request.shm, request.shm_stamp = False, 0
            again: pb.RowsResponse = stub.PullRows(request, timeout=timeout)
            return again
        reply.values = values[0]
        for i, v in enumerate(values[1:]):
            reply.more[i] = v
        reply.shm = False
        del reply.shm_sizes[:]
        return reply

    def row_messages(
        self, parts: Sequence[sparse_wire.RowGradients], slot: int
    ) -> list[pb.RowGradients]:
        """The messages of ``parts`` with their values in slot ``slot``'s rows part
        (``RowGradients.shm``), written there straight from the gradients, so the header is
        small and the control socket carries it; or with the values in them when they do
        not all fit there, or their ids alone pass a header's rows (row chunks carry them
        then, values and all). A retry sends the same messages: the values stay in the
        slot's part until the push is answered and the slot is free again."""
        rows = self.segment.rows
        if not parts or not rows or sys.byteorder != "little":
            return super().row_messages(parts, slot)
        ids = sum(len(p.ids) for p in parts) * sparse_wire.IDS.itemsize + 64 * len(parts)
        sizes = [p.grads.numel() * p.grads.element_size() for p in parts]
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at = -(-(at + n) // 64) * 64
        part = rows[1 + slot]
        if ids > sparse_wire.ROWS_IN_HEADER or offsets[-1] + sizes[-1] > len(part):
            return super().row_messages(parts, slot)
        into = torch.from_numpy(part)
        messages = []
        for p, offset, n in zip(parts, offsets, sizes, strict=True):
            values = p.grads.detach().contiguous().reshape(-1).view(torch.uint8)
            into[offset : offset + n].copy_(values)
            messages.append(
                pb.RowGradients(
                    table=p.table, ids=sparse_wire.ids_to_bytes(p.ids), shm=True, shm_offset=offset
                )
            )
        return messages

    def _push_pull(self, request: pb.PushPullRequest, timeout: float) -> pb.PushPullResponse:
        control = self.control
        # One call at a time on the socket; another at the same moment goes over gRPC, and
        # so does a request larger than a frame (a push with many table rows).
        fits = control is not None and request.ByteSize() <= records.MAX_PAYLOAD
        if control is not None and fits and control.busy.acquire(blocking=False):
            try:
                return control.push_pull(request, timeout)
            except OSError as exc:  # EOF, reset, timeout: the server is gone or stuck
                log.warning("the control socket failed (%s); steps go over gRPC", exc)
                control.close()
                self.control = None
            finally:
                control.busy.release()
        reply: pb.PushPullResponse = self.stub.PushPull(request, timeout=timeout)
        return reply

    def _rounded(self, slot: int | None, iteration: int = 0) -> None:
        """Round a gradient about to be pushed (``slot``; top-k: sparsified), or the weights
        just pulled, as the wire would."""
        if self.codec is None:
            return
        if slot is None:
            self.codec.pulls.round_(self.weights)
        else:
            self.codec.round_(self.slots[slot], key=(slot, iteration))

    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> pb.PushResponse:
        header.shm, header.shm_slot = True, slot
        if not header.empty:
            self._rounded(slot, header.iteration)
        sent, rows = sparse_wire.split_rows(header)
        if rows:
            return self._push_stream(sent, rows, timeout)
        return self._push_pull(pb.PushPullRequest(push=header), timeout).push

    def _push_stream(
        self, header: pb.PushHeader, rows: list[pb.RowGradients], timeout: float
    ) -> pb.PushResponse:
        """A push whose rows are too many for one message: a Push stream carries them after
        the header (the gradient is in the segment)."""
        response: pb.PushResponse = self.stub.Push(
            wire.encode_push(header, memoryview(b""), wire.DEFAULT_CHUNK_BYTES, rows),
            timeout=timeout,
        )
        return response

    def pull(self, request: pb.PullRequest, timeout: float) -> pb.PullHeader:
        request.shm = True  # a pull alone: on the control socket too, when it is free
        header = self._push_pull(pb.PushPullRequest(pull=request), timeout).pull
        self._rounded(None)
        return header

    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> pb.PullHeader:
        header.shm, header.shm_slot, request.shm = True, slot, True
        if not header.empty:
            self._rounded(slot, header.iteration)
        sent, rows = sparse_wire.split_rows(header)
        if rows:
            self._push_stream(sent, rows, timeout)
            return self.pull(request, timeout)
        pulled = self._push_pull(pb.PushPullRequest(push=header, pull=request), timeout).pull
        self._rounded(None)
        return pulled

    @property
    def page_locked(self) -> bool:
        """Whether the segment is registered with CUDA (page-locked)."""
        return self._locked is not None

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        if self._locked is not None:  # before the mapping goes
            self._locked.release()
            self._locked = None
        self.segment.close()


def _stamped(part: np.ndarray, stamp: int, sizes: list[int]) -> list[bytes] | None:
    """The values of ``sizes`` bytes each after the pulls' part's stamp, if the stamp is
    ``stamp`` before and after they are copied (None otherwise, or if they do not fit)."""
    if any(n < 0 for n in sizes) or shmem.ROWS_STAMP + sum(sizes) > len(part):
        return None
    mark = stamp.to_bytes(8, "little")
    if part[:8].tobytes() != mark:
        return None
    at, values = shmem.ROWS_STAMP, []
    for n in sizes:
        values.append(part[at : at + n].tobytes())
        at += n
    return values if part[:8].tobytes() == mark else None
