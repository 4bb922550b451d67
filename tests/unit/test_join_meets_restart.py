"""A worker starting while a shard restarts: its first join of the shard meets the old
incarnation and its second (the one that opens the payload path) the restarted one, back at
its newest cut, while the other shards are rounds ahead. No heartbeat had marked the
session lost, so the worker used to take the gap for shards a round apart and bridge it with
empty pushes; the workers already in the run then waited on it at the other shard, and it on
them at the restarted one: the run hung (CI's chaos soak, stop 65). Now a restart that any
join finds brings every shard back to its cut, as a restart found by a heartbeat does."""

from __future__ import annotations

import threading

from torch import nn

import paramserver as ps
from tests.conftest import FakeClock, WorkerThread, ones_step
from tests.inprocess import shards_with_cuts


def _zero_model() -> nn.Module:
    model = nn.Linear(6, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model


def test_a_shard_restarting_between_a_new_workers_joins_rewinds_the_others(tmp_path):
    clock = FakeClock()
    servers = shards_with_cuts(
        _zero_model(), clock, str(tmp_path), policy="sync", workers=2, min_workers=1
    )
    first_model = _zero_model()
    first = ps.Worker(
        list(servers), first_model, channel=lambda a: servers[a].channel(a), shm=False, clock=clock
    )
    for _ in range(3):
        ones_step(first, first_model)  # clock 3 on both shards; their newest cut is at 2

    joins = {"s0": 0, "s1": 0}

    def restarting(address: str):
        channel = servers[address].channel(address)
        join = channel.join

        def counted(request, timeout=None):
            joins[address] += 1
            if address == "s1" and joins[address] == 2:
                servers["s1"].restart()  # from its cut, at clock 2; s0 is at clock 3
            return join(request, timeout)

        channel.join = counted  # type: ignore[method-assign]
        return channel

    joined: list[ps.Worker] = []
    second = WorkerThread(
        lambda: joined.append(
            ps.Worker(list(servers), _zero_model(), channel=restarting, shm=False, clock=clock)
        )
    )
    second.start()
    second.join(60)
    stuck = second.is_alive()
    try:
        assert not stuck, (
            "the new worker's first pull waits on the others: it bridged the restart with "
            f"empty pushes (shard rounds {[s.coordinator.rounds for s in servers.values()]})"
        )
        second.result()
        late = joined[0]
        assert joins["s1"] >= 2 and [s.clock for s in late.sessions] == [2, 2]
        assert [s.coordinator.rounds for s in servers.values()] == [2, 2]  # s0 rewound
        # the run goes on as one model: the first worker joins both again at the cut
        try:
            ones_step(first, first_model)
        except ps.ServerRewound as exc:
            assert exc.step == 2
        assert [s.clock for s in first.sessions] == [2, 2]
        late.close()
    finally:
        if stuck:  # unblock its wait: the servers' state is not worth keeping then
            threading.Thread(target=first.close, daemon=True).start()
        else:
            first.close()
