"""``--compress int8``: a push's gradient as int8 with a float32 scale per block of
``Int8.block`` elements, the rounding error fed back into the next push; the server's decode
and what it refuses. (The in-place rounding of a shared segment's slot against the wire's
numbers: test_codec.py, with top-k's.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.codec.compression import Int8
from paramserver.errors import InvalidRequest

B = Int8.block


def _payload(codec: compression.Codec, grad: torch.Tensor, key: object = None) -> np.ndarray:
    return np.frombuffer(codec.encode(grad, key=key), np.uint8).copy()


def _decode(payload: np.ndarray, exact: int, flat: str = "float32") -> np.ndarray:
    return compression.to_float32(payload.copy(), "int8", exact, flat)


def _scales(payload: np.ndarray, m: int) -> np.ndarray:
    return payload[: 4 * -(-m // B)].view(np.float32)


def test_int8_is_a_codec_of_the_registry_and_pulls_in_bf16():
    assert compression.by_name("int8") is Int8
    assert compression.by_name("int8", flat_dtype="float64") is Int8
    assert compression.by_dtype("int8") is Int8 and compression.wire_itemsize("int8") == 1
    codec = Int8(3 * B + 5, 2, "float32", 3)
    assert isinstance(codec.pulls, compression.BFloat16) and codec.pulls.exact == 2
    assert (codec.exact, codec.m, codec.blocks) == (3, 3 * B + 2, 4)  # the buffers go whole
    assert codec.nbytes == 4 * 4 + (3 * B + 2) + 3 * 4
    assert compression.payload_bytes(Int8, 3 * B + 5, 3) == codec.nbytes
    with pytest.raises(ValueError, match="topk:F"):
        compression.by_name("topk:0.1:int8")


@pytest.mark.parametrize("numel", [1, B - 1, B, 3 * B + 17])
def test_a_round_trip_is_within_half_a_step_of_each_block(numel):
    """Each element comes back within half its block's step (max|x| / 127 / 2); blocks of
    very different magnitudes each get their own scale."""
    torch.manual_seed(0)
    grad = torch.randn(numel) * torch.logspace(-6, 2, numel)  # 8 decades along the buffer
    payload = _payload(Int8(numel), grad)
    assert len(payload) == 4 * -(-numel // B) + numel
    back = torch.from_numpy(_decode(payload, 0))
    scales = torch.from_numpy(_scales(payload, numel).copy())
    for b, s in enumerate(scales):
        x = grad[b * B : (b + 1) * B]
        assert s == torch.tensor(float(x.abs().max()) / 127, dtype=torch.float32)
        err = (back[b * B : (b + 1) * B] - x).abs().max()
        assert err <= s / 2 * (1 + 1e-5), (b, float(err), float(s))
    q = payload[4 * len(scales) :].view(np.int8)
    assert q.min() >= -127 and q.max() <= 127 and np.abs(q).max() == 127


def test_a_block_of_zeros_has_scale_zero_and_decodes_to_zeros():
    grad = torch.randn(2 * B + 10)
    grad[B : 2 * B] = 0  # a whole block
    grad[2 * B :] = 0  # the short last one
    codec = Int8(grad.numel())
    payload = _payload(codec, grad)
    assert _scales(payload, grad.numel()).tolist()[1:] == [0.0, 0.0]
    back = _decode(payload, 0)
    assert np.isfinite(back).all() and not back[B:].any()
    assert not codec.residual[B:].any()
    everything = Int8(5)  # a gradient of zeros, whole
    assert not _decode(_payload(everything, torch.zeros(5)), 0).any()


def test_error_feedback_makes_the_pushes_add_up_to_the_gradients():
    """What a push rounds away waits in the residual, which stays under half a step: the
    sum of the decoded pushes follows the sum of the gradients. Without feedback the small
    entries of a block with one large one would never be sent (0.001 / (1 / 127) rounds
    to 0)."""
    torch.manual_seed(2)
    numel, steps = 2 * B + 100, 200
    codec = Int8(numel)
    total_grad = torch.zeros(numel, dtype=torch.float64)
    total_sent = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        grad = 0.001 + 0.0005 * torch.randn(numel)
        grad[::B] = 1.0  # one large entry a block: the step is 1/127
        sent = torch.from_numpy(_decode(_payload(codec, grad, key=(0, step)), 0))
        total_grad += grad.double()
        total_sent += sent.double()
        # nothing lost: what was sent and what waits make up every gradient so far
        torch.testing.assert_close(
            total_sent + codec.residual.double(), total_grad, rtol=0, atol=1e-4
        )
        assert float(codec.residual.abs().max()) <= 1.01 / 127 / 2  # bounded: half a step
        naive = torch.from_numpy(_decode(_payload(Int8(numel), grad), 0))
        assert not naive[1:B].any()  # plain rounding sends none of the small entries
    small = torch.ones(numel, dtype=torch.bool)
    small[::B] = False
    # the mean of what was sent is the mean gradient, to within half a step over the steps
    error = (total_sent - total_grad)[small].abs().max() / steps
    assert error < 1 / 127 / 2 / steps * 1.01 and total_sent[small].min() > 0.1


def test_a_retried_push_sends_the_same_bytes_and_moves_the_residual_once():
    codec = Int8(B + 3)
    grad = torch.randn(B + 3)
    first = _payload(codec, grad, key=(1, 7))
    residual = codec.residual.clone()
    assert np.array_equal(_payload(codec, grad, key=(1, 7)), first)
    assert torch.equal(codec.residual, residual)
    _payload(codec, grad, key=(1, 8))  # the next push moves it
    assert not torch.equal(codec.residual, residual)


@pytest.mark.parametrize("flat", ["float32", "float64"])
def test_buffers_travel_exact_after_the_int8_values(flat):
    """The last ``dense`` elements (buffers: values, not gradients; an integer count among
    them) go whole in the flat buffer's type, and feed nothing back."""
    dtype = getattr(torch, flat)
    numel, dense = B + 50, 4
    grad = torch.randn(numel, dtype=dtype)
    grad[-dense:] = torch.tensor([123456789.0, 0.1, -3.25, 16777217.0], dtype=dtype)
    codec = Int8(numel, 1, flat, dense)
    payload = _payload(codec, grad)
    assert len(payload) == 4 * 2 + (numel - dense) + dense * np.dtype(flat).itemsize
    back = _decode(payload, dense, flat)
    assert back.dtype == np.dtype(flat)
    np.testing.assert_array_equal(back[-dense:], grad[-dense:].numpy())
    assert codec.residual.numel() == numel - dense
    with pytest.raises(InvalidRequest, match="exact"):
        _decode(payload, 10 * numel, flat)


def test_a_non_finite_block_decodes_to_nan_and_drops_its_residual():
    """A block holding NaN or Inf goes with a non-finite scale, which decodes to NaN (the
    server refuses or skips such a push); its residual is dropped, the others' kept."""
    codec = Int8(3 * B)
    grad = torch.full((3 * B,), 0.3)
    grad[::B] = 1.0
    grad[5], grad[B + 5] = float("nan"), float("inf")
    back = _decode(_payload(codec, grad), 0)
    assert np.isnan(back[: 2 * B]).all() and np.isfinite(back[2 * B :]).all()
    assert not codec.residual[: 2 * B].any() and codec.residual[2 * B :].abs().max() > 0
    again = _decode(_payload(codec, torch.full((3 * B,), 0.3)), 0)
    assert np.isfinite(again).all()  # the next push is clean


def test_a_malformed_int8_payload_is_refused():
    numel, exact = 2 * B + 7, 2
    payload = _payload(Int8(numel, exact, "float32", exact), torch.randn(numel))
    assert len(_decode(payload, exact)) == numel
    # bytes that cannot be scales and their values (room for a scale, none for a value);
    # a length that is another model's is the header's check (below: "does not match")
    for head in (3, 4, B + 4 + 1, 2 * (B + 4) + 4):
        with pytest.raises(InvalidRequest, match="not a float32 scale per 1024"):
            _decode(payload[:head], 0)
    for scale in (-1.0, -np.inf):
        lying = payload.copy()
        lying[4:8] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)
        with pytest.raises(InvalidRequest, match="negative scale"):
            _decode(lying, exact)
    for scale in (np.nan, np.inf):  # decodes non-finite: the server's finite check refuses it
        lying = payload.copy()
        lying[4:8] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)
        assert not np.isfinite(_decode(lying, exact)[B : 2 * B]).any()
    with pytest.raises(InvalidRequest, match="cannot be int8"):
        compression.sparse_to_dense(payload, 10, "int8", exact, numel)


class _Manifest:
    numel, itemsize = 2 * B + 7, 4


def _steps() -> object:
    from types import SimpleNamespace

    from paramserver.server.doors.steps import Steps

    coordinator = SimpleNamespace(config=SimpleNamespace(shard=0), manifest=_Manifest)
    return Steps.check_push_header.__get__(SimpleNamespace(c=coordinator))


def _refuses(check, good: pb.PushHeader, changes) -> None:
    """``check`` refuses ``good`` with each change (fields and values), saying ``match``."""
    for change, match in changes:
        bad = pb.PushHeader()
        bad.CopyFrom(good)
        for field, value in change.items():
            setattr(bad, field, value)
        with pytest.raises(InvalidRequest, match=match):
            check(bad)


def test_the_server_checks_an_int8_push_header():
    check = _steps()
    codec = Int8(_Manifest.numel, 0, "float32", 2)
    good = pb.PushHeader(dtype="int8", exact=2, scale_block=B, total_bytes=codec.nbytes)
    check(good)
    changes = (
        ({"scale_block": 0}, "a scale per 0 elements; this server takes one per 1024"),
        ({"scale_block": 4096}, "a scale per 4096"),
        ({"total_bytes": codec.nbytes - 1}, "does not match"),
        ({"total_bytes": 2 * B + 7}, "does not match"),  # no room for the scales
        ({"topk": 10, "total_bytes": 10 * 5 + 8}, "values cannot be int8"),
    )
    _refuses(check, good, changes)
    float32 = pb.PushHeader(total_bytes=4 * _Manifest.numel, scale_block=B)
    with pytest.raises(InvalidRequest, match="float32 push with a scale per 1024.*none"):
        check(float32)


def test_weights_are_not_pulled_in_int8():
    from paramserver.server.doors.payloads import Payloads

    payloads = Payloads(shared=None)  # type: ignore[arg-type]
    request = pb.PullRequest(dtype="int8")
    with pytest.raises(InvalidRequest, match="not sent in int8; ask for bfloat16"):
        payloads.destination(request)  # before the pull waits
    with pytest.raises(InvalidRequest, match="not sent in int8"):
        payloads.weights(request, pb.PullHeader(), np.zeros(8, np.float32))
