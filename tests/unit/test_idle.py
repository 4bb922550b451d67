"""``codec/idle.py``: a push's parameters without a gradient, as ranges of its shard's
elements: what a worker writes and a server takes (or refuses whole)."""

from __future__ import annotations

import pytest

from paramserver.codec import idle
from paramserver.errors import InvalidRequest


def test_ranges_are_cut_to_each_shard_from_its_start_and_joined_where_they_touch():
    spans = [(0, 4), (4, 6), (10, 20), (25, 30)]
    assert idle.ranges(spans, 0, 12) == ((0, 6), (10, 12))
    assert idle.ranges(spans, 12, 40) == ((0, 8), (13, 18))
    assert idle.ranges(spans, 20, 25) == ()
    assert idle.pairs(((0, 6), (10, 12))) == [0, 6, 10, 12]


def test_parse_takes_sorted_disjoint_ranges_within_the_parameters():
    assert idle.parse([], 10) == ()
    assert idle.parse([0, 2, 2, 5, 9, 10], 10) == ((0, 2), (2, 5), (9, 10))


@pytest.mark.parametrize(
    "pairs",
    [[0], [0, 0], [3, 2], [0, 11], [-1, 2], [0, 5, 4, 6], [5, 6, 0, 1]],
)
def test_parse_refuses_what_is_not_sorted_disjoint_ranges(pairs):
    with pytest.raises(InvalidRequest, match="without a gradient"):
        idle.parse(pairs, 10)


def test_common_is_what_both_leave_alone():
    assert idle.common(None, ((1, 3),)) == ((1, 3),)
    assert idle.common(((0, 5), (7, 9)), ((3, 8),)) == ((3, 5), (7, 8))
    assert idle.common(((0, 5),), ()) == ()
    assert idle.common(((0, 2),), ((2, 4),)) == ()
