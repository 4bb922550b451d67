"""What a server knows of its own checkpoint writes: the last one written, and whether writes
are failing, since when and why. Pure bookkeeping; the coordinator's lock guards it, the
checkpointer reports to it, and status, metrics and health read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Saves:
    version: int = -1  # of the last checkpoint written or resumed; -1: none
    at: float | None = None  # wall time it was written
    failures: int = 0  # writes that failed since the start
    failing_since: float | None = None  # wall time of the first failure since the last success
    error: str = ""  # why the last write failed; "" once one succeeds

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    def succeeded(self, version: int, at: float) -> None:
        self.version = max(self.version, version)
        self.at = at
        self.failing_since = None
        self.error = ""

    def failed(self, error: str, at: float) -> None:
        self.failures += 1
        self.error = error
        if self.failing_since is None:
            self.failing_since = at

    def failing_seconds(self, wall: float) -> float:
        """Seconds since writes began failing; -1 when the last write succeeded."""
        return -1.0 if self.failing_since is None else max(wall - self.failing_since, 0.0)
