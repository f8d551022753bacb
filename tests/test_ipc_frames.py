"""Frames: every kind round-trips, sequence violations are caught, size limits hold, fuzzing."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusiond.ipc import messages as m
from diffusiond.ipc.errors import FrameTooLarge, ProtocolError
from diffusiond.ipc.frames import HEADER_SIZE, FrameDecoder, FrameEncoder
from diffusiond.ipc.tensors import TensorDesc

DESC = TensorDesc(dtype="uint8", shape=(64, 64, 3), nbytes=64 * 64 * 3, slot_id=3, offset=8192)
PARAMS = m.BatchParams(width=64, height=64, steps=2, guidance=7.5, num_frames=None, scheduler="euler")
SAMPLES: list[msgspec.Struct] = [
    m.Init(m.WorkerConfig(worker_id=1, model_name="tiny", model_spec="tiny", options={"a": "b"},
                          loras={"ink": "/loras/ink"}, max_loras=3)),
    m.Execute(3, PARAMS, [m.RequestSpec(request_id="r1", prompt="a cat", seed=1, negative_prompt="dog"),
                          m.RequestSpec(request_id="r2", prompt="a cat", seed=2, preview_every=2,
                                        preview_max_side=256)]),
    m.Execute(4, msgspec.structs.replace(PARAMS, loras=(m.LoraRef("dots", -0.5), m.LoraRef("ink", 0.8))),
              [m.RequestSpec(request_id="r2", prompt="a cat", seed=1)]),
    m.AddLora(name="ink", path="/loras/ink"),
    m.Cancel(["r1", "r2"]),
    m.Release([1, 2, 3]),
    m.Release([], host_copy=True),
    m.Sleep(),
    m.Wake(),
    m.Shutdown(),
    m.Trace(),
    m.Ping(),
    m.Hello(worker_id=1, pid=123, arena_bytes=1 << 20),
    m.LoadProgress(bytes_loaded=3 << 20),
    m.ParamTableFrame("tiny", b"x\x9c"),
    m.Ready(model_name="tiny", device="cpu", load_ms=12.5, capabilities=m.Capabilities(task="text-to-video", fps=8),
            lora_errors={"misfit": "size mismatch"}),
    m.ComputeDone(batch_id=3, compute_ms=10.0),
    m.Progress(batch_id=3, step=1, total=2),
    m.OutputReady(request_id="r1", batch_id=3, tensor=DESC),
    m.RequestEnded(request_id="r1", batch_id=3, status="failed", message="boom", stage="computing"),
    m.Ack(command=m.Kind.TRACE, ok=True, message="", trace=[m.TraceEvent("compute_start", 3, 99)]),
    m.Ack(command=m.Kind.PING, ok=True, loras_loaded=["ink"]),
    m.Ack(command=m.Kind.WAKE, ok=True, host_kept=3 << 30),
    m.Fatal(message="device lost"),
    m.SlotWait(request_id="r1", nbytes=1 << 20, in_use=3 << 20, capacity=4 << 20),
    m.PreviewReady(request_id="r1", batch_id=3, step=4, total=20, tensor=DESC),
    m.Fetch(job_id="j_0123456789abcdef", index=1),
    m.Lease(lease=7, tensor=DESC, map_bytes=1 << 20),
    m.Refused(job_id="j_x", index=0, status=410, code="output_released", message="already delivered"),
    m.Unpin(lease=7),
    m.UpdateLora(name="trainer", tensors=[m.WeightTensor("unet.a.lora_A.weight", "bfloat16", [4, 32], 64)], version=3),
    m.UpdateWeights(model="sd15", component="unet", tensors=[m.WeightTensor("conv_out.weight", "float16", [4, 8], 0)]),
    m.Updated(name="trainer", version=3),
    m.UpdateRefused(name="trainer", status=400, code="invalid_request", message="tensor 'x'", field="tensors"),
    m.ComputeDone(batch_id=4, compute_ms=1.0, lora_versions={"trainer": 3, "ink": 0}),
]


def test_frame_samples_cover_every_kind() -> None:
    assert {m.KIND_OF[type(s)] for s in SAMPLES} == set(m.Kind)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_frame_round_trip(msg: msgspec.Struct) -> None:
    enc, dec = FrameEncoder(), FrameDecoder()
    data = enc.encode(msg, nfds=1)
    # byte by byte: the decoder must cope with any split of the stream
    frames = [f for i in range(len(data)) for f in dec.feed(data[i : i + 1])]
    assert frames == [(m.KIND_OF[type(msg)], 0, 1, msg)]
    assert dec.buffered == 0


def test_frame_sequence_numbers_count_per_direction() -> None:
    enc, dec = FrameEncoder(), FrameDecoder()
    got = dec.feed(b"".join(enc.encode(m.Cancel([str(i)])) for i in range(5)))
    assert [seq for _, seq, _, _ in got] == [0, 1, 2, 3, 4]


def _frames(n: int) -> list[bytes]:
    enc = FrameEncoder()
    return [enc.encode(m.Progress(batch_id=0, step=i, total=n)) for i in range(n)]


@pytest.mark.parametrize(
    ("order", "expected", "received", "word"),
    [([0, 2], 1, 2, "gap"), ([0, 1, 1], 2, 1, "repeated"), ([0, 2, 1], 1, 2, "gap"), ([1], 0, 1, "gap")],
    ids=["gap", "repeat", "reorder", "first-lost"],
)
def test_frame_sequence_violation_names_numbers(order: list[int], expected: int, received: int, word: str) -> None:
    frames, dec = _frames(3), FrameDecoder()
    with pytest.raises(ProtocolError) as err:
        for i in order:
            dec.feed(frames[i])
    assert f"expected {expected}, received {received}" in str(err.value)
    assert word in str(err.value)


def test_frame_oversize_rejected_at_sender_with_both_sizes() -> None:
    enc = FrameEncoder(max_body=1000)
    with pytest.raises(FrameTooLarge) as err:
        enc.encode(m.Fatal(message="x" * 5000))
    assert "5" in str(err.value) and "1000" in str(err.value)
    assert enc.next_seq == 0  # nothing was numbered, so nothing is missing on the wire
    assert FrameDecoder().feed(enc.encode(m.Fatal(message="ok")))[0][1] == 0


def test_frame_oversize_length_rejected_at_receiver() -> None:
    data = FrameEncoder().encode(m.Fatal(message="x" * 5000))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        FrameDecoder(max_body=1000).feed(data[:HEADER_SIZE])


def test_frame_corrupted_body_detected() -> None:
    data = bytearray(FrameEncoder().encode(m.Cancel(["abc"])))
    data[-1] ^= 0xFF
    with pytest.raises(ProtocolError, match="checksum"):
        FrameDecoder().feed(bytes(data))


def test_frame_invalid_descriptor_rejected() -> None:
    """A body that parses but describes an impossible tensor never reaches the engine's state."""
    bad = msgspec.msgpack.encode(
        {"request_id": "r", "batch_id": 0,
         "tensor": {"dtype": "uint8", "shape": [4], "nbytes": 999, "slot_id": 1}}
    )
    import struct
    import zlib

    from diffusiond.ipc.frames import HEADER, MAGIC, VERSION

    frame = HEADER.pack(MAGIC, VERSION, m.Kind.OUTPUT_READY, 0, 0, len(bad), zlib.crc32(bad)) + bad
    assert struct.calcsize("!4sBBHQII") == HEADER_SIZE
    with pytest.raises(ProtocolError, match="nbytes"):
        FrameDecoder().feed(frame)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_frame_decoder_fuzz_random_bytes(chunks: list[bytes]) -> None:
    dec = FrameDecoder(max_body=1 << 16)
    try:
        for c in chunks:
            dec.feed(c)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_frame_decoder_fuzz_mutated_frames(msg: msgspec.Struct, data: st.DataObject) -> None:
    """Flip, cut and splice real frames: only ProtocolError may come out, never another exception."""
    frame = bytearray(FrameEncoder().encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    dec = FrameDecoder(max_body=1 << 16)
    try:
        dec.feed(bytes(frame[:cut]))
        dec.feed(bytes(frame[cut:]))
    except ProtocolError:
        pass
