"""The dense apply, off the coordinator's lock (``ssp:K`` and ``async``).

A push is accepted under the coordinator's lock (its clock, batches, ledger, buffers and
rows, as before) and its gradient waits in ``pending``. One thread at a time, holding
``Applies.lock`` (the apply lock), takes every gradient pending, steps the optimizer on the
flat float32 master outside the coordinator's lock, and publishes the new version under it.
Meanwhile pulls are answered from the last published version: the live weights when no
apply runs, else a snapshot of the version the apply started from (``view``), so a pull
never waits on an apply (but for the rare pull that finds neither: it waits for the
publish). The staleness a pull reports stays exact: under ``ssp:K`` a pull reads the
slowest clock whose pushes are all published (``low``), not merely accepted.

``--coalesce on``: the gradients taken together (those that arrived while the previous
apply ran) are summed into one buffer and applied in one optimizer step, as a BytePS or
ps-lite server sums pushes: for SGD this is the same first-order update as stepping each
in turn at that step's rate; for Adam it is one step of the sum, so the moments see one
gradient instead of several. Each push still counts once for the version (the learning-
rate schedule's step), its worker's clock, the batches applied and the staleness metrics.
``--coalesce off`` steps once per push, in arrival order.

Decisions and bookkeeping are the coordinator's (under its lock); this module holds what
crosses the two locks. The lock order is always the apply lock, then the coordinator's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from paramserver.codec.idle import Idle, common
from paramserver.errors import ParamServerError
from paramserver.server.bookkeeping.compensation import Reads
from paramserver.server.bookkeeping.leases import Membership
from paramserver.server.bookkeeping.status import Counters
from paramserver.server.bookkeeping.store import ParameterStore

log = logging.getLogger("paramserver.server.engine.coordinator")

# A pull answered within this many seconds makes an apply keep a copy of the version it
# replaces (so the next pull need not wait); a server nobody pulls from copies nothing.
PULLS_RECENT_SECONDS = 1.0


# Pushes answered before their gradient is applied, at most, at once (each holds its
# receive buffer until then): past this a push is answered once applied, as any other.
MAX_AHEAD = 2


@dataclass(eq=False)
class Pending:
    """A gradient accepted and not yet published; ``release`` (a push answered before
    this is applied) gives its buffer back once it is."""

    worker_id: str
    grad: np.ndarray
    done: bool = False
    error: BaseException | None = None
    release: Callable[[], None] | None = None
    read: np.ndarray | None = None  # the weights it was computed on (delay compensation)
    idle: Idle = ()  # its parameters without a gradient (``codec/idle.py``)
    clip: float | None = None  # the factor its norm over the whole model clips it by


@dataclass(frozen=True)
class Frozen:
    """A published version held while the live weights change: what ``answer`` reads."""

    version: int
    weights: np.ndarray  # read-only

    def snapshot(self) -> np.ndarray:
        return self.weights


@dataclass
class Applies:
    """The gradients waiting for the optimizer, and what pulls read meanwhile; ``cond``:
    the coordinator's lock, under which every method but ``apply`` is called."""

    store: ParameterStore
    counters: Counters = field(default_factory=Counters)
    cond: threading.Condition = field(default_factory=threading.Condition)
    now: Callable[[], float] = time.monotonic
    coalesce: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[Pending] = field(default_factory=list)
    running: list[Pending] = field(default_factory=list)  # taken by the apply in progress
    unpublished: Counter[str] = field(default_factory=Counter)
    frozen: Frozen | None = None
    pulled_at: float = -math.inf
    ahead: int = 0  # pushes answered before their gradient is applied, not yet published
    stepped: int = 0  # of ``running``, those the optimizer has stepped on
    closed: bool = False
    _sum: np.ndarray | None = None
    _thread: threading.Thread | None = None
    published: Callable[[], None] = lambda: None  # under the lock, after each publish
    reads: Reads | None = None  # --delay-compensation: the weights each pull answered

    # --- under the coordinator's lock ---------------------------------------------------

    def add(
        self, worker_id: str, grad: np.ndarray, iteration: int = 0, idle: Idle = (),
        clip: float | None = None,
    ) -> Pending:  # fmt: skip
        item = Pending(worker_id, grad, idle=idle, clip=clip)
        if self.reads is not None:
            item.read = self.reads.take(worker_id, iteration)
            if item.read is None:
                self.counters.uncompensated += 1
            else:
                self.counters.compensated += 1
        self.pending.append(item)
        self.unpublished[worker_id] += 1
        return item

    @property
    def next_version(self) -> int:
        """The version the next gradient accepted will make (its step's rate)."""
        return self.store.version + len(self.pending) + len(self.running)

    @property
    def idle(self) -> bool:
        """Every accepted gradient is published: the weights hold every clock counted."""
        return not self.pending and not self.running

    def low(self, membership: Membership) -> int | None:
        """The slowest live clock counting only published pushes."""
        low = membership.min_clock()
        if low is None or not self.unpublished:
            return low
        return min(m.clock - self.unpublished[w] for w, m in membership.members.items())

    def view(self) -> ParameterStore | Frozen | None:
        """What a pull reads now: the store itself while no apply runs, else the version the
        apply started from (None: no copy of it was kept; wait for the publish)."""
        self.pulled_at = self.now()
        return self.store if not self.running else self.frozen

    def begin(self) -> list[Pending]:
        """Take every pending gradient for the apply about to run; keep the version it
        replaces for pulls if any came lately."""
        if self.now() - self.pulled_at < PULLS_RECENT_SECONDS:
            self.frozen = Frozen(self.store.version, self.store.snapshot())
        self.running, self.pending, self.stepped = self.pending, [], 0
        return self.running

    def answer_early(
        self, item: Pending | None, keep: Callable[[], Callable[[], None]] | None
    ) -> bool:
        """Whether the push of ``item`` (None: nothing waits) may be answered before it is
        applied (``keep``, None: it may not, takes its buffer over: given back once it is);
        the server's applier thread applies it."""
        if item is None or keep is None or self.ahead >= MAX_AHEAD or self.closed:
            return False
        item.release = keep()
        self.ahead += 1
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="ps-apply", daemon=True)
            self._thread.start()
        return True

    def _done(self, item: Pending, error: BaseException | None) -> None:
        item.done, item.error = True, error
        if self.reads is not None:
            self.reads.give_back(item.read)
        item.read = None
        if item.release is not None:
            item.release()
            self.ahead -= 1
            if error is not None:
                log.error(
                    "a gradient of worker %s answered before it was applied was lost: %r",
                    item.worker_id,
                    error,
                )

    def publish(self, error: BaseException | None) -> int:
        """The apply ended: the gradients it stepped (``stepped``, in order) are the new
        version; the rest failed with ``error``. Returns how many it published."""
        taken, self.running, self.frozen = self.running, [], None
        for i, item in enumerate(taken):
            self._done(item, None if i < self.stepped else error)
            self.unpublished[item.worker_id] -= 1
            if self.unpublished[item.worker_id] <= 0:
                del self.unpublished[item.worker_id]
        self.store.version += self.stepped
        if self.stepped > 1 and self.coalesce:
            self.counters.coalesced += self.stepped
        if error is not None:
            self.counters.apply_failures += len(taken) - self.stepped
        self.store.retire()
        return self.stepped

    def discard(self, error: BaseException) -> None:
        """Drop every gradient not yet applied (a rewind): their pushers get ``error``."""
        for item in self.pending:
            self._done(item, error)
        self.pending = []
        self.unpublished = Counter(item.worker_id for item in self.running)

    def drain(self) -> bool:
        """Apply every pending gradient here and now (the caller holds both locks: a
        checkpoint's state holds every clock it counts); whether there were any."""
        if not self.pending:
            return False
        version = self.store.version
        error = self._stepped(self.begin(), version)
        self.publish(error)
        if error is not None and not isinstance(error, Exception):
            raise error
        return True

    # --- outside it ----------------------------------------------------------------------

    def close(self) -> None:
        """No push is answered early any more; the applier thread ends once nothing is
        pending."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _loop(self) -> None:
        """The applier thread: applies what pushes answered early left pending (and what
        came with them), publishing each through ``published``."""
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.cond.wait()
                if not self.pending:
                    return
                item = self.pending[0]
            try:
                self.apply(item, self.published)
            except ParamServerError:
                pass  # logged and counted where it failed; the pusher was answered already
            except Exception:  # noqa: BLE001 - a defect of this loop: said, and it goes on
                log.exception("the applier thread failed; it goes on")

    def apply(self, waiting: Pending, published: Callable[[], None]) -> None:
        """Step the optimizer on ``waiting`` and every gradient pending with it, off the
        coordinator's lock, unless an apply that ran meanwhile took it; returns once it is
        published (``published`` runs under the lock right after).

        Raises:
            ParamServerError: the optimizer's step failed (logged and counted), or the
                gradient was dropped (a rewind: ``WrongIncarnation``).
        """
        with self.lock:
            with self.cond:
                version = self.store.version
                taken = [] if waiting.done else self.begin()
            if taken:
                error = self._stepped(taken, version)
                with self.cond:
                    self.publish(error)
                    published()
                if error is not None and not isinstance(error, Exception):
                    raise error
        if isinstance(waiting.error, ParamServerError):
            raise waiting.error
        if waiting.error is not None:
            raise ParamServerError(f"The server failed to apply the gradient: {waiting.error!r}")

    def _stepped(self, taken: Sequence[Pending], version: int) -> BaseException | None:
        """``run``, and what it raised (logged), if anything."""
        try:
            self.run(taken, version)
            return None
        except BaseException as exc:  # noqa: BLE001 - published as the gradients' failure
            log.exception(
                "the optimizer's step failed: %d of %d gradients applied",
                self.stepped,
                len(taken),
            )
            return exc

    def run(self, taken: Sequence[Pending], version: int) -> None:
        """Step the optimizer on ``taken``, from published ``version``: their sum in one step
        (``coalesce``), else one step each; ``stepped`` counts those in the weights."""
        if self.coalesce and len(taken) > 1:
            rate = self.store.rate(version)
            total = self._summed([self._clipped(item, rate) for item in taken])
            left: Idle | None = None
            for item in taken:  # left alone only where no push had a gradient
                left = common(left, item.idle)
            clipped = 1.0 if taken[0].clip is not None else None  # each push by its own norm
            self.store.step(total, rate, left or (), clipped)
            self.stepped = len(taken)
            return
        for i, item in enumerate(taken):
            rate = self.store.rate(version + i)
            self.store.step(self._corrected(item, rate), rate, item.idle, item.clip)
            self.stepped = i + 1

    def _clipped(self, item: Pending, rate: float) -> np.ndarray:
        """``_corrected``, scaled by the push's clip factor where it has one (coalesced)."""
        grad = self._corrected(item, rate)
        return grad if item.clip is None or item.clip == 1.0 else grad * grad.dtype.type(item.clip)

    def _corrected(self, item: Pending, rate: float) -> np.ndarray:
        """``item``'s gradient, delay-compensated for where the weights went since it was
        computed (``--delay-compensation``; as it came where no read was kept, or before
        the optimizer's first step, which has no second moment yet)."""
        if self.reads is None or item.read is None:
            return item.grad
        v = self.store.second_moment()
        if v is None:
            return item.grad
        return self.reads.correct(item.grad, item.read, self.store.weights, v, rate)

    def _summed(self, grads: list[np.ndarray]) -> np.ndarray:
        """``grads`` added into one buffer that every coalesced apply reuses."""
        first = grads[0]
        if self._sum is None or self._sum.shape != first.shape or self._sum.dtype != first.dtype:
            self._sum = np.empty_like(first)
        np.add(first, grads[1], out=self._sum)
        for g in grads[2:]:
            self._sum += g
        return self._sum
