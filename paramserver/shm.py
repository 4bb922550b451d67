"""Same-host shared memory for payloads: gRPC keeps the control, /dev/shm carries the bytes.

A worker creates a segment in ``/dev/shm`` (mode 0600) with a random nonce at its start and
offers it in Join. A server that can open it, finds the right size and reads the same nonce
shares the worker's host and ``/dev/shm`` (another host, or another container, cannot), so it
maps the segment; otherwise it declines and the payloads keep streaming over gRPC. Once the
server has answered, the worker unlinks the name: the memory lives while either side maps it,
and a worker killed with -9 leaves nothing behind in ``/dev/shm``.

Then a pull writes the weights into the segment's weights region and answers with a header
alone, and a push names the slot its gradient was written to: one memcpy each way instead of
framing, socket and copies. The nonce is compared in constant time; the name must match
``paramserver-*`` so a request cannot point the server at another file.

Layout: a 64-byte header (the nonce), the weights, then one slot per push in flight; every
region starts on a 64-byte boundary.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass

import numpy as np

from paramserver.errors import InvalidRequest

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NONCE_BYTES = 16
_ALIGN = 64
_NAME = re.compile(r"paramserver-[A-Za-z0-9_-]{1,64}")


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


class Attachments:
    """The server's side: the segments of the workers that offered one, by worker id."""

    def __init__(self, total_bytes: int, dtype: str = "float32"):
        self.total_bytes = total_bytes
        self.dtype = dtype
        self._lock = threading.Lock()
        self._by_worker: dict[str, _Regions] = {}

    def attach(self, worker_id: str, name: str, nonce: bytes, slots: int) -> bool:
        """Map the segment ``name`` for ``worker_id`` if it is the worker's; False if not.

        A segment that cannot be opened (another host or container), has the wrong size or
        another nonce is declined, and the worker streams over gRPC.
        """
        self.detach(worker_id)
        if not name:
            return False
        if not _NAME.fullmatch(name) or not 1 <= slots <= 64:
            log.info("worker %s offered a malformed segment %r; streaming", worker_id, name)
            return False
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            log.info("worker %s: cannot open %s (%s): not on this host; streaming", worker_id,
                     path, exc.strerror)  # fmt: skip
            return False
        try:
            size = os.fstat(fd).st_size
            if size != segment_bytes(self.total_bytes, slots):
                log.info("worker %s: %s has %d bytes, not %d; streaming", worker_id, path, size,
                         segment_bytes(self.total_bytes, slots))  # fmt: skip
                return False
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if not hmac.compare_digest(mapping[:NONCE_BYTES], nonce):
            mapping.close()
            log.info("worker %s: %s holds another nonce; streaming", worker_id, path)
            return False
        with self._lock:
            self._by_worker[worker_id] = _Regions.of(
                mapping, self.total_bytes, slots, self.dtype, bytes(nonce)
            )
        return True

    def detach(self, worker_id: str) -> None:
        """Unmap the segment of a worker that left or was dropped."""
        with self._lock:
            regions = self._by_worker.pop(worker_id, None)
        if regions is not None:
            regions.close()

    def authenticates(self, worker_id: str, nonce: bytes) -> bool:
        """Whether ``worker_id``'s mapped segment holds ``nonce`` (the control socket's hello)."""
        with self._lock:
            regions = self._by_worker.get(worker_id)
        return regions is not None and hmac.compare_digest(regions.nonce, nonce)

    def has(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._by_worker

    def _get(self, worker_id: str) -> _Regions:
        with self._lock:
            regions = self._by_worker.get(worker_id)
        if regions is None:
            raise InvalidRequest(
                f"Worker {worker_id} asked for shared memory but has no segment mapped here; "
                "join again."
            )
        return regions

    def weights(self, worker_id: str) -> np.ndarray:
        """The worker's weights region, for a pull to write into."""
        return self._get(worker_id).weights

    def gradient(self, worker_id: str, slot: int) -> np.ndarray:
        """A view of the gradient the worker wrote into ``slot``."""
        slots = self._get(worker_id).slots
        if not 0 <= slot < len(slots):
            raise InvalidRequest(
                f"Worker {worker_id} pushed from slot {slot}; its segment has {len(slots)}."
            )
        return slots[slot]

    def close(self) -> None:
        with self._lock:
            all_regions = list(self._by_worker.values())
            self._by_worker.clear()
        for regions in all_regions:
            regions.close()
