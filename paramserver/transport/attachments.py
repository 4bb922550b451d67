"""The server's side of same-host shared memory (the segment's format and the worker's side
are ``shm.py``): the segments of the workers that offered one, opened at Join, checked, and
read or written on each push and pull; a sealed segment through a mapping (one memcpy), a
named one with ``preadv``/``pwrite`` (never mapped: its worker may truncate it)."""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterator

import numpy as np

from paramserver.errors import BrokenSegment, InvalidRequest, SegmentUnusable
from paramserver.transport import pieces
from paramserver.transport.segment_io import copy_split, read_at, read_split, write_at
from paramserver.transport.shm import (
    _ALIGN,
    MAX_ROWS_BYTES,
    NAME,
    NONCE_BYTES,
    ROWS_STAMP,
    SEALED_NAME,
    SEALS,
    SHM_DIR,
    _aligned,
    rows_offset,
    segment_bytes,
)

log = logging.getLogger("paramserver.transport.shm")


def _sealed(fd: int) -> bool:
    """Whether nobody can change the size of the file ``fd`` any more (a sealed memfd)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except (OSError, AttributeError):  # not a memfd, or no sealing here
        return False
    return bool(SEALS) and seals & SEALS == SEALS


class _Attached:
    """A worker's segment as the server holds it: the open file, and a mapping of it when it
    is sealed (its size can never change). ``users``: reads and writes in progress; the
    file is closed (and unmapped) when it is detached and none is left (never under one: its
    descriptor's number could be another file's by then)."""

    __slots__ = ("fd", "size", "nslots", "nonce", "users", "detached", "mapping", "rows_bytes")

    def __init__(
        self,
        fd: int,
        size: int,
        nslots: int,
        nonce: bytes,
        mapping: mmap.mmap | None = None,
        rows_bytes: int = 0,
    ):
        self.fd, self.size, self.nslots, self.nonce = fd, size, nslots, nonce
        self.mapping = mapping
        self.rows_bytes = rows_bytes
        self.users = 0
        self.detached = False

    def release(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
        os.close(self.fd)


class Attachments:
    """The server's side: the segments of the workers that offered one, by worker id, held
    open (mapped only when sealed); thread-safe."""

    def __init__(self, total_bytes: int, dtype: str = "float32"):
        self.total_bytes = total_bytes
        self.dtype = dtype
        self._lock = threading.Lock()
        self._by_worker: dict[str, _Attached] = {}
        self._declined: set[str] = set()  # workers whose segments this server cannot use

    def attach(
        self, worker_id: str, name: str, nonce: bytes, slots: int, rows_bytes: int = 0
    ) -> bool:
        """Keep the segment ``name`` open for ``worker_id`` if it is the worker's; False if not.

        A segment that cannot be opened (another host or container), is not a regular file,
        has the wrong size or another nonce is declined, and the worker streams over gRPC.
        """
        self.detach(worker_id)
        if not name:
            return False
        with self._lock:
            declined = worker_id in self._declined
        if declined:
            log.info(
                "worker %s offered a segment again; this server cannot use its segments "
                "(see above): streaming",
                worker_id,
            )
            return False
        if not 0 <= rows_bytes <= MAX_ROWS_BYTES:
            log.info("worker %s offered rows parts of %d bytes; streaming", worker_id, rows_bytes)
            return False
        if not 1 <= slots <= 64 or not (fd := self._open(worker_id, name)):
            return False
        size = segment_bytes(self.total_bytes, slots, rows_bytes)
        try:
            why = self._declines(fd, size, nonce)
            mapping = mmap.mmap(fd, size) if not why and _sealed(fd) else None
        except OSError as exc:
            why = f"cannot be read ({exc.strerror})"
        if why:
            os.close(fd)
            log.info("worker %s: its segment %s %s; streaming", worker_id, name, why)
            return False
        with self._lock:
            self._by_worker[worker_id] = _Attached(
                fd, size, slots, bytes(nonce), mapping, rows_bytes
            )
        return True

    @staticmethod
    def _open(worker_id: str, name: str) -> int:
        """The open file of the segment ``name`` names, or 0 (logged) where there is none:
        a sealed one's ``/proc/PID/fd/N`` only while that link names the worker's memfd
        (not another file the number may have been reused for), a named one in /dev/shm
        without following a link."""
        sealed = SEALED_NAME.fullmatch(name)
        if sealed:
            path = f"/proc/{sealed[2]}/fd/{sealed[3]}"
            flags = os.O_RDWR | os.O_NONBLOCK
        elif NAME.fullmatch(name):
            path = os.path.join(SHM_DIR, name)
            flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
        else:
            log.info("worker %s offered a malformed segment %r; streaming", worker_id, name)
            return 0
        try:
            if sealed and os.readlink(path) != f"/memfd:{sealed[1]} (deleted)":
                log.info("worker %s: %s is not its segment; streaming", worker_id, path)
                return 0
            return os.open(path, flags)
        except OSError as exc:
            log.info(
                "worker %s: cannot open %s (%s): not on this host; streaming",
                worker_id,
                path,
                exc.strerror,
            )
            return 0

    @staticmethod
    def _declines(fd: int, size: int, nonce: bytes) -> str:
        """Why the open file ``fd`` is not the offered segment; "" if it is."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        if st.st_size != size:
            return f"has {st.st_size} bytes, not {size}"
        if not hmac.compare_digest(os.pread(fd, NONCE_BYTES, 0), nonce):
            return "holds another nonce"
        return ""

    def detach(self, worker_id: str) -> None:
        """Let go of the segment of a worker that left or was dropped."""
        with self._lock:
            seg = self._by_worker.pop(worker_id, None)
            if seg is None:
                return
            seg.detached = True
            unused = seg.users == 0
        if unused:
            seg.release()

    def decline(self, worker_id: str) -> None:
        """Let go of the worker's segment and decline the ones it offers from now on."""
        with self._lock:
            self._declined.add(worker_id)
        self.detach(worker_id)

    def authenticates(self, worker_id: str, nonce: bytes) -> bool:
        """Whether ``worker_id``'s segment held ``nonce`` (the control socket's hello)."""
        with self._lock:
            seg = self._by_worker.get(worker_id)
        return seg is not None and hmac.compare_digest(seg.nonce, nonce)

    def has(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._by_worker

    def check(self, worker_id: str) -> None:
        """Whether ``worker_id``'s segment is here and whole, before a call relies on it.

        Raises:
            InvalidRequest: no segment.
            BrokenSegment: the segment changed size.
        """
        with self._using(worker_id) as seg:
            self._check_size(worker_id, seg)

    @contextlib.contextmanager
    def _using(self, worker_id: str) -> Iterator[_Attached]:
        with self._lock:
            seg = self._by_worker.get(worker_id)
            if seg is None:
                raise InvalidRequest(
                    f"Worker {worker_id} asked for shared memory but has no segment here; "
                    "join again."
                )
            seg.users += 1
        try:
            yield seg
        finally:
            with self._lock:
                seg.users -= 1
                last = seg.detached and seg.users == 0
            if last:
                seg.release()

    def gradient(
        self,
        worker_id: str,
        slot: int,
        into: np.ndarray | None = None,
        scan: Callable[[np.ndarray], None] | None = None,
    ) -> np.ndarray:
        """The gradient the worker wrote into ``slot``, copied into ``into`` (made if None,
        as the segment's dtype): the server's own memory, which the worker cannot change.

        Raises:
            InvalidRequest: no segment, or no such slot.
            BrokenSegment: the segment changed size, or cannot be read.
        """
        if into is None:
            into = np.empty(self.total_bytes // np.dtype(self.dtype).itemsize, self.dtype)
        if into.nbytes != self.total_bytes or not into.flags.c_contiguous:
            raise ValueError(f"A gradient needs {self.total_bytes} contiguous bytes.")
        with self._using(worker_id) as seg:
            if not 0 <= slot < seg.nslots:
                raise InvalidRequest(
                    f"Worker {worker_id} pushed from slot {slot}; its segment has {seg.nslots}."
                )
            self._check_size(worker_id, seg)
            offset = _ALIGN + _aligned(self.total_bytes) * (1 + slot)
            view = into.data.cast("B")
            if seg.mapping is not None:  # sealed: one memcpy, which cannot fault
                copy_split(view, seg.mapping, offset, scan)
                return into
            try:
                done = read_split(seg.fd, view, offset)
            except OSError as exc:
                raise SegmentUnusable(worker_id, f"reading it: {exc.strerror}") from None
            if done < len(view):
                raise BrokenSegment(worker_id, f"ends inside slot {slot} (truncated while read)")
        if scan is not None:
            scan(np.frombuffer(view, np.uint8))
        return into

    def put_weights(self, worker_id: str, weights: np.ndarray) -> None:
        """Write ``weights`` (the segment's dtype, contiguous) into the worker's weights region.

        Raises:
            InvalidRequest: no segment.
            BrokenSegment: the segment changed size, or cannot be written (a full /dev/shm).
        """
        if weights.nbytes != self.total_bytes or not weights.flags.c_contiguous:
            raise ValueError(f"Weights need {self.total_bytes} contiguous bytes.")
        with self._using(worker_id) as seg:
            self._check_size(worker_id, seg)
            if seg.mapping is not None:  # sealed: a memcpy, split over the server's threads
                pieces.copy(
                    np.frombuffer(seg.mapping, np.uint8, self.total_bytes, _ALIGN),
                    np.frombuffer(weights.data.cast("B"), np.uint8),
                )
                return
            try:
                write_at(seg.fd, weights.data.cast("B"), _ALIGN)
            except OSError as exc:  # EFBIG, ENOSPC: this server's limits, not the worker's
                raise SegmentUnusable(worker_id, f"writing it: {exc.strerror}") from None

    def rows_room(self, worker_id: str) -> int:
        """The bytes of each of the worker's rows parts (0: it has none, or no segment)."""
        with self._lock:
            seg = self._by_worker.get(worker_id)
            return seg.rows_bytes if seg is not None else 0

    def put_rows(self, worker_id: str, values: list[bytes], stamp: int) -> None:
        """Write a row pull's ``values`` (one table after another) into the worker's rows part
        for pulls, after its ``ROWS_STAMP`` bytes: 0 there while they are written, then
        ``stamp`` (a late writer of another pull leaves its own: the worker sees it).

        Raises:
            InvalidRequest: no segment, or they do not fit its part.
            BrokenSegment: the segment changed size, or cannot be written.
        """
        with self._using(worker_id) as seg:
            data = b"".join(values)
            if ROWS_STAMP + len(data) > seg.rows_bytes:
                raise InvalidRequest(
                    f"A row pull of {len(data)} bytes does not fit worker {worker_id}'s rows "
                    f"part of {seg.rows_bytes}."
                )
            self._check_size(worker_id, seg)
            offset = rows_offset(self.total_bytes, seg.nslots, seg.rows_bytes, 0)
            pieces = [
                (offset, bytes(8)),
                (offset + ROWS_STAMP, data),
                (offset, (stamp & (2**64 - 1)).to_bytes(8, "little")),
            ]
            for at, piece in pieces:
                if seg.mapping is not None:
                    seg.mapping[at : at + len(piece)] = piece
                    continue
                try:
                    write_at(seg.fd, memoryview(piece), at)
                except OSError as exc:
                    raise SegmentUnusable(worker_id, f"writing it: {exc.strerror}") from None

    def rows(self, worker_id: str, slot: int, offset: int, nbytes: int) -> bytes:
        """``nbytes`` of a push's row values the worker wrote at ``offset`` of slot ``slot``'s
        rows part, copied (the server's own bytes, which the worker cannot change).

        Raises:
            InvalidRequest: no segment, no such slot, or bytes outside the part.
            BrokenSegment: the segment changed size, or cannot be read.
        """
        with self._using(worker_id) as seg:
            if not 0 <= slot < seg.nslots:
                raise InvalidRequest(
                    f"Worker {worker_id} pushed rows from slot {slot}; its segment has "
                    f"{seg.nslots}."
                )
            if offset < 0 or nbytes < 0 or offset + nbytes > seg.rows_bytes:
                raise InvalidRequest(
                    f"Worker {worker_id} pushed rows at bytes [{offset}, {offset + nbytes}) "
                    f"of a rows part of {seg.rows_bytes}."
                )
            self._check_size(worker_id, seg)
            at = rows_offset(self.total_bytes, seg.nslots, seg.rows_bytes, 1 + slot) + offset
            if seg.mapping is not None:
                return bytes(seg.mapping[at : at + nbytes])
            out = bytearray(nbytes)
            try:
                done = read_at(seg.fd, memoryview(out), at)
            except OSError as exc:
                raise SegmentUnusable(worker_id, f"reading it: {exc.strerror}") from None
            if done < nbytes:
                raise BrokenSegment(worker_id, f"ends inside slot {slot}'s rows (truncated)")
            return bytes(out)

    @staticmethod
    def _check_size(worker_id: str, seg: _Attached) -> None:
        if seg.mapping is not None:  # sealed: its size cannot change (no fstat a step)
            return
        try:
            size = os.fstat(seg.fd).st_size
        except OSError as exc:
            raise BrokenSegment(worker_id, f"cannot be examined ({exc.strerror})") from None
        if size != seg.size:
            raise BrokenSegment(
                worker_id,
                f"holds {size} bytes, not the {seg.size} it held at Join (truncated "
                "or resized while in use)",
            )

    def close(self) -> None:
        with self._lock:
            workers = list(self._by_worker)
        for worker_id in workers:
            self.detach(worker_id)
