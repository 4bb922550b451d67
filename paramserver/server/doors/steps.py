"""A worker's step as the server answers it, whichever door it came in by: the checks of a
push's header, its payload, the coordinator's push and pull, and the answer's header.

The gRPC servicer and the same-host control socket (``server/doors/doorbell.py``) both call it, so
both paths keep the same semantics: incarnations, staleness bound, exactly once, leases.

A worker whose shared segment misbehaves (``BrokenSegment``: truncated or resized under the
server, unreadable) has its call refused and is dropped, as if its lease had run out: the
server lets go of its segment and gives its batches back; the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, idle, wire
from paramserver.codec import rows as sparse_wire
from paramserver.codec.layout import Manifest
from paramserver.codec.rows import RowGradients, TableSpec
from paramserver.config import MAX_MESSAGE_BYTES, MAX_PUSH_EVERY
from paramserver.errors import BrokenSegment, InvalidRequest, SegmentUnusable
from paramserver.server.doors.optimizer_thread import Applier, call
from paramserver.server.doors.payloads import Payloads
from paramserver.server.engine.coordinator import Coordinator
from paramserver.transport.shm import ROWS_STAMP

log = logging.getLogger(__name__)
# A row pull's reply may carry this many bytes of rows: the message limit less room for
# its framing.
ROWS_REPLY_LIMIT = MAX_MESSAGE_BYTES - (64 << 10)


class Steps:
    def __init__(self, coordinator: Coordinator, payloads: Payloads):
        self.c = coordinator
        self.payloads = payloads
        # where a push's coordinator call runs: here, or on the optimizer's own thread
        self.applier = Applier() if coordinator.config.optimizer_thread else None
        self._apply = self.applier.run if self.applier is not None else call

    def pull(
        self, request: pb.PullRequest, remaining: float | None, is_active: Callable[[], bool]
    ) -> tuple[pb.PullHeader, memoryview]:
        """The pull's header and the bytes to stream after it (none through a segment);
        waits at most ``remaining`` seconds (the caller's deadline) for the policy."""
        timeout = self.c.config.barrier_timeout
        if remaining is not None:
            timeout = min(timeout, remaining)
        self.c.check_incarnation(request.incarnation)
        self.check_pull(request)
        if request.common_cut > 0:
            self.c.saving.learn_common_cut(request.common_cut)
        with self._dropping_broken_segments():
            result = self.c.pull(
                request.worker_id,
                request.iteration,
                timeout,
                is_active,
                request.batches or 1,
                request.incarnation,
                self.payloads.destination(request),
                request.ahead,
            )
        header = pb.PullHeader(
            version=result.version,
            staleness=result.staleness,
            batch=result.batch,
            batches=result.batches,
            finished=result.finished,
            cut_written=self.c.cuts.written,
            iteration=result.iteration,
            next_batches=result.next_batches,
        )
        return header, self.payloads.weights(request, header, result.weights)

    def check_push_header(self, h: pb.PushHeader) -> None:
        """The header's own consistency: its shard, element type and byte count."""
        codec = compression.by_dtype(h.dtype)
        shard = self.c.config.shard
        if h.shard != shard:
            raise InvalidRequest(f"A push for shard {h.shard} reached shard {shard} of the server.")
        numel, itemsize = self.c.manifest.numel, self.c.manifest.itemsize
        sparse = h.topk > 0
        if not 0 <= h.exact <= (0 if codec.raw and not sparse else numel):
            raise InvalidRequest(f"A {codec.dtype} push with {h.exact} exact elements of {numel}.")
        if not 0 <= h.topk <= numel - h.exact:
            raise InvalidRequest(f"A top-k push of {h.topk} pairs of {numel - h.exact} entries.")
        if sparse and codec.block:
            raise InvalidRequest(f"A top-k push's values cannot be {codec.dtype}.")
        if h.scale_block != codec.block:
            takes = f"one per {codec.block}" if codec.block else "none"
            raise InvalidRequest(
                f"A {codec.dtype} push with a scale per {h.scale_block} elements; this "
                f"server takes {takes}."
            )
        wire_bytes = (
            h.topk * (4 + codec.itemsize) + h.exact * itemsize
            if sparse
            else compression.payload_bytes(codec, numel, h.exact, itemsize)
        )
        expected = 0 if h.empty or h.shm else wire_bytes
        if h.total_bytes != expected:
            why = (
                " (an empty push carries none)."
                if h.empty
                else " (a push through shared memory streams none)."
                if h.shm
                else "."
            )
            raise InvalidRequest(
                f"A push of {h.total_bytes} bytes does not match the model's "
                f"{wire_bytes} bytes of {codec.dtype}{why}"
            )
        if h.iteration < 0:
            raise InvalidRequest(f"Iteration {h.iteration} is negative.")
        if len(h.batches) > MAX_PUSH_EVERY:
            raise InvalidRequest(
                f"A push names {len(h.batches)} batches; at most {MAX_PUSH_EVERY} go in one."
            )
        _idle(h, self.c.manifest)  # its parameters without a gradient

    def check_step(self, request: pb.PushPullRequest) -> None:
        """A step checked whole before any of it is applied, so that a refusal leaves
        nothing done (issue 55: a push applied, then its pull refused, and the worker could
        not know its push counted): the push's header, the pull's element type and exact
        tail, and a pull of the same worker and incarnation, for an iteration after the
        push's."""
        push, pull = request.push, request.pull
        if request.HasField("push"):
            self.check_push_header(push)
        if request.HasField("pull"):
            self.check_pull(pull)
        if not (request.HasField("push") and request.HasField("pull")):
            return
        if (pull.worker_id, pull.incarnation) != (push.worker_id, push.incarnation):
            raise InvalidRequest("A step's push and pull name other workers or incarnations.")
        window = max(1, self.c.policy.max_inflight_pushes())  # as Members.check_pull allows
        if not push.iteration < pull.iteration <= push.iteration + 1 + window:
            raise InvalidRequest(
                f"A step pushes iteration {push.iteration} and pulls {pull.iteration}: the "
                f"pull must be of one of the {window + 1} iterations after it."
            )

    def check_pull(self, request: pb.PullRequest) -> None:
        """A pull's own consistency, before it waits or takes a batch: what its weights are
        asked in, and how many batches (``Pull`` would refuse them only after a push-pull's
        push was applied)."""
        self.payloads.check_pull(request, self.c.manifest.numel)
        if not 0 <= request.batches <= MAX_PUSH_EVERY:
            raise InvalidRequest(
                f"A pull asks for {request.batches} batches; from 1 to {MAX_PUSH_EVERY} go "
                "in one (0: one)."
            )

    def push(
        self,
        header: pb.PushHeader,
        rest: Iterator[pb.PushChunk],
        received: np.ndarray | None = None,
        finite: bool | None = None,
        keep: Callable[[], Callable[[], None]] | None = None,
    ) -> pb.PushResponse:
        """Apply a push whose gradient follows in ``rest``'s chunks, is in the worker's
        segment (``header.shm``), or was ``received`` already (the data port's bytes,
        ``finite`` as their scan found, if they were scanned; ``keep``: the push may be
        answered before it is applied, ``keep()`` taking their buffer over)."""
        self.c.check_incarnation(header.incarnation)
        self.check_push_header(header)
        self.c.accept_header(header.worker_id, (header.row_cache_hits, header.row_cache_misses))
        with self._dropping_broken_segments():
            rows = self._rows(header, rest)
        gradient = self.payloads.gradient(header, rest, received, finite)
        with self._dropping_broken_segments(), gradient as (grad, finite):
            result = self._apply(
                self.c.push,
                header.worker_id,
                header.iteration,
                grad,
                header.samples,
                header.loss,
                header.incarnation,
                rows,
                header.batches,
                finite,
                keep,
                _idle(header, self.c.manifest),
                header.norm_sq if header.HasField("norm_sq") else None,
            )
        return pb.PushResponse(
            version=result.version, clock=result.clock, duplicate=result.duplicate
        )

    @contextmanager
    def _dropping_broken_segments(self) -> Iterator[None]:
        """Drop the worker whose segment broke in the block; its call fails as it would."""
        try:
            yield
        except BrokenSegment as exc:
            log.warning("%s", exc)
            self.payloads.shared.detach(exc.worker_id)
            self.c.leave(exc.worker_id)
            raise
        except SegmentUnusable as exc:  # the server's own limits: the worker streams on
            log.warning("%s", exc)
            self.payloads.shared.decline(exc.worker_id)
            raise

    # --- sparse tables ------------------------------------------------------------------

    def manifest(self) -> pb.Manifest:
        """The manifest a join answers: the flat buffer's layout, and the tables."""
        msg = self.c.manifest.to_proto()
        if self.c.tables is not None:
            for t in self.c.tables.tables.values():
                rows = t.optimizer.config
                msg.tables.append(sparse_wire.spec_to_proto(t.spec, rows.name, rows.lr))
        return msg

    def _rows(self, header: pb.PushHeader, rest: Iterator[pb.PushChunk]) -> list[RowGradients]:
        """The push's rows: in its header, or in the row chunks that follow it."""
        if not header.rows and not header.row_chunks:
            return []
        if header.empty:
            raise InvalidRequest("An empty push carries no rows.")
        if header.rows and header.row_chunks:
            raise InvalidRequest("A push carries rows in its header or after it, not both.")
        chunks = wire.decode_push_rows(header, rest)
        specs = {t.name: t for t in self.c.tables.specs} if self.c.tables is not None else {}
        spans = self._segment_spans(header, specs)
        messages = [
            pb.RowGradients(
                table=r.table,
                ids=r.ids,
                values=self.payloads.shared.rows(header.worker_id, header.shm_slot, *spans[i]),
            )
            if i in spans
            else r
            for i, r in enumerate(header.rows)
        ]
        return sparse_wire.gradients_from_proto(messages, specs, chunks)

    def _segment_spans(
        self, header: pb.PushHeader, specs: dict[str, TableSpec]
    ) -> dict[int, tuple[int, int]]:
        """Where the values of the header's rows in the worker's segment are (its rows part of
        the push's slot: message index -> offset, bytes), every one checked before any is
        read: a table once, whole ids, inside the part, no two overlapping. So a push makes
        the server read at most the part once."""
        spans = {}
        for i, msg in enumerate(header.rows):
            if not msg.shm:
                continue
            spec = specs.get(msg.table)
            if spec is None:
                raise InvalidRequest(f"A push names table {msg.table!r}, which is not held here.")
            if len(msg.ids) % sparse_wire.IDS.itemsize:
                raise InvalidRequest(
                    f"A push of table {msg.table!r}: {len(msg.ids)} bytes of ids are not whole "
                    "int64 values."
                )
            n = len(msg.ids) // sparse_wire.IDS.itemsize
            spans[i] = (msg.shm_offset, n * spec.dim * np.dtype(spec.dtype).itemsize)
        if not spans:
            return spans
        if not header.shm:
            raise InvalidRequest("Rows of a push are in shared memory, but the push is not.")
        names = [m.table for m in header.rows]
        if len(set(names)) < len(names):
            raise InvalidRequest("A push names a table twice; send its rows once, coalesced.")
        room = self.payloads.shared.rows_room(header.worker_id)
        end = 0
        for offset, nbytes in sorted(spans.values()):
            if offset < end or offset + nbytes > room:
                raise InvalidRequest(
                    f"Worker {header.worker_id} pushed rows at bytes [{offset}, "
                    f"{offset + nbytes}) of a rows part of {room}, or over other rows."
                )
            end = offset + nbytes
        return spans

    def pull_rows(self, request: pb.RowsRequest) -> pb.RowsResponse:
        """The rows of the request's table, and of its ``more`` tables; every table's ids are
        checked before any row is read (or created)."""
        wanted = [(t.table, t.ids) for t in (request, *request.more)]
        if len({table for table, _ in wanted}) < len(wanted):
            raise InvalidRequest("A row pull names a table twice; ask for its rows once.")
        ids = [
            sparse_wire.ids_from_bytes(data, f"A row pull of table {table!r}")
            for table, data in wanted
        ]
        tables = self.c.tables
        size = tables.reply_bytes(zip((t for t, _ in wanted), ids, strict=True)) if tables else 0
        if size > ROWS_REPLY_LIMIT:  # refused before any work, the lock untaken
            raise InvalidRequest(
                f"A row pull of {sum(len(i) for i in ids)} ids would answer {size >> 20} MiB, "
                f"over the {ROWS_REPLY_LIMIT >> 20} MiB a reply may carry: ask for fewer ids "
                "a request."
            )
        rows, low = self.c.pull_rows(
            request.worker_id,
            request.incarnation,
            [(table, i) for (table, _), i in zip(wanted, ids, strict=True)],
        )
        values = [sparse_wire.rows_to_bytes(r) for r in rows]
        room = self.payloads.shared.rows_room(request.worker_id) if request.shm else 0
        if request.worker_id and 0 < ROWS_STAMP + sum(len(v) for v in values) <= room:
            with self._dropping_broken_segments():  # the values go into the worker's segment
                self.payloads.shared.put_rows(request.worker_id, values, request.shm_stamp)
            return pb.RowsResponse(
                low_clock=low,
                more=[b""] * (len(values) - 1),
                shm=True,
                shm_sizes=[len(v) for v in values],
            )
        return pb.RowsResponse(values=values[0], more=values[1:], low_clock=low)

    def close(self) -> None:
        self.c.applies.close()  # the thread applying pushes answered early
        if self.applier is not None:
            self.applier.close()

    def push_pull(
        self,
        request: pb.PushPullRequest,
        remaining: float | None,
        is_active: Callable[[], bool],
    ) -> pb.PushPullResponse:
        """A push through the worker's segment, then a pull into it; either may be left
        out (a pull alone: the same-host path's pull, one round trip on the socket)."""
        asks_push, asks_pull = request.HasField("push"), request.HasField("pull")
        if not (asks_push or asks_pull):
            raise InvalidRequest("A PushPull asks for neither a push nor a pull.")
        if (asks_push and not request.push.shm) or (asks_pull and not request.pull.shm):
            raise InvalidRequest("PushPull carries its payloads in shared memory only.")
        self.check_step(request)
        push = self.push(request.push, iter(())) if asks_push else None
        if not asks_pull:
            return pb.PushPullResponse(push=push)
        pull, _ = self.pull(request.pull, remaining, is_active)
        return pb.PushPullResponse(push=push, pull=pull)


def _idle(h: pb.PushHeader, manifest: Manifest) -> idle.Idle:
    """The push's parameters without a gradient, or InvalidRequest."""
    return idle.parse(h.idle, manifest.section("param")[1]) if h.idle else ()
