"""A worker's relay of each sync round's gradient norm between the shards
(``--clip-grad-norm`` on a sharded run: ``server/bookkeeping/norm_round.py``).

A shard's round, once complete, closes with its part of the step's squared norm and waits
for the total. Every worker relays: after it sends a push of round r, its relay thread asks
every shard (``StepNorm``; each call waits up to ten seconds for the round to close) for its
part; once every shard has closed the same round, it sums the parts in shard order (every
worker gets the same sum) and gives each shard the total, with which it applies the round.
A shard that applied a round says with which total, so a round that a worker gave to some
shards before it died is given to the rest by another. The main path is not touched: its
pulls simply wait for the round's apply, as they would for a slow worker.

Failures (a shard restarted or rewound, a link down, a lost lease) are the main path's to
recover from: the relay logs them (counted in ``failures``), waits a moment and asks again
with the sessions as they are then; it ends when the worker closes (``settle`` first waits,
boundedly, for the rounds this worker pushed to be applied)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import ParamServerError, RejoinRequired
from paramserver.worker.session import Session

log = logging.getLogger(__name__)

RETRY = 0.2  # seconds between tries after a failure
ASK = 30.0  # a StepNorm's deadline (the server answers within ten seconds)


class NormRelay:
    """The relay thread over ``sessions`` (one per shard, in shard order), ended by
    ``closed``."""

    def __init__(self, sessions: Sequence[Session], closed: threading.Event):
        self.sessions = list(sessions)
        self._closed = closed
        self._cond = threading.Condition()
        self.wanted = -1  # the newest round this worker pushed
        self.done = -1  # rounds up to this one are applied on every shard
        self.failures = 0
        self.relayed = 0  # rounds this worker gave a total for (to one shard at least)
        self.freed = 0  # shards left because another restarted while their round waited
        self._thread = threading.Thread(target=self._loop, name="ps-norm-relay", daemon=True)
        self._thread.start()

    def pushed(self, round_: int) -> None:
        """A push of ``round_`` goes out, or a pull of ``round_ + 1`` (a worker that joined
        while the round before waits: every worker that pushed it may be gone): relay its
        norm (and any earlier round's)."""
        with self._cond:
            if round_ > self.wanted:
                self.wanted = round_
                self._cond.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until the rounds pushed are applied on every shard (the last push of a
        worker that leaves), at most ``timeout`` seconds; whether they are."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done >= self.wanted, timeout)

    def _loop(self) -> None:
        seen: tuple[str, ...] = ()
        while not self._closed.is_set():
            now = tuple(s.incarnation for s in self.sessions)
            if now != seen:  # joined again after a restart or a rewind: rounds are redone
                seen = now
                with self._cond:
                    self.done = -1
            with self._cond:
                self._cond.wait_for(lambda: self.wanted > self.done or self._closed.is_set(), 1.0)
                target = self.wanted
            if target <= self.done or self._closed.is_set():
                continue
            try:
                if self.relay(target):
                    with self._cond:
                        self.done = max(self.done, target)
                        self._cond.notify_all()
            except ParamServerError as exc:  # the main path recovers: ask again after it
                self._failed(target, exc)
            except Exception as exc:  # noqa: BLE001 - a defect: said with its trace, retried
                if self.failures % 100 == 0:
                    log.exception("relaying round %d's norm failed", target)
                self._failed(target, exc)

    def _failed(self, target: int, exc: BaseException) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning("relaying round %d's norm: %s (%d so far)", target, exc, self.failures)
        self._closed.wait(RETRY)

    def _ask(
        self, s: Session, round_: int, total: float | None = None, *, who: str, inc: str
    ) -> pb.StepNormResponse:
        """StepNorm to ``s``'s shard as worker ``who`` of its incarnation ``inc``."""
        request = pb.StepNormRequest(
            worker_id=who, incarnation=inc, round=round_,
            has_total=total is not None, total=total or 0.0,
        )  # fmt: skip
        answer: pb.StepNormResponse = s.call("step norm", s.channel.step_norm, request, ASK)
        return answer

    def relay(self, target: int) -> bool:
        """One pass over the shards for round ``target``: give a total where every shard
        closed the same round (or one applied it already); whether ``target`` is applied
        on every shard.

        Raises:
            RejoinRequired: a shard restarted (or rewound, or dropped this worker) since the
                worker joined it: the shards whose round waits are left first (``_free``).
        """
        asked = self._ids()
        answers: list[pb.StepNormResponse | None] = []
        refused: list[int] = []
        stale: RejoinRequired | None = None
        for i, (s, (who, inc)) in enumerate(zip(self.sessions, asked, strict=True)):
            try:
                answers.append(self._ask(s, target, who=who, inc=inc))
            except RejoinRequired as exc:
                answers.append(None)
                refused.append(i)
                stale = exc
        if stale is not None:
            # the others are left only while a refusing shard (restarted, rewound, or its
            # lease gone) has the session asked with: only then may the main path wait,
            # unknowing, on a round that never applies. A StepNorm waits up to ten seconds,
            # so by the answer the main path may have joined that shard again, pushed there
            # and rewound the others: leaving them then took a healthy lease from under a
            # push it held, whose batch no worker logged.
            now = self._ids()
            if any(now[i] == asked[i] for i in refused):
                self._free(answers, asked)
            raise stale
        if asked != self._ids():
            return False  # joined again meanwhile: an answer may be of a state rewound since
        return self._give(target, [a for a in answers if a is not None], asked)

    def _ids(self) -> list[tuple[str, str]]:
        """Each session's worker id and incarnation: who the worker is on each shard now."""
        return [(s.worker_id, s.incarnation) for s in self.sessions]

    def _free(
        self, answers: list[pb.StepNormResponse | None], asked: list[tuple[str, str]]
    ) -> None:
        """A shard this worker knows restarted: its round there is lost, so the round waiting
        on the others will never have its total; and the worker's pull there waits on that
        round, so it would never learn of the restart. Leave those shards: the pull ends
        (the lease is gone), and the worker joins every shard again and rewinds them to
        the restarted one's cut (``shards.rewind_ahead``) as after any restart."""
        for s, a, (who, inc) in zip(self.sessions, answers, asked, strict=True):
            if a is not None and a.closed and (s.worker_id, s.incarnation) == (who, inc):
                log.warning("a shard restarted while the round at %s waits: leaving it", s.address)
                self.freed += 1
                # returning: a shard rewound since (by another worker) keeps this
                # worker's place from the cut, which its next join takes up
                request = pb.LeaveRequest(worker_id=who, incarnation=inc, returning=True)
                with contextlib.suppress(ParamServerError):
                    s.call("leave", s.channel.leave, request, ASK)

    def _give(
        self, target: int, answers: list[pb.StepNormResponse], asked: list[tuple[str, str]]
    ) -> bool:
        if all(a.applied for a in answers):
            return True
        closing = [a.round for a in answers if a.closed]
        if not closing:
            return False  # not closed yet everywhere: ask again
        q = min(closing)
        total = next((a.last_total for a in answers if a.last_round == q), None)
        if total is None:
            if not all(a.closed and a.round == q for a in answers):
                time.sleep(0.01)  # a shard's round q has not closed yet
                return False
            total = 0.0
            for a in answers:  # in shard order: every worker's sum is the same
                total += a.part
        for s, a, (who, inc) in zip(self.sessions, answers, asked, strict=True):
            if a.closed and a.round == q:  # as asked: a shard rewound since refuses it
                self._ask(s, q, total, who=who, inc=inc)
        self.relayed += 1
        return False  # asked again: ``target`` may be a later round
