"""Delay compensation (``--delay-compensation C``, ``ssp:K`` and ``async``): DC-ASGD
(Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML
2017), its adaptive form with Adam's second moment. A gradient ``g`` computed on the
weights ``w_read`` a worker's pull gave it reaches weights ``w_now`` that other workers'
pushes have moved since; it is applied as

    g + (C / lr) * g * g * (w_now - w_read) / (sqrt(v) + eps)

elementwise: the first-order Taylor term of the gradient at ``w_now``, the Hessian's
diagonal approximated by ``g * g`` (DC-ASGD's outer product), scaled by Adam's ``v``
(bias-corrected, as Adam's step reads it: the raw running mean starts near 0 and would
blow the first steps' correction up) as DC-ASGD-a scales by its mean square. DC-ASGD's
``lambda`` is ``C / lr`` here: an Adam step moves a weight by about ``lr``, so
``(w_now - w_read) / lr`` counts the steps missed and ``C`` does not change with the rate
(the step's own, under a schedule). Measured on the
Criteo-like DLRM, where one step of staleness of the dense part costs 0.019 AUC (git
history of docs/BENCHMARKS.md, issue 44; docs/architecture.md, What the benchmarks taught).

``Reads`` keeps the weights each pull answered, by (worker, iteration), until that
worker's push for the iteration takes them (a prefetching worker may hold the next
iteration's meanwhile), in buffers it recycles. Pure bookkeeping: the coordinator calls
``remember``, ``take``, ``give_back`` and ``forget`` under its lock; ``correct`` runs
under the apply lock on a gradient and a read that the push owns by then.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# Reads a worker may hold at once: its pulls not pushed yet (a prefetch, ssp:K's window);
# past this the oldest goes (its push, if it comes, is applied uncorrected and counted).
KEEP_A_WORKER = 8
EPS = 1e-8  # Adam's


class Reads:
    """The parameters (the first ``n`` values of the flat weights) each pull answered."""

    def __init__(self, strength: float, n: int):
        self.strength, self.n = strength, n
        self._held: dict[tuple[str, int], np.ndarray] = {}
        self._free: list[np.ndarray] = []

    @classmethod
    def of(cls, strength: float, n: int) -> Reads | None:
        """The reads of ``--delay-compensation strength`` over ``n`` parameters (0: none)."""
        return cls(strength, n) if strength > 0 else None

    def remember(self, worker_id: str, iteration: int, weights: np.ndarray) -> None:
        """Worker ``worker_id`` computes ``iteration`` on ``weights`` (copied)."""
        mine = sorted(it for w, it in self._held if w == worker_id)
        for it in mine[: max(0, len(mine) + 1 - KEEP_A_WORKER)]:
            self.give_back(self._held.pop((worker_id, it)))
        buf = self._free.pop() if self._free else np.empty(self.n, weights.dtype)
        np.copyto(buf, weights[: self.n])
        old = self._held.pop((worker_id, iteration), None)
        if old is not None:
            self.give_back(old)
        self._held[(worker_id, iteration)] = buf

    def take(self, worker_id: str, iteration: int) -> np.ndarray | None:
        """The weights ``iteration``'s push was computed on (None: not kept), now the
        caller's; the worker's earlier ones go (a push moves its clock past them)."""
        for key in [k for k in self._held if k[0] == worker_id and k[1] < iteration]:
            self.give_back(self._held.pop(key))
        return self._held.pop((worker_id, iteration), None)

    def give_back(self, buf: np.ndarray | None) -> None:
        """A read no push needs any more, for the next pull."""
        if buf is not None and len(self._free) < KEEP_A_WORKER:
            self._free.append(buf)

    def forget(self, live: Iterable[str]) -> None:
        """Drop the reads of every worker not in ``live`` (it left, or was evicted)."""
        keep = set(live)
        for key in [k for k in self._held if k[0] not in keep]:
            self.give_back(self._held.pop(key))

    @property
    def held(self) -> int:
        return len(self._held)

    def correct(
        self, grad: np.ndarray, read: np.ndarray, now: np.ndarray, v: np.ndarray, lr: float
    ) -> np.ndarray:
        """``grad`` + strength / lr * grad² * (now - read) / (sqrt(v) + eps): into ``grad``
        where it is writable (else a copy); ``read`` is overwritten (it is the push's own).
        At a rate of 0 nothing moves: ``grad`` as it came."""
        if lr <= 0:
            return grad
        if not grad.flags.writeable:
            grad = grad.copy()
        np.subtract(now[: self.n], read, out=read)  # how far the weights moved meanwhile
        read *= grad
        read *= grad
        denominator = np.sqrt(v)
        denominator += EPS
        read /= denominator
        read *= self.strength / lr
        grad += read
        return grad
