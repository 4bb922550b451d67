"""Which server-handed batches a shard has applied a gradient of, so that it applies each
batch once, whatever the faults (a retried push, a rejoin, a restarted shard).

A worker pushes one gradient to every shard, in separate calls; only shard 0 hands out the
batches. When a worker dies after its push reached shard 1 but before shard 0, shard 0
hands the batch out again, and its next gradient reaches shard 1 a second time: shard 1
finds the batch here, counts the push for the worker's clock and applies nothing. (Workers
push to shard 0 last, so a batch shard 0 counts done is on every shard.)

Compact for long runs: every batch below ``below`` is applied, and ``above`` holds the
applied ones past it (batches handed out again, or out of order). Pure bookkeeping; the
coordinator's lock guards it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paramserver.errors import InvalidRequest


@dataclass
class Ledger:
    below: int = 0
    above: set[int] = field(default_factory=set)
    applied: int = 0  # distinct batches applied
    repeated: int = 0  # pushes of batches already applied: counted, not applied

    def has(self, batch: int) -> bool:
        return batch < self.below or batch in self.above

    def seen(self, batches: Sequence[int], who: str) -> bool:
        """Whether every one of ``batches`` is applied already (none of them: False).

        Raises:
            InvalidRequest: some are and some are not (a gradient that cannot be split),
                or a batch id is negative or repeated.
        """
        if len(set(batches)) != len(batches) or any(b < 0 for b in batches):
            raise InvalidRequest(f"{who} names batches {list(batches)}: each once, none negative.")
        done = [b for b in batches if self.has(b)]
        if done and len(done) != len(batches):
            raise InvalidRequest(
                f"{who} computed batches {list(batches)}, of which this shard already applied "
                f"{done}: a gradient of several batches is applied whole or not at all."
            )
        return bool(done)

    def add(self, batches: Sequence[int]) -> None:
        for b in batches:
            if not self.has(b):
                self.above.add(b)
                self.applied += 1
        while self.below in self.above:
            self.above.remove(self.below)
            self.below += 1

    def state(self) -> dict[str, Any]:
        return {
            "below": self.below,
            "above": sorted(self.above),
            "applied": self.applied,
            "repeated": self.repeated,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Ledger:
        if not state:
            return cls()
        return cls(
            int(state["below"]),
            {int(b) for b in state["above"]},
            int(state["applied"]),
            int(state["repeated"]),
        )
