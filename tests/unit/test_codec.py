"""The flat-buffer codec: manifest, (un)flatten, chunks and stream framing."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, layout, wire
from paramserver.codec.layout import (
    Manifest,
    TensorSpec,
    flatten_into,
    shard_manifest,
    state_dict,
    unflatten_into,
)
from paramserver.codec.wire import Assembler
from paramserver.errors import ConfigError, InvalidRequest


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def model_manifest(model: nn.Module) -> Manifest:
    return Manifest.from_tensors(model.named_parameters())


# --- manifest ----------------------------------------------------------------------


def test_from_tensors_layout() -> None:
    m = Manifest.from_tensors(
        [("a", torch.zeros(2, 3)), ("b", torch.zeros(5)), ("c", torch.zeros(()))]
    )
    assert m.tensors == (
        TensorSpec("a", (2, 3), "float32", 0, 24),
        TensorSpec("b", (5,), "float32", 24, 20),
        TensorSpec("c", (), "float32", 44, 4),
    )
    assert m.total_bytes == 48
    assert m.numel == 12
    assert [s.numel for s in m.tensors] == [6, 5, 1]


def test_from_tensors_of_model() -> None:
    model = tiny_model()
    m = model_manifest(model)
    assert [s.name for s in m.tensors] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert m.total_bytes == 4 * sum(p.numel() for p in model.parameters())
    offsets = [s.offset for s in m.tensors]
    ends = [s.offset + s.nbytes for s in m.tensors]
    assert offsets == [0, *ends[:-1]]


def test_empty_manifest() -> None:
    m = Manifest.from_tensors([])
    assert m.tensors == ()
    assert m.total_bytes == 0


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
def test_parameters_of_other_dtypes_rejected(dtype: torch.dtype) -> None:
    with pytest.raises(ConfigError) as info:
        Manifest.from_tensors([("ok", torch.zeros(2)), ("bad", torch.zeros(2, dtype=dtype))])
    assert "'bad'" in str(info.value)
    assert str(dtype).removeprefix("torch.") in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_parameters_take_float32_elements(dtype: torch.dtype) -> None:
    t = torch.tensor([1.5, -2.25, 3.0], dtype=dtype)
    m = Manifest.from_tensors([("h", t), ("n", torch.tensor([7]))], ["param", "count"])
    assert [(s.dtype, s.offset, s.nbytes, s.role) for s in m.tensors] == [
        (str(dtype)[6:], 0, 12, "param"),
        ("int64", 12, 4, "count"),
    ]
    assert m.section("param") == (0, 3) and m.section("buffer") == (3, 3)
    assert m.section("count") == (3, 4)
    flat = torch.empty(4)
    flatten_into(m, [t, torch.tensor([7])], flat)
    assert flat.tolist() == [1.5, -2.25, 3.0, 7.0]
    back = [torch.zeros(3, dtype=dtype), torch.zeros(1, dtype=torch.int64)]
    unflatten_into(m, flat, back)
    assert back[0].equal(t) and back[1].tolist() == [7]
    sd = state_dict(m, flat.numpy())
    assert sd["h"].dtype == dtype and sd["n"].dtype == torch.int64 and sd["n"].tolist() == [7]


def test_roles_must_come_in_order() -> None:
    with pytest.raises(ValueError, match="comes after a count"):
        Manifest.from_tensors(
            [("n", torch.tensor([1])), ("b", torch.zeros(1))], ["count", "buffer"]
        )


def test_shard_manifest_names_each_section_of_its_range() -> None:
    m = Manifest.from_tensors(
        [("w", torch.zeros(4)), ("mean", torch.zeros(2)), ("n", torch.tensor([0]))],
        ["param", "buffer", "count"],
    )
    assert [(s.name, s.numel, s.role) for s in shard_manifest(m, 0, 4).tensors] == [
        ("flat", 4, "param")
    ]
    assert [(s.name, s.numel, s.role) for s in shard_manifest(m, 3, 7).tensors] == [
        ("flat", 1, "param"),
        ("buffers", 2, "buffer"),
        ("counts", 1, "count"),
    ]
    only = shard_manifest(m, 5, 7)
    assert [(s.name, s.numel) for s in only.tensors] == [("buffers", 1), ("counts", 1)]
    assert only.section("param") == (0, 0) and Manifest.from_proto(only.to_proto()) == only


def test_proto_round_trip() -> None:
    m = model_manifest(tiny_model())
    msg = m.to_proto()
    assert isinstance(msg, pb.Manifest)
    assert msg.total_bytes == m.total_bytes
    decoded = pb.Manifest.FromString(msg.SerializeToString())
    back = Manifest.from_proto(decoded)
    assert back == m
    assert all(isinstance(s.shape, tuple) for s in back.tensors)


def test_proto_round_trip_scalar() -> None:
    m = Manifest.from_tensors([("s", torch.zeros(()))])
    assert Manifest.from_proto(m.to_proto()) == m


def test_check_compatible_equal_passes() -> None:
    a = model_manifest(tiny_model())
    b = Manifest.from_proto(a.to_proto())
    a.check_compatible(b, "the worker's model")  # no exception


def test_check_compatible_shape_mismatch_names_parameter() -> None:
    a = Manifest.from_tensors([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    b = Manifest.from_tensors([("w", torch.zeros(3, 2)), ("b", torch.zeros(3))])
    with pytest.raises(ConfigError) as info:
        a.check_compatible(b, "the checkpoint")
    msg = str(info.value)
    assert "'w'" in msg
    assert "[2, 3]" in msg and "[3, 2]" in msg
    assert "the checkpoint" in msg


def test_check_compatible_missing_parameter_names_it() -> None:
    a = Manifest.from_tensors([("w", torch.zeros(2)), ("extra", torch.zeros(1))])
    b = Manifest.from_tensors([("w", torch.zeros(2))])
    with pytest.raises(ConfigError) as info:
        a.check_compatible(b, "the worker's model")
    assert "'extra'" in str(info.value)
    assert "missing" in str(info.value)
    # And the other way round: a parameter the server does not have.
    with pytest.raises(ConfigError) as info:
        b.check_compatible(a, "the worker's model")
    assert "'extra'" in str(info.value)
    assert "the server" in str(info.value)


def test_check_compatible_order_mismatch() -> None:
    a = Manifest.from_tensors([("x", torch.zeros(2)), ("y", torch.zeros(2))])
    b = Manifest.from_tensors([("y", torch.zeros(2)), ("x", torch.zeros(2))])
    with pytest.raises(ConfigError):
        a.check_compatible(b, "the worker's model")


# --- flatten / unflatten / state_dict ----------------------------------------------


def test_flatten_unflatten_round_trip() -> None:
    src = tiny_model()
    m = model_manifest(src)
    flat = torch.empty(m.numel, dtype=torch.float32)
    flatten_from = list(src.parameters())
    layout.flatten_into(m, flatten_from, flat)
    # The flat buffer holds each tensor at its offset.
    for spec, p in zip(m.tensors, flatten_from, strict=True):
        start = spec.offset // 4
        assert torch.equal(flat[start : start + spec.numel], p.detach().reshape(-1))

    dst = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    layout.unflatten_into(m, flat, list(dst.parameters()))
    for a, b in zip(src.parameters(), dst.parameters(), strict=True):
        assert torch.equal(a, b)


def test_flatten_wrong_count_raises() -> None:
    m = Manifest.from_tensors([("a", torch.zeros(2)), ("b", torch.zeros(2))])
    flat = torch.empty(4)
    with pytest.raises(ValueError):
        layout.flatten_into(m, [torch.ones(2)], flat)


def test_state_dict_loads_into_module() -> None:
    src = tiny_model()
    m = model_manifest(src)
    flat = torch.empty(m.numel, dtype=torch.float32)
    layout.flatten_into(m, list(src.parameters()), flat)
    flat_np = flat.numpy().copy()
    sd = layout.state_dict(m, flat_np)
    assert list(sd) == [s.name for s in m.tensors]
    dst = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    result = dst.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for a, b in zip(src.parameters(), dst.parameters(), strict=True):
        assert torch.equal(a, b)
    # The dict holds copies: changing the buffer afterwards does not change it.
    flat_np[:] = 0
    assert not torch.equal(sd["0.weight"], torch.zeros(4, 3))


# --- chunks and the assembler --------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "chunk", "sizes"),
    [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 4, [3]), (0, 4, []), (12, 100, [12])],
)
def test_iter_chunks_sizes(size: int, chunk: int, sizes: list[int]) -> None:
    payload = bytes(range(size))
    chunks = list(wire.iter_chunks(memoryview(payload), chunk))
    assert [len(c) for c in chunks] == sizes
    assert b"".join(chunks) == payload


def test_as_bytes_is_raw_little_endian_float32() -> None:
    arr = np.array([1.0, -2.5], np.float32)
    view = compression.as_bytes(arr)
    assert len(view) == 8
    assert bytes(view) == arr.astype("<f4").tobytes()


def test_assembler_from_uneven_chunks() -> None:
    arr = np.arange(10, dtype=np.float32) * 1.5 - 3.0
    raw = arr.tobytes()
    asm = Assembler(len(raw))
    for piece in (raw[:3], raw[3:17], raw[17:18], raw[18:]):
        asm.add(piece)
    out = asm.finish()
    assert out.dtype == np.float32
    assert np.array_equal(out, arr)


def test_assembler_writes_into_given_buffer() -> None:
    arr = np.array([1, 2, 3], np.float32)
    out = np.zeros(3, np.float32)
    asm = Assembler(12, out)
    asm.add(arr.tobytes())
    assert asm.finish() is out
    assert np.array_equal(out, arr)


def test_assembler_wrong_buffer_size_raises() -> None:
    with pytest.raises(InvalidRequest):
        Assembler(12, np.zeros(4, np.float32))


def test_assembler_overflow_raises() -> None:
    asm = Assembler(8)
    asm.add(b"\0" * 6)
    with pytest.raises(InvalidRequest) as info:
        asm.add(b"\0" * 3)
    assert "8 bytes" in str(info.value)
    assert asm.received == 6  # the overflowing chunk was not written


def test_assembler_truncated_finish_raises() -> None:
    asm = Assembler(8)
    asm.add(b"\0" * 4)
    with pytest.raises(InvalidRequest) as info:
        asm.finish()
    assert "4 of the 8 bytes" in str(info.value)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 10])
def test_assembler_non_multiple_of_four_raises(size: int) -> None:
    with pytest.raises(InvalidRequest):
        Assembler(size)


# --- push and pull framing -----------------------------------------------------------


def test_push_round_trip() -> None:
    grad = np.linspace(-1, 1, 11, dtype=np.float32)
    header = pb.PushHeader(worker_id="w1", iteration=7, samples=64, loss=0.25)
    msgs = list(wire.encode_push(header, compression.as_bytes(grad), chunk_bytes=8))
    assert msgs[0].WhichOneof("kind") == "header"
    assert [len(m.data) for m in msgs[1:]] == [8, 8, 8, 8, 8, 4]
    # Through the wire format, as gRPC would carry it.
    stream = iter([wire.parse_push_chunk(wire.serialize_chunk(m)) for m in msgs])
    got = wire.decode_push_header(stream)
    assert got.worker_id == "w1"
    assert got.iteration == 7
    assert got.samples == 64
    assert got.loss == 0.25
    assert got.total_bytes == grad.nbytes
    out = wire.decode_payload(stream, Assembler(got.total_bytes))
    assert np.array_equal(out, grad)


def test_push_stream_starting_with_data_raises() -> None:
    stream = iter([pb.PushChunk(data=b"\0" * 4), pb.PushChunk(header=pb.PushHeader())])
    with pytest.raises(InvalidRequest):
        wire.decode_push_header(stream)


def test_empty_push_stream_raises() -> None:
    with pytest.raises(InvalidRequest):
        wire.decode_push_header(iter([]))


def test_second_header_in_payload_raises() -> None:
    stream = [pb.PushChunk(data=b"\0" * 4), pb.PushChunk(header=pb.PushHeader())]
    with pytest.raises(InvalidRequest):
        wire.decode_payload(stream, Assembler(8))


def test_short_push_payload_raises() -> None:
    grad = np.ones(4, np.float32)
    stream = wire.encode_push(pb.PushHeader(), compression.as_bytes(grad), chunk_bytes=8)
    header = wire.decode_push_header(stream)
    next(stream)  # lose one chunk
    with pytest.raises(InvalidRequest):
        wire.decode_payload(stream, Assembler(header.total_bytes))


def test_pull_round_trip() -> None:
    weights = np.arange(7, dtype=np.float32) / 3
    header = pb.PullHeader(version=12, staleness=1)
    msgs = list(wire.encode_pull(header, compression.as_bytes(weights), chunk_bytes=12))
    assert [len(m.data) for m in msgs[1:]] == [12, 12, 4]
    stream = iter([wire.parse_pull_chunk(wire.serialize_chunk(m)) for m in msgs])
    out = np.empty(7, np.float32)
    got_header, got = wire.decode_pull(stream, out, weights.nbytes)
    assert got is out
    assert (got_header.version, got_header.staleness) == (12, 1)
    assert got_header.total_bytes == weights.nbytes
    assert np.array_equal(got, weights)


def test_pull_round_trip_new_buffer() -> None:
    weights = np.array([3.0, 4.0], np.float32)
    msgs = wire.encode_pull(pb.PullHeader(version=1), compression.as_bytes(weights), 4096)
    _, got = wire.decode_pull(msgs, None, 8)
    assert np.array_equal(got, weights)


def test_pull_wrong_total_bytes_raises() -> None:
    weights = np.zeros(4, np.float32)
    msgs = wire.encode_pull(pb.PullHeader(), compression.as_bytes(weights), 4096)
    with pytest.raises(InvalidRequest) as info:
        wire.decode_pull(msgs, None, 20)
    assert "16 bytes" in str(info.value)
    assert "20" in str(info.value)


def test_pull_stream_starting_with_data_raises() -> None:
    with pytest.raises(InvalidRequest):
        wire.decode_pull(iter([pb.PullChunk(data=b"\0" * 4)]), None, 4)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20, (1 << 20) + 3])
def test_data_chunk_framing_is_the_protobuf_encoding(size: int) -> None:
    data = bytes(i % 251 for i in range(size))
    encoded = wire.serialize_chunk(wire.DataChunk(memoryview(data)))
    assert encoded == pb.PushChunk(data=data).SerializeToString()
    assert pb.PullChunk.FromString(encoded).data == data
    parsed = wire.parse_push_chunk(encoded)
    assert isinstance(parsed, wire.DataChunk) and bytes(parsed.data) == data


def test_parse_leaves_anything_but_a_bare_data_chunk_to_protobuf() -> None:
    header = pb.PushChunk(header=pb.PushHeader(worker_id="w", iteration=3))
    parsed = wire.parse_push_chunk(header.SerializeToString())
    assert parsed.WhichOneof("kind") == "header" and parsed.header.iteration == 3
    # a data chunk followed by another field is still read by protobuf, correctly
    encoded = (
        pb.PushChunk(data=b"ab").SerializeToString() + pb.PushChunk(data=b"cd").SerializeToString()
    )
    assert wire.parse_push_chunk(encoded).data == b"cd"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compressed_gradients_round_trip_through_the_wire_dtype(dtype):
    flat = torch.linspace(-3, 3, 1001)
    encoded = compression.by_dtype(dtype)(flat.numel()).encode(flat)
    assert len(encoded) == 2 * flat.numel()
    back = compression.to_float32(np.frombuffer(encoded, np.uint8).copy(), dtype)
    expected = flat.to(getattr(torch, dtype)).float().numpy()
    np.testing.assert_array_equal(back, expected)
    np.testing.assert_allclose(back, flat.numpy(), rtol=1e-2, atol=1e-6)


def test_fp16_saturates_instead_of_overflowing_but_keeps_real_nan_and_inf():
    flat = torch.tensor([1e6, -1e6, 1.0, float("inf"), float("nan")])
    encoded = compression.by_dtype("float16")(5).encode(flat)
    back = compression.to_float32(np.frombuffer(encoded, np.uint8).copy(), "float16")
    assert back[:3].tolist() == [65504.0, -65504.0, 1.0]
    assert back[3] == np.inf and np.isnan(back[4])


def test_an_unknown_wire_dtype_is_refused():
    with pytest.raises(InvalidRequest, match="float8"):
        compression.wire_itemsize("float8")
    assert compression.wire_itemsize("") == 4 and compression.wire_itemsize("bfloat16") == 2


def test_the_compression_registry_matches_the_proto_and_the_cli():
    from pathlib import Path

    from paramserver import cli

    proto = (Path(__file__).parents[2] / "protos/paramserver/v1/paramserver.proto").read_text()
    line = next(ln for ln in proto.splitlines() if "string dtype = 8;" in ln)
    named = set(re.findall(r'"([a-z0-9]+)"', line))
    assert named == set(compression.BY_DTYPE)
    worker_options = {p.name: p for p in cli.worker.params}
    assert all(name in worker_options["compress"].help for name in compression.CHOICES)
    assert "topk:F" in worker_options["compress"].help
    for name in compression.CHOICES:
        # the server decodes each choice's pushes with the codec of their dtype: the choice
        # itself, or (fp16, bf16: error feedback on the worker) the 16-bit type it rounds to
        codec = compression.by_name(name)
        assert issubclass(codec, compression.by_dtype(codec.dtype))
    with pytest.raises(ValueError, match="compress must be one of auto, none, fp16, bf16"):
        compression.by_name("zstd")
    for bad in ("topk:0", "topk:1.5", "topk:x", "topk:0.1:zstd", "topk:0.1:bf16:x"):
        with pytest.raises(ValueError, match="topk:F"):
            compression.by_name(bad)
    sparse = compression.by_name("topk:0.01:bf16")
    assert issubclass(sparse, compression.TopK) and sparse.dtype == "bfloat16"
    assert compression.by_name("topk:0.01", flat_dtype="float64").dtype == "float64"


def test_auto_compression_pushes_in_the_parameters_own_16_bit_dtype():
    # fp16 and bf16 push with error feedback (``Rounded``), whose wire type is their own
    assert compression.by_name("auto", ["bfloat16", "bfloat16"]) is compression.RoundedBFloat16
    assert compression.by_name("auto", ["float16"]) is compression.RoundedFloat16
    assert compression.by_name("auto", ["bfloat16"]) is compression.by_name("bf16")
    assert compression.by_name("auto", ["float32", "bfloat16"]) is compression.Codec
    assert compression.by_name("auto", []) is compression.Codec


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_any_range_of_the_flat_buffer_flattens_and_unflattens_in_place(shards):
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2).transpose(0, 2)]
    manifest = Manifest.from_tensors([(f"t{i}", t) for i, t in enumerate(tensors)])
    whole = torch.empty(manifest.numel)
    flatten_into(manifest, tensors, whole)
    back = [torch.zeros_like(t) for t in tensors]
    for shard in range(shards):
        lo, hi = layout.shard_range(manifest.numel, shard, shards)
        part = torch.empty(hi - lo)
        flatten_into(manifest, tensors, part, lo, hi)
        assert torch.equal(part, whole[lo:hi])
        unflatten_into(manifest, part, back, lo, hi)
    for t, b in zip(tensors, back, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("exact", [0, 1, 3, 1001])
def test_a_16_bit_payload_carries_its_exact_tail_unrounded(dtype, exact):
    """The last ``exact`` elements (integer buffers) travel in float32, whatever the
    alignment of the split; the rest round to the 16-bit type, both ways."""
    flat = torch.linspace(-3, 3, 1001)
    flat[1001 - exact :] = torch.arange(1001, 1001 + exact, dtype=torch.float32)
    codec = compression.by_dtype(dtype)(1001, exact)
    encoded = codec.encode(flat)
    assert len(encoded) == 2 * (1001 - exact) + 4 * exact == codec.nbytes
    split = 1001 - exact
    expected = torch.cat([flat[:split].to(getattr(torch, dtype)).float(), flat[split:]])
    back = compression.to_float32(np.frombuffer(encoded, np.uint8).copy(), dtype, exact)
    np.testing.assert_array_equal(back, expected.numpy())
    # the worker's side of a pull: received into the codec's buffer, widened into place
    receiver = compression.by_dtype(dtype)(1001, exact)
    np.frombuffer(receiver.receive_buffer(torch.empty(1001)), np.uint8)[:] = np.frombuffer(
        encoded, np.uint8
    )
    out = torch.empty(1001)
    receiver.decode_into(out)
    assert torch.equal(out, expected)
    with pytest.raises(InvalidRequest, match="exact"):
        compression.to_float32(np.frombuffer(encoded, np.uint8).copy(), dtype, 2000)


def test_the_exact_tail_of_a_range_is_its_integer_buffers():
    model = torch.nn.BatchNorm1d(3)  # weight, bias | running mean, var | num_batches_tracked
    named = [*model.named_parameters(), *model.named_buffers()]
    roles = ["param", "param", "buffer", "buffer", "count"]
    manifest = Manifest.from_tensors(named, roles)
    assert manifest.numel == 13
    assert [manifest.exact_tail(lo, hi) for lo, hi in ((0, 13), (0, 12), (6, 13), (12, 13))] == [
        1,
        0,
        1,
        1,
    ]


@pytest.mark.parametrize("values", ["none", "bf16"])
def test_top_k_sends_the_largest_entries_and_feeds_back_the_rest(values):
    """Error feedback: what a push does not send is added to the next, so over many pushes
    the sent total follows the gradients' total; the buffers (the dense tail) go whole."""
    torch.manual_seed(0)
    numel, dense = 1000, 7
    codec = compression.by_name(f"topk:0.05:{values}")(numel, 2, "float32", dense)
    assert (codec.topk, codec.exact) == (50, 7)
    assert codec.nbytes == 50 * (4 + codec.itemsize) + 7 * 4
    total_grad, total_sent = torch.zeros(numel), torch.zeros(numel)
    for step in range(40):
        grad = torch.randn(numel)
        grad[numel - dense :] = torch.arange(dense) + 1000.0 * step  # buffers: values
        payload = np.frombuffer(codec.encode(grad, key=(0, step)), np.uint8).copy()
        assert len(payload) == codec.nbytes
        sent = torch.from_numpy(compression.sparse_to_dense(payload, 50, codec.dtype, dense, numel))
        assert torch.equal(sent[numel - dense :], grad[numel - dense :])  # whole
        assert int((sent[: numel - dense] != 0).sum()) == 50
        total_grad += grad
        total_sent += sent
        m = numel - dense
        # nothing lost: what was sent and what waits make up every gradient so far
        torch.testing.assert_close(
            total_sent[:m] + codec.residual, total_grad[:m], rtol=0, atol=1e-3
        )
        # a retry of the same push sends the same bytes and leaves the residual alone
        before = codec.residual.clone()
        again = np.frombuffer(codec.encode(grad, key=(0, step)), np.uint8)
        assert np.array_equal(again, payload) and torch.equal(codec.residual, before)


@pytest.mark.parametrize("flat", ["float32", "float64"])
@pytest.mark.parametrize("compress", ["topk:0.1:bf16", "int8", "bf16", "fp16"])
def test_rounding_in_place_is_what_the_wire_carries(compress, flat):
    """Through shared memory the slot is sparsified (top-k), quantised (int8) or rounded to
    16 bits (fp16, bf16: saturated past +-65504) in place: the same numbers as a trip
    through encode and the server's decode, residual and all; the buffers left whole."""
    torch.manual_seed(1)
    block = compression.Int8.block
    dtype, numel, dense = getattr(torch, flat), 2 * block + 30, 3
    kind = compression.by_name(compress, flat_dtype=flat)
    wire_side, in_place = kind(numel, 1, flat, dense), kind(numel, 1, flat, dense)
    for step in range(6):
        grad = torch.randn(numel, dtype=dtype) * (10.0**step)
        grad[block : block + 40] = 0  # a part of a block of zeros
        payload = np.frombuffer(wire_side.encode(grad, key=(1, step)), np.uint8).copy()
        if wire_side.topk:
            decoded = compression.sparse_to_dense(
                payload, wire_side.topk, kind.dtype, dense, numel, flat
            )
        else:
            decoded = compression.to_float32(payload, kind.dtype, dense, flat)
        slot = grad.clone()
        in_place.round_(slot, key=(1, step))
        assert torch.equal(slot, torch.from_numpy(decoded))
        in_place.round_(slot, key=(1, step))  # a retry: left as it is
        assert torch.equal(slot, torch.from_numpy(decoded))
        assert torch.equal(wire_side.residual, in_place.residual)
        assert torch.equal(slot[numel - dense :], grad[numel - dense :])


def test_a_top_k_push_that_lies_is_refused():
    codec = compression.by_name("topk:0.1")(100)
    payload = np.frombuffer(codec.encode(torch.randn(100)), np.uint8).copy()
    with pytest.raises(InvalidRequest, match="cannot hold"):
        compression.sparse_to_dense(payload, 11, "float32", 0, 100)
    with pytest.raises(InvalidRequest, match="cannot hold"):
        compression.sparse_to_dense(payload[:-4], 10, "float32", 0, 100)
    payload[:4] = np.frombuffer(np.int32(100).tobytes(), np.uint8)  # index 100 of 100
    with pytest.raises(InvalidRequest, match="outside"):
        compression.sparse_to_dense(payload, 10, "float32", 0, 100)
