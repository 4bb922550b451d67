"""The flat replica (``worker/flat.py``) on CPU: the tensors become views of flat blocks,
stage and load give what the per-tensor replica gives, gradient buckets leave during
backward (copies deferred until ``wait`` as a CUDA stream would run them) and staging copies
only what did not go."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.worker.flat import FlatReplica, replica
from paramserver.worker.replica import Replica


def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    )


def backward(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    F.cross_entropy(model(x), y).backward()


class DeferredCopies:
    """Copies run at ``wait``, as a side stream would run them later: a slot read before
    ``wait`` holds stale bytes, a gradient zeroed before it is copied as zeros."""

    def __init__(self, read_at_once: bool = False) -> None:
        self.read_at_once = read_at_once  # the copy reads its source when enqueued
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0
        self.readies = 0

    def ready(self) -> Any:
        self.readies += 1
        return self.readies

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        assert after is not None  # every copy is ordered after the compute
        self.queued.append((dst, src.clone() if self.read_at_once else src))

    def wait(self) -> None:
        for dst, src in self.queued:
            dst.copy_(src)
        self.done += len(self.queued)
        self.queued = []

    def fence(self) -> None:
        assert not self.queued, "the compute may not overwrite what a copy has not read yet"


def expected_push(model: nn.Module) -> torch.Tensor:
    """What a push carries: the gradients, then the buffers' values, as float32."""
    r = Replica(model)
    out = torch.empty(r.manifest.numel)
    r.stage([(0, r.manifest.numel, out)])
    return out


def halves(n: int) -> tuple[list[tuple[int, int, torch.Tensor]], torch.Tensor]:
    """Two shard ranges splitting the flat buffer mid-tensor, and the buffer under both."""
    whole = torch.full((n,), float("nan"))
    cut = n // 2 + 1
    return [(0, cut, whole[:cut]), (cut, n, whole[cut:])], whole


def test_tensors_become_views_of_one_flat_block_a_run():
    model = bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = FlatReplica(model, DeferredCopies())
    roles = [(b.values.dtype, b.grads is not None) for b in r.blocks]
    # parameters (with gradients), float buffers, the integer count
    assert roles == [(torch.float32, True), (torch.float32, False), (torch.int64, False)]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    params = r.blocks[0]
    for p in r.params:
        assert p.untyped_storage().data_ptr() == params.values.untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == params.grads.untyped_storage().data_ptr()
    bn = model[1]
    assert bn.running_mean.untyped_storage().data_ptr() == r.blocks[1].values.data_ptr()


def test_stage_and_load_give_what_the_per_tensor_replica_gives():
    plain, flat = bn_model(), bn_model()
    r = FlatReplica(flat, DeferredCopies())
    backward(plain), backward(flat)
    want = expected_push(plain)
    parts, whole = halves(r.manifest.numel)
    r.stage(parts)
    torch.testing.assert_close(whole, want, rtol=0, atol=0)
    r.zero_grad()
    assert all(float(p.grad.abs().sum()) == 0 for p in flat.parameters())
    # a pull of new weights and buffers, over the same two ranges
    new = torch.randn(r.manifest.numel)
    new[-1] = 7.0  # the count, exact
    r.load([(lo, hi, new[lo:hi]) for lo, hi, _ in parts])
    Replica(plain).load([(0, r.manifest.numel, new)])
    for (k, a), b in zip(flat.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert int(flat[1].num_batches_tracked) == 7


def test_buckets_leave_during_backward_and_staging_copies_only_the_rest():
    plain, flat = bn_model(), bn_model()
    copies = DeferredCopies()
    r = FlatReplica(flat, copies, bucket_bytes=64)  # a bucket a layer or so
    assert len(r.buckets) >= 3
    parts, whole = halves(r.manifest.numel)
    asked: list[int] = []

    def early() -> list[tuple[int, int, torch.Tensor]]:
        asked.append(1)
        return parts

    r.early = early
    backward(plain), backward(flat)
    assert len(asked) == 1  # one slot a step
    during = len(copies.queued)
    assert during >= len(r.buckets)  # every bucket went (a piece a range it touches)
    r.stage(parts)
    torch.testing.assert_close(whole, expected_push(plain), rtol=0, atol=0)
    staged = copies.done - during
    assert staged == 2  # the float buffers and the count; no gradient again
    r.zero_grad()
    assert all(b.copied_at == -1 and b.fires == 0 for b in r.buckets)


def test_staging_into_other_buffers_than_the_early_ones_copies_everything():
    plain, flat = bn_model(), bn_model()
    r = FlatReplica(flat, DeferredCopies(), bucket_bytes=64)
    first, _ = halves(r.manifest.numel)
    r.early = lambda: first
    backward(plain), backward(flat)
    parts, whole = halves(r.manifest.numel)  # the channel reopened: new buffers
    r.stage(parts)
    torch.testing.assert_close(whole, expected_push(plain), rtol=0, atol=0)


def test_gradients_accumulated_after_an_early_copy_are_copied_again():
    plain, flat = bn_model(), bn_model()
    # the early copies ran before the second batch's backward
    r = FlatReplica(flat, DeferredCopies(read_at_once=True), bucket_bytes=64)
    parts, whole = halves(r.manifest.numel)
    r.early = lambda: parts
    for seed in (1, 2):  # two batches accumulated before one push
        backward(plain, seed), backward(flat, seed)
    r.stage(parts)
    torch.testing.assert_close(whole, expected_push(plain), rtol=0, atol=0)


def test_gradients_the_caller_set_to_none_are_restored_as_views():
    plain, flat = bn_model(), bn_model()
    r = FlatReplica(flat, DeferredCopies(), bucket_bytes=64)
    parts, whole = halves(r.manifest.numel)
    r.early = lambda: parts
    backward(plain), backward(flat)  # the same running statistics
    r.stage(parts)
    r.zero_grad()
    plain.zero_grad()
    torch.optim.SGD(flat.parameters(), lr=0.1).zero_grad()  # set_to_none: new gradients
    assert all(p.grad is None for p in flat.parameters())
    backward(plain, 3), backward(flat, 3)
    r.stage(parts)
    torch.testing.assert_close(whole, expected_push(plain), rtol=0, atol=0)
    assert all(p.grad is v for p, v in zip(r.params, r.views, strict=True))


@pytest.mark.parametrize("early", ["none free", "raises"])
def test_without_an_early_slot_staging_copies_every_bucket(early, caplog):
    plain, flat = bn_model(), bn_model()
    r = FlatReplica(flat, DeferredCopies(), bucket_bytes=64)
    parts, whole = halves(r.manifest.numel)

    def no_slot() -> None:
        if early == "raises":
            raise RuntimeError("the pipeline broke")
        return None

    r.early = no_slot
    backward(plain), backward(flat)  # a failing hook never aborts backward
    r.stage(parts)
    torch.testing.assert_close(whole, expected_push(plain), rtol=0, atol=0)
    if early == "raises":
        assert "copying a gradient bucket during backward failed" in caplog.text


def test_detach_removes_the_hooks():
    flat = bn_model()
    r = FlatReplica(flat, DeferredCopies(), bucket_bytes=64)
    r.early = lambda: None
    r.detach()
    backward(flat)
    assert all(b.fires == 0 for b in r.buckets)


def test_a_cpu_model_stays_per_tensor_unless_asked():
    assert type(replica(bn_model())) is Replica
    assert type(replica(bn_model(), flat=True)) is FlatReplica
    assert type(replica(bn_model(), flat=False)) is Replica


def test_cuda_copies_run_on_a_side_stream_after_the_compute(monkeypatch):
    """``CudaCopies`` against a fake ``torch.cuda``: each copy is enqueued on the side stream
    after waiting for the event ``ready`` recorded on the compute stream, ``wait`` blocks on
    the side stream, ``fence`` makes the compute stream wait for it."""
    log: list[tuple] = []

    class Stream:
        def __init__(self, name: str = "side") -> None:
            self.name = name

        def wait_event(self, event: Any) -> None:
            log.append(("wait_event", self.name, event.on))

        def wait_stream(self, other: Any) -> None:
            log.append(("wait_stream", self.name, other.name))

        def synchronize(self) -> None:
            log.append(("synchronize", self.name))

    compute = Stream("compute")
    current = [compute]

    class Event:
        on = None

        def record(self, stream: Any) -> None:
            self.on = stream.name

    class On:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", On)
    from paramserver.worker import device_copies

    copies = device_copies.for_device(torch.device("cuda"))
    assert isinstance(copies, device_copies.CudaCopies)
    dst, src = torch.zeros(4), torch.arange(4.0)
    real_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, other: torch.Tensor, non_blocking: bool = False) -> Any:
        log.append(("copy", current[-1].name, non_blocking))
        return real_copy(self, other)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    copies.copy(dst, src, copies.ready())
    copies.wait()
    copies.fence()
    assert log == [
        ("wait_event", "side", "compute"),
        ("copy", "side", True),
        ("synchronize", "side"),
        ("wait_stream", "compute", "side"),
    ]
    assert torch.equal(dst, src)


def test_gradients_changed_in_place_after_backward_are_copied_again():
    """Clipping (or unscaling, or dividing) after backward changes buckets that went early:
    the push carries the changed gradients."""
    plain, flat = bn_model(), bn_model()
    r = FlatReplica(flat, DeferredCopies(read_at_once=True), bucket_bytes=64)
    parts, whole = halves(r.manifest.numel)
    r.early = lambda: parts
    backward(plain), backward(flat)
    assert all(b.copied_at == b.fires for b in r.buckets)  # every bucket went early
    for m in (plain, flat):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
    r.stage(parts)
    torch.testing.assert_close(whole, expected_push(plain), rtol=0, atol=0)


def test_a_dropped_step_waits_for_its_early_copies_before_zeroing():
    flat = bn_model()
    copies = DeferredCopies()
    r = FlatReplica(flat, copies, bucket_bytes=64)
    parts, _ = halves(r.manifest.numel)
    r.early = lambda: parts
    backward(flat)
    assert copies.queued
    r.zero_grad()  # the step was dropped: no stage; DeferredCopies.fence checks the wait
    assert not copies.queued


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_an_empty_parameter_belongs_to_one_bucket():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 0), nn.Linear(0, 3), nn.Linear(3, 2))
    r = FlatReplica(model, DeferredCopies(), bucket_bytes=1)
    members = sorted(i for b in r.buckets for i in b.members)
    assert members == list(range(len(r.params)))  # each parameter once
    assert len(r._hooks) == len(r.params)


def test_a_model_on_two_devices_stays_per_tensor():
    model = bn_model()
    model.register_buffer("elsewhere", torch.zeros(3, device="meta"))
    assert type(replica(model, flat=True)) is Replica


@pytest.mark.parametrize("flat", [False, True])
def test_a_parameter_backward_did_not_reach_is_idle_one_written_in_place_is_not(flat):
    """``idle`` (issue 56, must 7): the parameters a push names as without a gradient. A
    flat replica's gradients are views that are never None: one that backward did not
    reach and that holds zeros is idle; one written in place (a local step's pseudo-
    gradient) is not; ``zero_grad`` starts the next step afresh."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 3))
    rep = FlatReplica(model) if flat else Replica(model)
    x = torch.randn(4, 6)
    F.cross_entropy(model[2](model[1](model[0](x))), torch.tensor([0, 1, 2, 0])).backward()
    last = model[3]
    start = rep.manifest.tensors[4].start  # model[3].weight, then its bias
    assert rep.idle() == [(start, start + 9), (start + 9, start + 12)]
    if flat:  # written in place, as LocalSteps.into_grads writes a pseudo-gradient
        assert last.weight.grad is not None
        last.weight.grad.add_(0.5)
    else:
        last.weight.grad = torch.full_like(last.weight, 0.5)
    assert rep.idle() == [(start + 9, start + 12)]
    rep.zero_grad()
    backward_all = F.cross_entropy(model(x), torch.tensor([0, 1, 2, 0]))
    backward_all.backward()
    assert rep.idle() == []
