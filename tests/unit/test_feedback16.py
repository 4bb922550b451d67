"""``--compress fp16`` and ``bf16`` with error feedback (``codec/feedback.py``: ``Rounded``):
a push sends the gradient plus the worker's residual rounded to 16 bits and the buffers
whole; the residual keeps what the rounding lost; pulls stay 16-bit. The in-place rounding
of a shared segment's slot against the wire's numbers is in test_codec.py (with top-k's and
int8's), the worker's retries and rejoins in test_worker.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.codec.compression import Rounded
from tests.unit.test_int8 import _Manifest, _refuses, _steps

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
MANTISSA = {"fp16": 10, "bf16": 7}  # explicit bits: an ulp is 2**(exponent - these)


def _payload(codec: compression.Codec, grad: torch.Tensor, key: object = None) -> np.ndarray:
    return np.frombuffer(codec.encode(grad, key=key), np.uint8).copy()


def _decode(codec: compression.Codec, payload: np.ndarray) -> torch.Tensor:
    flat = codec.flat.name
    return torch.from_numpy(compression.to_float32(payload, codec.dtype, codec.exact, flat))


def _half_ulp(x: torch.Tensor, name: str) -> torch.Tensor:
    """Half the 16-bit type's spacing at each element of ``x`` (its binade's): the most
    rounding to nearest can lose (fp16's subnormals: a spacing of 2**-24)."""
    _, exponent = torch.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    ulp = torch.pow(2.0, exponent.double() - 1 - MANTISSA[name])
    if name == "fp16":
        ulp = ulp.clamp(min=2.0**-24)
    return ulp / 2


@pytest.mark.parametrize("chunk", [Rounded.CHUNK, 100])  # one pass; passes of 100
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_error_feedback_makes_the_16_bit_pushes_add_up_to_the_gradients(name, chunk, monkeypatch):
    """Each push sends grad + residual rounded to 16 bits and keeps exactly the rest (so
    sent + residual is the float32 sum, bit for bit), the residual at most half a 16-bit
    ulp an element; over many pushes the sent total follows the gradients' total, where
    plain rounding loses an offset below the ulp for ever."""
    monkeypatch.setattr(Rounded, "CHUNK", chunk)
    torch.manual_seed(3)
    numel, dense, steps = 1000, 5, 200
    codec = compression.by_name(name)(numel, 1, "float32", dense)
    assert isinstance(codec, Rounded) and codec.dtype == str(HALF[name])[6:]
    m = numel - dense
    total_grad = torch.zeros(m, dtype=torch.float64)
    total_sent = torch.zeros(m, dtype=torch.float64)
    for step in range(steps):
        grad = 1.0004 + 0.0001 * torch.randn(numel)  # 1.0004: under half a 16-bit ulp of 1
        grad[: m // 2] *= torch.logspace(-6, 3, m // 2)  # and many magnitudes
        before = codec.residual.clone()
        sent = _decode(codec, _payload(codec, grad, key=(0, step)))[:m]
        acc = before + grad[:m]  # what the push rounded, in float32 as the codec adds it
        assert torch.equal(sent + codec.residual, acc)  # nothing lost, nothing made up
        assert torch.equal(sent, acc.to(HALF[name]).float())  # rounded to nearest
        assert bool((codec.residual.abs().double() <= _half_ulp(acc, name)).all())
        total_grad += grad[:m].double()
        total_sent += sent.double()
    # over every push: the sent total and the residual make up the gradients' total, up to
    # float32's rounding of each sum grad + residual
    err = (total_sent + codec.residual.double() - total_grad).abs()
    assert bool((err <= total_grad.abs() * 2.0**-24 * steps).all()), float(err.max())
    plain = compression.by_dtype(codec.dtype)(numel, 1)  # no feedback: 1.0004 goes as 1.0
    lost = float(_decode(plain, _payload(plain, torch.full((numel,), 1.0004)))[-2]) * steps
    assert abs(lost - 1.0004 * steps) > 0.079  # 200.0, not 200.08
    kept = total_sent[m // 2 :] / steps  # the mean of what was sent: the mean gradient
    assert float((kept - total_grad[m // 2 :] / steps).abs().max()) < 2.0**-8 / steps


@pytest.mark.parametrize("flat", ["float32", "float64"])
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_buffers_go_whole_and_the_pulls_stay_16_bit(name, flat):
    """The last ``dense`` elements (float buffers such as BatchNorm's running stats, then the
    integer counts) travel whole in the flat buffer's type after the 16-bit values and feed
    nothing back; pulls come in the 16-bit type, only the counts exact, as before."""
    dtype = getattr(torch, flat)
    numel, exact, dense = 300, 1, 4
    grad = torch.randn(numel, dtype=dtype)
    grad[-dense:] = torch.tensor([0.1, -3.3333333, 123456.789, 16777217.0], dtype=dtype)
    codec = compression.by_name(name, flat_dtype=flat)(numel, exact, flat, dense)
    payload = _payload(codec, grad)
    assert len(payload) == codec.nbytes == 2 * (numel - dense) + dense * np.dtype(flat).itemsize
    back = _decode(codec, payload)
    assert back.dtype == dtype and torch.equal(back[-dense:], grad[-dense:])
    assert not torch.equal(grad[-dense:].to(HALF[name]).to(dtype), grad[-dense:])
    assert codec.residual.numel() == numel - dense
    slot = grad.clone()
    compression.by_name(name, flat_dtype=flat)(numel, exact, flat, dense).round_(slot)
    assert torch.equal(slot[-dense:], grad[-dense:])  # through shared memory, the same
    pulls = codec.pulls
    assert type(pulls) is compression.by_dtype(codec.dtype) and pulls.exact == exact
    assert not isinstance(pulls, compression.Feedback)
    weights = torch.randn(numel, dtype=dtype)
    raw = compression.by_dtype(codec.dtype)(numel, exact, flat).encode(weights)
    np.frombuffer(pulls.receive_buffer(torch.empty(numel)), np.uint8)[:] = np.frombuffer(
        raw, np.uint8
    )
    got = torch.empty(numel, dtype=dtype)
    codec.decode_into(got)
    assert torch.equal(got[:-exact], weights[:-exact].to(HALF[name]).to(dtype))
    assert torch.equal(got[-exact:], weights[-exact:])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_retried_16_bit_push_sends_the_same_bytes_and_moves_the_residual_once(name):
    codec = compression.by_name(name)(70, 0, "float32", 3)
    grad = torch.randn(70) / 3
    first = _payload(codec, grad, key=(1, 7))
    residual = codec.residual.clone()
    assert residual.abs().sum() > 0
    assert np.array_equal(_payload(codec, grad * 2, key=(1, 7)), first)  # the slot's first
    assert torch.equal(codec.residual, residual)
    slot = grad.clone()
    codec.round_(slot, key=(1, 7))  # the same push through a segment: left as it is
    assert torch.equal(slot, grad) and torch.equal(codec.residual, residual)
    _payload(codec, grad, key=(1, 8))  # the next push moves it
    assert not torch.equal(codec.residual, residual)
    fresh = compression.by_name(name)(70, 0, "float32", 3)  # a rejoin's, a restart's
    assert not fresh.residual.any()


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_non_finite_element_is_sent_so_and_drops_its_own_residual(name):
    """NaN and Inf reach the server (which refuses or skips the push); only their elements'
    residual is dropped, so the next push is clean and the others' feedback goes on. fp16
    saturates at +-65504 and keeps what it cut in the residual."""
    numel = 12
    codec = compression.by_name(name)(numel, 0, "float32", 2)
    codec.residual.fill_(1e-4)
    grad = torch.full((numel,), 0.3)
    grad[1], grad[2], grad[3] = float("nan"), float("inf"), -float("inf")
    grad[4] = 1e5
    back = _decode(codec, _payload(codec, grad, key=(0, 1)))
    assert torch.isnan(back[1]) and back[2] == float("inf") and back[3] == -float("inf")
    assert not codec.residual[1:4].any() and codec.residual[5:].abs().min() > 0
    assert bool(torch.isfinite(codec.residual).all())
    if name == "fp16":
        assert back[4] == 65504.0 and codec.residual[4] == 1e5 + 1e-4 - 65504.0
    else:
        assert back[4] == torch.tensor(1e5 + 1e-4).to(torch.bfloat16).float()
    again = _decode(codec, _payload(codec, torch.full((numel,), 0.3), key=(0, 2)))
    assert bool(torch.isfinite(again).all())


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_server_takes_the_buffers_whole_and_refuses_a_16_bit_push_that_lies(name):
    """A 16-bit push whose ``exact`` tail is all the buffers passes the header's checks (its
    bytes: 2 a value, 4 an exact element); an ``exact`` beyond the model, or bytes that are
    not those of the ``exact`` the header names, are refused before anything is read."""
    check = _steps()
    numel, dense = _Manifest.numel, 9
    codec = compression.by_name(name)(numel, 1, "float32", dense)
    good = pb.PushHeader(dtype=codec.dtype, exact=dense, total_bytes=codec.nbytes)
    check(good)
    changes = (
        ({"exact": numel + 1}, "exact elements"),
        ({"exact": -1}, "exact elements"),
        ({"exact": 1}, "does not match"),  # the integer count alone: 16 bits too few
        ({"total_bytes": codec.nbytes + 2}, "does not match"),
        ({"scale_block": 1024}, "a scale per 1024"),
    )
    _refuses(check, good, changes)
