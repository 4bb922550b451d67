"""The parameters a step leaves alone: those whose gradient was None (issue 56, must 7).

torch's optimizers skip a parameter whose ``.grad`` is None: no decay, no momentum, no
moment of Adam's moves it. A push names such parameters as ranges of its shard's elements
(``PushHeader.idle``); ``Idle`` is that set, sorted and disjoint. Under sync a range is
left alone only where no push of the round had its gradient (``common``), as a large
batch's backward would have given it one; coalesced async pushes the same.

Pure functions: a worker writes them (``ranges``, ``pairs``), a server reads them
(``parse``, ``common``) and its store leaves them alone (``ParameterStore.step``).
"""

from __future__ import annotations

from collections.abc import Sequence

from paramserver.errors import InvalidRequest

# (start, end) pairs of elements of the parameters' section, sorted and disjoint
Idle = tuple[tuple[int, int], ...]

# A push naming more ranges is refused; a worker with more pushes its parameters without
# a gradient as zeros instead (16 bytes a range: 1 MiB, what a control-socket frame holds)
MAX_RANGES = 1 << 16


def parse(pairs: Sequence[int], n_params: int) -> Idle:
    """``PushHeader.idle`` as ranges, or InvalidRequest: an even count of at most
    ``2 * MAX_RANGES`` numbers, each range non-empty within [0, ``n_params``), sorted and
    disjoint."""
    if len(pairs) % 2 or len(pairs) > 2 * MAX_RANGES:
        raise InvalidRequest(
            f"A push names {len(pairs)} numbers of parameters without a gradient: pairs "
            f"(start, end), at most {MAX_RANGES} of them."
        )
    out = []
    last = 0
    for i in range(0, len(pairs), 2):
        lo, hi = int(pairs[i]), int(pairs[i + 1])
        if not last <= lo < hi <= n_params:
            raise InvalidRequest(
                f"A push's range [{lo}, {hi}) of parameters without a gradient is empty, "
                f"unsorted, overlapping or outside this shard's {n_params} parameters."
            )
        out.append((lo, hi))
        last = hi
    return tuple(out)


def common(a: Idle | None, b: Idle) -> Idle:
    """The ranges in both ``a`` and ``b`` (``a`` None: no push yet, so ``b``)."""
    if a is None:
        return b
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def ranges(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> Idle:
    """The parts of ``spans`` (elements of the whole flat buffer, sorted and disjoint: the
    parameters without a gradient) in a shard's elements [lo, hi), from its start, joined
    where they touch."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        a, b = max(a, lo) - lo, min(b, hi) - lo
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def pairs(idle: Idle) -> list[int]:
    """``idle`` as ``PushHeader.idle`` carries it."""
    return [x for r in idle for x in r]
