"""Same-host shared memory for payloads: gRPC keeps the control, /dev/shm carries the bytes.

A worker creates a segment in ``/dev/shm`` (mode 0600) with a random nonce at its start and
offers it in Join. A server that can open it, finds a regular file of the right size and
reads the same nonce shares the worker's host and ``/dev/shm`` (another host, or another
container, cannot), so it keeps the segment's file open; otherwise it declines and the
payloads keep streaming over gRPC. Once the server has answered, the worker unlinks the
name: the memory lives while either side holds it, and a worker killed with -9 leaves
nothing behind in ``/dev/shm``.

Then a pull writes the weights into the segment's weights region and answers with a header
alone, and a push names the slot its gradient was written to. The nonce is compared in
constant time; the name must match ``paramserver-*`` so a request cannot point the server at
another file.

The server never maps a segment: the worker owns the file and may truncate it at any
moment, and a mapped page past the end of the file kills the process that touches it with
SIGBUS. So the server reads a pushed gradient with ``preadv`` into its own buffer and writes
pulled weights with ``pwrite``, on the file descriptor it opened at Join: a read past the
end comes back short, a write past it extends the file, neither can fault. Each access
checks the file's size first; a segment whose size changed, or that cannot be read or
written, is refused (``BrokenSegment``) and its worker dropped. Because the gradient is
copied before it is checked, the checks and the optimizer see the same bytes, whatever the
worker writes into its slot meanwhile. A pull is one copy, as through a mapping, and a push
one more than through a mapping (which read the gradient in place); a copy by the kernel
from or to tmpfs runs at about half memcpy's speed, so a large gradient is read by two
threads at once (``SPLIT_READ_BYTES``).

Layout: a 64-byte header (the nonce), the weights, then one slot per push in flight; every
region starts on a 64-byte boundary.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from paramserver.errors import BrokenSegment, InvalidRequest, SegmentUnusable

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NONCE_BYTES = 16
_ALIGN = 64
_NAME = re.compile(r"paramserver-[A-Za-z0-9_-]{1,64}")
# A gradient at least this large is read by two threads at once, half each: one read from
# tmpfs copies at about half memcpy's speed (13 ms against 6 for 64 MiB on the 2-core
# machine), two at once as fast as a memcpy. Writes would not overlap (the kernel takes the
# file's lock for each), so a pull's weights are written by one.
SPLIT_READ_BYTES = 8 << 20
_readers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ps-shm-read")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def segment_bytes(total_bytes: int, slots: int) -> int:
    """The size of a segment for a model of ``total_bytes`` and ``slots`` pushes in flight."""
    return _ALIGN + _aligned(total_bytes) * (1 + slots)


def available() -> bool:
    """Whether this machine has a /dev/shm to put segments in."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


@dataclass
class _Regions:
    """Views of a mapped segment, as the flat buffer's dtype: the weights and the push slots."""

    mapping: mmap.mmap
    weights: np.ndarray
    slots: list[np.ndarray]
    nonce: bytes = b""

    @classmethod
    def of(
        cls, mapping: mmap.mmap, total_bytes: int, slots: int, dtype: str, nonce: bytes = b""
    ) -> _Regions:
        raw = np.frombuffer(mapping, np.uint8)
        step = _aligned(total_bytes)

        def region(i: int) -> np.ndarray:
            start = _ALIGN + i * step
            return raw[start : start + total_bytes].view(dtype)

        return cls(mapping, region(0), [region(1 + i) for i in range(slots)], nonce)

    def close(self) -> None:
        self.weights = np.empty(0, np.float32)
        self.slots = []
        # A view still referenced keeps the mapping; it is unmapped with the last one.
        with contextlib.suppress(BufferError):
            self.mapping.close()


class Segment:
    """The worker's side: creates, names and owns a segment."""

    def __init__(self, total_bytes: int, slots: int, dtype: str = "float32"):
        self.name = f"paramserver-{os.getpid()}-{secrets.token_hex(8)}"
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.total_bytes = total_bytes
        self.nslots = slots
        size = segment_bytes(total_bytes, slots)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        mapping[:NONCE_BYTES] = self.nonce
        self._regions = _Regions.of(mapping, total_bytes, slots, dtype)

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @property
    def weights(self) -> np.ndarray:
        return self._regions.weights

    @property
    def slots(self) -> list[np.ndarray]:
        return self._regions.slots

    def unlink(self) -> None:
        """Remove the name (the memory stays while mapped)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        self._regions.close()


class _Attached:
    """A worker's segment as the server holds it: the open file, never a mapping. ``users``:
    reads and writes in progress; the file is closed when it is detached and none is left
    (never under one: its descriptor's number could be another file's by then)."""

    __slots__ = ("fd", "size", "nslots", "nonce", "users", "detached")

    def __init__(self, fd: int, size: int, nslots: int, nonce: bytes):
        self.fd, self.size, self.nslots, self.nonce = fd, size, nslots, nonce
        self.users = 0
        self.detached = False


class Attachments:
    """The server's side: the segments of the workers that offered one, by worker id, held
    open (never mapped); thread-safe."""

    def __init__(self, total_bytes: int, dtype: str = "float32"):
        self.total_bytes = total_bytes
        self.dtype = dtype
        self._lock = threading.Lock()
        self._by_worker: dict[str, _Attached] = {}
        self._declined: set[str] = set()  # workers whose segments this server cannot use

    def attach(self, worker_id: str, name: str, nonce: bytes, slots: int) -> bool:
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
        if not _NAME.fullmatch(name) or not 1 <= slots <= 64:
            log.info("worker %s offered a malformed segment %r; streaming", worker_id, name)
            return False
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
        except OSError as exc:
            log.info(
                "worker %s: cannot open %s (%s): not on this host; streaming",
                worker_id,
                path,
                exc.strerror,
            )
            return False
        size = segment_bytes(self.total_bytes, slots)
        try:
            why = self._declines(fd, size, nonce)
        except OSError as exc:
            why = f"cannot be read ({exc.strerror})"
        if why:
            os.close(fd)
            log.info("worker %s: %s %s; streaming", worker_id, path, why)
            return False
        with self._lock:
            self._by_worker[worker_id] = _Attached(fd, size, slots, bytes(nonce))
        return True

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
            os.close(seg.fd)

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
                os.close(seg.fd)

    def gradient(self, worker_id: str, slot: int, into: np.ndarray | None = None) -> np.ndarray:
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
            try:
                done = _read_split(seg.fd, view, offset)
            except OSError as exc:
                raise SegmentUnusable(worker_id, f"reading it: {exc.strerror}") from None
            if done < len(view):
                raise BrokenSegment(worker_id, f"ends inside slot {slot} (truncated while read)")
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
            try:
                _write_at(seg.fd, weights.data.cast("B"), _ALIGN)
            except OSError as exc:  # EFBIG, ENOSPC: this server's limits, not the worker's
                raise SegmentUnusable(worker_id, f"writing it: {exc.strerror}") from None

    @staticmethod
    def _check_size(worker_id: str, seg: _Attached) -> None:
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


def _read_split(fd: int, view: memoryview, offset: int) -> int:
    """``_read_at``, the second half of a large ``view`` on another thread; returns once
    both halves are read (or failed), so ``fd`` is in use by neither after."""
    if len(view) < SPLIT_READ_BYTES:
        return _read_at(fd, view, offset)
    half = len(view) // 2 // _ALIGN * _ALIGN
    second = _readers.submit(_read_at, fd, view[half:], offset + half)
    try:
        first = _read_at(fd, view[:half], offset)
    finally:
        rest = second.result()
    return first + rest if first == half else first


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` of ``fd`` until it is full or the file ends; the
    bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd`` (a write may take part of it)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n == 0:
            raise OSError(0, "nothing written")
        done += n
