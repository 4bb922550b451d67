"""How long to wait between retries of a call that found no server, and when to give up.

Pure decisions: the clock and the random source are injected, so a test drives a whole
outage without sleeping.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Capped exponential backoff with full jitter, from 0.1 s up to 2 s between tries.
FIRST = 0.1
CAP = 2.0


@dataclass
class Backoff:
    """Delays for successive retries and the moment to stop retrying.

    Args:
        budget: seconds from the first failure after which ``expired`` says give up.
        first, cap: the first delay's upper bound, and the largest.
        now: a monotonic clock.
        rng: a source of uniform numbers in [0, 1).
    """

    budget: float
    first: float = FIRST
    cap: float = CAP
    now: Callable[[], float] = time.monotonic
    rng: Callable[[], float] = field(default=random.random)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (0 first): uniform in
        [0, min(cap, first * 2**attempt))."""
        return self.rng() * min(self.cap, self.first * 2 ** min(attempt, 62))

    def expired(self, since: float) -> bool:
        """Whether failures that began at ``since`` (a ``now()`` reading) have lasted the
        whole budget."""
        return self.now() - since >= self.budget
