"""Encoders: round trips through the real decoders (Pillow, PyAV), read-only inputs, npy streaming."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from diffusiond.daemon.outputs import encoders
from diffusiond.daemon.outputs.encoders import (
    EncodeOptions,
    content_type,
    encode,
    frame_durations,
    npy_header,
    npy_payload,
    npy_size,
    to_uint8,
)
from diffusiond.protocol import FORMATS, IMAGE_FORMATS, VIDEO_FORMATS

METADATA = {"prompt": "a lighthouse at dusk", "seed": "42", "steps": "20", "model": "tiny"}


def gradient(height: int = 64, width: int = 96) -> np.ndarray:
    """A smooth RGB image: what lossy codecs are good at, so their error should be small."""
    y, x = np.mgrid[0:height, 0:width]
    channels = [x * 255 // (width - 1), y * 255 // (height - 1), (x + y) * 255 // (width + height - 2)]
    return np.stack(channels, axis=-1).astype(np.uint8)


def noise(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def read_only(array: np.ndarray) -> np.ndarray:
    """The same array as a read-only view over bytes, like the engine's view of a worker's arena."""
    view = np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)
    assert not view.flags.writeable
    return view


def distinct_frames(count: int, height: int, width: int) -> np.ndarray:
    """Frames that differ from each other, so no animated encoder merges two of them."""
    frames = np.repeat(gradient(height, width)[None], count, axis=0)
    for index in range(count):
        frames[index, : height // 2, : width // 2] = (index * 25) % 256
    return frames


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def decode_mp4(data: bytes) -> tuple[av.video.stream.VideoStream, list[av.VideoFrame], dict[str, str]]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        return stream, frames, dict(container.metadata)


# --- formats -------------------------------------------------------------------------------------


def test_formats_and_content_types() -> None:
    assert {name: f.content_type for name, f in FORMATS.items()} == {
        "png": "image/png",
        "jpeg": "image/jpeg",
        "webp": "image/webp",
        "gif": "image/gif",
        "mp4": "video/mp4",
        "npy": "application/x-npy",
    }
    assert all(content_type(name) == f.content_type for name, f in FORMATS.items())
    assert {"png", "jpeg", "webp", "npy"} == IMAGE_FORMATS
    assert {"mp4", "webp", "gif", "npy"} == VIDEO_FORMATS


def test_every_format_the_protocol_offers_has_an_encoder() -> None:
    """The API admits what protocol.py lists; an encoder missing for one would fail jobs, not requests."""
    assert set(encoders._STILL_ENCODERS) | {"npy"} == IMAGE_FORMATS
    assert set(encoders._VIDEO_ENCODERS) | {"npy"} == VIDEO_FORMATS


def test_unknown_format_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="gif, jpeg, mp4, npy, png, webp"):
        content_type("bmp")
    with pytest.raises(ValueError, match="gif, jpeg, mp4, npy, png, webp"):
        encode(gradient(), "tiff")


def test_video_to_still_format_names_the_video_formats() -> None:
    video = distinct_frames(3, 16, 16)
    for fmt in ("png", "jpeg"):
        with pytest.raises(ValueError, match="videos go to: gif, mp4, npy, webp"):
            encode(video, fmt)


def test_image_to_video_only_format_names_the_image_formats() -> None:
    for fmt in ("mp4", "gif"):
        with pytest.raises(ValueError, match="images go to: jpeg, npy, png, webp"):
            encode(gradient(), fmt)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((8, 8, 4), np.uint8),
        np.zeros((8, 8), np.uint8),
        np.zeros((2, 2, 8, 8, 3), np.uint8),
        np.zeros((0, 8, 3), np.uint8),
        np.zeros((8, 8, 3), np.int16),
    ],
)
def test_bad_shapes_and_dtypes_are_refused(array: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"shape|empty|dtype"):
        encode(array, "png")


# --- options -------------------------------------------------------------------------------------


def test_options_validate_and_own_their_metadata() -> None:
    source = dict(METADATA)
    options = EncodeOptions(metadata=source)
    source["prompt"] = "changed"
    assert options.metadata["prompt"] == "a lighthouse at dusk"
    assert hash(options) == hash(EncodeOptions(metadata=METADATA))
    assert options == EncodeOptions(metadata=METADATA)
    with pytest.raises(ValueError, match="png_compress_level"):
        EncodeOptions(png_compress_level=10)
    with pytest.raises(ValueError, match="fps"):
        EncodeOptions(fps=0)
    with pytest.raises(ValueError, match="metadata key"):
        EncodeOptions(metadata={"": "x"})
    with pytest.raises(ValueError, match="metadata value"):
        EncodeOptions(metadata={"seed": 42})  # type: ignore[dict-item]


# --- still images --------------------------------------------------------------------------------


def test_png_round_trip_is_exact_and_carries_text_chunks() -> None:
    image = noise((37, 53, 3))
    data = encode(image, "png", EncodeOptions(metadata=METADATA))
    decoded = pil(data)
    assert decoded.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(decoded), image)
    assert decoded.text == METADATA
    assert b"tEXtprompt\x00a lighthouse at dusk" in data


def test_png_non_latin1_metadata_survives() -> None:
    data = encode(gradient(), "png", EncodeOptions(metadata={"prompt": "灯台、夕暮れ"}))
    assert pil(data).text == {"prompt": "灯台、夕暮れ"}


def test_png_compress_level_changes_size() -> None:
    image = gradient(128, 128)
    sizes = {level: len(encode(image, "png", EncodeOptions(png_compress_level=level))) for level in (0, 1, 9)}
    assert sizes[0] > sizes[1] > sizes[9]


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_lossy_formats_decode_close_to_the_input(fmt: str) -> None:
    image = gradient(64, 96)
    decoded = pil(encode(image, fmt))
    assert decoded.format == fmt.upper()
    assert decoded.size == (96, 64)
    assert np.abs(np.asarray(decoded.convert("RGB"), np.int16) - image).mean() < 2.5


def test_jpeg_carries_metadata_comment() -> None:
    decoded = pil(encode(gradient(), "jpeg", EncodeOptions(metadata=METADATA)))
    assert b'"seed":"42"' in decoded.info["comment"]


def test_webp_lossless_is_exact() -> None:
    image = noise((20, 30, 3))
    decoded = pil(encode(image, "webp", EncodeOptions(webp_lossless=True)))
    np.testing.assert_array_equal(np.asarray(decoded.convert("RGB")), image)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp", "gif", "mp4", "npy"])
def test_read_only_input_works_and_is_not_modified(fmt: str) -> None:
    original = distinct_frames(3, 33, 47) if fmt in ("gif", "mp4") else gradient(33, 47)
    for source in (original, original.astype(np.float32) / 255):
        view = read_only(source)
        assert encode(view, fmt)
        np.testing.assert_array_equal(view, source)
        assert not view.flags.writeable


# --- float input ---------------------------------------------------------------------------------


def test_to_uint8_matches_diffusers_conversion() -> None:
    values = np.array([-0.5, 0.0, 0.5 / 255, 1.5 / 255, 0.5, 127.5 / 255, 1.0, 1.7, np.nan], np.float32)
    expected = np.clip((values * 255).round(), 0, 255)
    expected[np.isnan(expected)] = 0
    np.testing.assert_array_equal(to_uint8(values), expected.astype(np.uint8))
    image = noise((4, 4, 3))
    assert to_uint8(image) is image


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_float_input_gives_the_same_pixels_as_the_uint8_conversion(dtype: type) -> None:
    floats = np.random.default_rng(1).random((24, 40, 3)).astype(dtype)
    reference = np.clip((floats.astype(np.float32) * 255).round(), 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(to_uint8(floats), reference)
    np.testing.assert_array_equal(np.asarray(pil(encode(floats, "png"))), reference)
    assert encode(floats, "jpeg") == encode(reference, "jpeg")
    video = np.stack([floats, floats[::-1]])
    assert encode(video, "gif") == encode(to_uint8(video), "gif")


def test_single_frame_video_is_accepted_as_an_image() -> None:
    image = noise((16, 24, 3))
    assert encode(image[None], "png") == encode(image, "png")
    assert encode(image[None], "webp") == encode(image, "webp")


# --- video ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("height", "width", "fps"),
    [(32, 48, 16), (33, 47, 16), (32, 48, 24)],
)
def test_mp4_decodes_to_every_frame_at_the_requested_fps(height: int, width: int, fps: int) -> None:
    video = read_only(distinct_frames(9, height, width))
    data = encode(video, "mp4", EncodeOptions(fps=fps, metadata=METADATA))
    stream, frames, metadata = decode_mp4(data)
    assert len(frames) == 9
    # Odd sizes are padded up to even (yuv420p), never cropped.
    assert {(frame.height, frame.width) for frame in frames} == {(height + height % 2, width + width % 2)}
    assert stream.average_rate == fps
    assert [frame.pts * frame.time_base for frame in frames] == [Fraction(i, fps) for i in range(9)]
    assert stream.codec_context.name == "h264"
    assert stream.codec_context.pix_fmt == "yuv420p"
    assert metadata["title"] == METADATA["prompt"]
    assert '"seed":"42"' in metadata["comment"]
    assert data.find(b"moov") < data.find(b"mdat")  # faststart: the index comes first


def test_mp4_colours_survive_the_round_trip() -> None:
    image = gradient(64, 96)
    _, frames, _ = decode_mp4(encode(np.stack([image] * 3), "mp4"))
    decoded = frames[1].to_ndarray(format="rgb24")
    assert np.abs(decoded.astype(np.int16) - image).mean() < 3


def test_mp4_padding_replicates_the_edge() -> None:
    frame = noise((3, 5, 3))
    padded = encoders._even_frame(frame)
    assert padded.shape == (4, 6, 3)
    np.testing.assert_array_equal(padded[:3, :5], frame)
    np.testing.assert_array_equal(padded[3, :5], frame[2])
    np.testing.assert_array_equal(padded[:3, 5], frame[:, 4])
    even = noise((4, 6, 3))
    assert encoders._even_frame(even) is even


def test_h264_encoder_is_found_and_a_missing_one_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert encoders.h264_encoder() in ("libx264", *encoders._H264_CANDIDATES)
    monkeypatch.setattr(encoders, "_H264_CANDIDATES", ("no_such_h264",))
    with pytest.raises(RuntimeError, match=r"H\.264 encoder.*no_such_h264"):
        encoders.h264_encoder.__wrapped__()


@pytest.mark.parametrize("fmt", ["webp", "gif"])
def test_animated_formats_have_every_frame(fmt: str) -> None:
    video = distinct_frames(7, 24, 40)
    decoded = pil(encode(video, fmt, EncodeOptions(fps=16)))
    assert decoded.format == fmt.upper()
    assert decoded.n_frames == 7
    assert decoded.size == (40, 24)
    total_ms = 0
    for index in range(decoded.n_frames):
        decoded.seek(index)
        decoded.load()  # WebP reads a frame's duration only when it decodes the frame
        total_ms += decoded.info["duration"]
    assert abs(total_ms - 7 * 1000 / 16) <= 10


def test_frame_durations_do_not_drift() -> None:
    for fps, tick in [(16, 10), (16, 1), (24, 10), (30, 1), (7, 10)]:
        durations = frame_durations(100, fps, tick)
        assert all(d % tick == 0 and d >= tick for d in durations)
        elapsed = np.cumsum(durations)
        assert np.abs(elapsed - np.arange(1, 101) * 1000 / fps).max() <= tick / 2
    assert frame_durations(3, 1000, 10) == [10, 10, 10]


# --- npy -----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([np.uint8, np.float16, np.float32]),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple),
    seed=st.integers(0, 2**16),
)
def test_npy_header_and_payload_load_back(dtype: type, shape: tuple[int, ...], seed: int) -> None:
    rng = np.random.default_rng(seed)
    array = read_only((rng.random(shape) * 255).astype(dtype))
    header = npy_header(array.dtype, array.shape)
    assert len(header) % 64 == 0  # the data starts aligned, as np.save writes it
    payload = npy_payload(array)
    assert payload.readonly and payload.nbytes == array.nbytes
    data = header + payload
    assert len(data) == npy_size(array.dtype, array.shape)
    loaded = np.load(io.BytesIO(data), allow_pickle=False)
    assert loaded.dtype == array.dtype and loaded.shape == array.shape
    np.testing.assert_array_equal(loaded, array)
    saved = io.BytesIO()
    np.save(saved, array)
    assert data == saved.getvalue()
    assert encode(array, "npy") == data


def test_npy_payload_is_a_view_and_refuses_to_copy() -> None:
    array = noise((4, 6, 3))
    payload = npy_payload(array)
    array[0, 0, 0] ^= 0xFF
    assert payload[0] == array[0, 0, 0]
    with pytest.raises(ValueError, match="not C-contiguous"):
        npy_payload(array[:, ::2])
    with pytest.raises(ValueError, match="pickle"):
        npy_header(np.dtype(object), (1,))
