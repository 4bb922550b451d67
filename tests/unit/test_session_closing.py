"""A worker that is closing joins no shard again (issue 58's review): a background step
(overlapped local steps) that finds its session lost after ``close_quietly`` set the stop
event must not leave a new member behind its Leave, holding a sync round for a lease."""

from __future__ import annotations

import threading

import pytest

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import ServerUnavailable
from paramserver.worker.session import Session
from paramserver.worker.waits import Backoff


class _Channel:
    def __init__(self) -> None:
        self.joins: list[pb.JoinRequest] = []

    def join(self, request: pb.JoinRequest, timeout: float) -> pb.JoinResponse:
        self.joins.append(request)
        return pb.JoinResponse(worker_id="w-new", incarnation="i1")


def test_a_closing_worker_does_not_join_again_and_joins_once_it_is_not():
    stop = threading.Event()
    channel = _Channel()
    session = Session(lambda _: channel, "127.0.0.1:1", "w", 5.0, Backoff(5.0), stop)
    stop.set()
    with pytest.raises(ServerUnavailable, match="the worker is closing"):
        session.join(pb.JoinRequest(), retry=True)
    assert channel.joins == []  # nothing reached the server
    stop.clear()
    session.join(pb.JoinRequest(), retry=True)  # not closing: it joins
    assert len(channel.joins) == 1 and session.worker_id == "w-new"
