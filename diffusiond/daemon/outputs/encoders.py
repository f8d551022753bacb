"""Output encoders: turn a worker's output (a read-only numpy view of shared memory) into file bytes.

The engine runs these in a thread pool, off the event loop, so every function here is a plain
synchronous function with no shared mutable state (the one cache, of the chosen H.264 encoder, is
idempotent). Pillow and PyAV release the GIL while they compress, so encodes overlap each other and
the loop. Three rules hold throughout:

* The input array is never written to. It is a read-only view of a worker's arena slot, and the
  slot may still be streamed to another client.
* No full copy of a video is made on the way in. Videos are converted (float to uint8, odd size to
  even) one frame at a time, so the extra memory is one frame, not the whole clip.
* Raw output (``npy``) is not encoded at all: the HTTP layer sends ``npy_header(...)`` and then
  ``npy_payload(array)``, a memoryview of the arena, so those bytes are never copied in Python.

Shapes: an image is ``(H, W, 3)``; a video is ``(F, H, W, 3)``. Both are uint8, or float16/32/64
in [0, 1] when a client asked for raw floats (converted exactly as diffusers converts, see
``to_uint8``). A single-frame video ``(1, H, W, 3)`` is also accepted by the still-image formats
(png, jpeg, webp), as its one image: asking for ``--frames 1 --format png`` is a reasonable request
and nothing is lost. An image is not accepted by the video-only formats (mp4, gif): the API never
offers them for image models, so such a call is a bug upstream and is reported as one.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Final

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace
from numpy.lib import format as npy_format
from PIL import Image, PngImagePlugin

import diffusiond.daemon.outputs.sound as sound
from diffusiond.protocol import FORMATS, IMAGE_FORMATS, VIDEO_FORMATS

# Tried in order. libx264 is the reference encoder and ships in PyAV's wheels; "h264" lets FFmpeg
# pick its default H.264 encoder; the rest are hardware or alternative encoders that a custom
# FFmpeg build may have instead. libx264rgb is absent on purpose: it cannot write yuv420p.
_H264_CANDIDATES: Final[tuple[str, ...]] = (
    "libx264",
    "h264",
    "h264_nvenc",
    "h264_qsv",
    "h264_vaapi",
    "h264_amf",
    "h264_videotoolbox",
    "h264_mf",
    "h264_v4l2m2m",
    "libopenh264",
)

# libjpeg's COM marker holds at most this many bytes; a longer comment is left out, not truncated.
_JPEG_MAX_COMMENT: Final[int] = 65533

# PNG tEXt keywords are 1-79 Latin-1 printable characters (PNG spec 11.3.4.3).
_PNG_KEYWORD_MAX: Final[int] = 79


@dataclass(frozen=True)
class EncodeOptions:
    """How to encode one output. Immutable, so one instance can be shared by concurrent encodes.

    ``png_compress_level`` is 4, not Pillow's default 6. Measured with Pillow 13 (zlib-ng 2.3) on
    photographic, slightly noisy 1024x1024 images like diffusion outputs: 4 already gives the size
    of 6 and 9 (6-17% smaller than level 1), while 6 and 9 took as long as 4 or up to about 2x
    longer; level 1 was 1.2-2x faster than 4, for those bigger files. 4 is the knee of that
    curve: the smallest files at the lowest cost (docs/benchmarks.md has the figures and command).

    ``metadata`` (prompt, seed, steps, model, ...) goes into PNG tEXt chunks (iTXt when a value is
    not Latin-1), into the JPEG COM marker and the GIF comment as one JSON object, and into MP4
    container metadata (``title`` is the prompt, ``comment`` the JSON object). WebP gets none: it
    would need an XMP or EXIF packet, which is not cheap to write correctly.
    """

    png_compress_level: int = 4
    jpeg_quality: int = 90
    webp_quality: int = 90
    webp_lossless: bool = False
    fps: int = 16
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    # an mp4's sound track (issue 30): waveform (channels, samples) float32 in [-1, 1] and its sample rate
    audio: tuple[np.ndarray, int] | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        """Reject bad values here, with the field's name, rather than deep inside an encoder."""
        _check_range("png_compress_level", self.png_compress_level, 0, 9)
        _check_range("jpeg_quality", self.jpeg_quality, 1, 100)
        _check_range("webp_quality", self.webp_quality, 0, 100)
        _check_range("fps", self.fps, 1, 1000)
        for key, value in self.metadata.items():
            _check_metadata_item(key, value)
        # A private read-only copy: the caller's dict cannot change an options object in use.
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))


def _check_range(name: str, value: int, low: int, high: int) -> None:
    """Raise a ValueError naming the option when ``value`` is not an int in [low, high]."""
    if not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}")


def _check_metadata_item(key: Any, value: Any) -> None:
    """Metadata keys become PNG keywords, so they must follow PNG's rules; values must be text."""
    if not isinstance(key, str) or not 1 <= len(key) <= _PNG_KEYWORD_MAX:
        raise ValueError(f"metadata key must be a string of 1-{_PNG_KEYWORD_MAX} characters, got {key!r}")
    if any(not (32 <= ord(c) <= 126 or 161 <= ord(c) <= 255) for c in key):
        raise ValueError(f"metadata key {key!r} must be printable Latin-1 (a PNG keyword)")
    if not isinstance(value, str):
        raise ValueError(f"metadata value for {key!r} must be a string, got {type(value).__name__}")


DEFAULT_OPTIONS: Final[EncodeOptions] = EncodeOptions()


def content_type(fmt: str) -> str:
    """The HTTP content type for ``fmt``; a ValueError naming the known formats if there is none."""
    try:
        return FORMATS[fmt].content_type
    except KeyError:
        raise ValueError(f"unknown output format {fmt!r}; known formats: {_names(FORMATS)}") from None


def _names(formats: Any) -> str:
    """Format names, sorted, for error messages that tell the caller what would have worked."""
    return ", ".join(sorted(formats))


def to_uint8(array: np.ndarray) -> np.ndarray:
    """Float pixels in [0, 1] to uint8 as diffusers does: ``(x * 255).round()``, clamped to 0..255.

    The arithmetic is in float32 whatever the input float type, because diffusers calls
    ``.float()`` before it converts; float16 arithmetic would round some pixels differently. NaN
    becomes 0, which is what diffusers' cast produces on x86 (the familiar all-black image) but
    is otherwise undefined. uint8 input is returned as is (no copy); the input is never written.
    """
    if array.dtype == np.uint8:
        return array
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"pixels must be uint8, or float in [0, 1]; got dtype {array.dtype}")
    scaled = np.multiply(array, 255, dtype=np.float32)
    np.round(scaled, out=scaled)
    np.clip(scaled, 0, 255, out=scaled)
    np.nan_to_num(scaled, copy=False, nan=0.0)
    out: np.ndarray = scaled.astype(np.uint8)
    return out


def encode(array: np.ndarray, fmt: str, options: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
    """Encode an image ``(H, W, 3)`` or video ``(F, H, W, 3)`` array to ``fmt``'s bytes.

    ``npy`` is accepted too, for callers that need the bytes in one piece (base64 responses); it
    copies the array once, so the streaming path uses ``npy_header`` and ``npy_payload`` instead.
    """
    content_type(fmt)
    if fmt == "npy":
        return npy_header(array.dtype, array.shape) + npy_payload(np.ascontiguousarray(array))
    _check_pixels(array, fmt)
    if array.ndim == 3 or (array.shape[0] == 1 and fmt in _STILL_ENCODERS):
        if fmt not in _STILL_ENCODERS:
            raise ValueError(
                f"format {fmt!r} takes a video (F, H, W, 3), got an image of shape {array.shape}; "
                f"images go to: {_names(IMAGE_FORMATS)}"
            )
        image = array if array.ndim == 3 else array[0]
        return _STILL_ENCODERS[fmt](to_uint8(image), options)
    if fmt not in _VIDEO_ENCODERS:
        raise ValueError(f"format {fmt!r} takes an image (H, W, 3), got a video of shape {array.shape}; "
                         f"videos go to: {_names(VIDEO_FORMATS)}")
    return _VIDEO_ENCODERS[fmt](array, options)


def _check_pixels(array: np.ndarray, fmt: str) -> None:
    """Fail early, naming the shape or dtype, instead of letting Pillow or FFmpeg fail obscurely."""
    if array.ndim not in (3, 4) or array.shape[-1] != 3:
        raise ValueError(f"expected an image (H, W, 3) or a video (F, H, W, 3), got shape {array.shape}")
    if max(array.shape[-3:-1]) > (limit := FORMATS[fmt].max_side):  # libwebp says only "encoding error 5"
        raise ValueError(f"{fmt} holds at most {limit} pixels a side and this output is {array.shape[-2]}x"
                         f"{array.shape[-3]}: ask for png (or npy), or a smaller size or upscale")
    if array.size == 0:
        raise ValueError(f"cannot encode an empty array of shape {array.shape}")
    if array.dtype != np.uint8 and not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"pixels must be uint8, or float in [0, 1]; got dtype {array.dtype}")


def _pil_bytes(image: Image.Image, pil_format: str, **params: Any) -> bytes:
    """Save a Pillow image to bytes; the one place that knows Pillow writes to a file object."""
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **params)
    return buffer.getvalue()


def _json_comment(metadata: Mapping[str, str]) -> str:
    """All metadata as one compact JSON object, for formats that have a single comment field."""
    return json.dumps(dict(metadata), ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _encode_png(image: np.ndarray, options: EncodeOptions) -> bytes:
    """Lossless PNG with the metadata as text chunks (Pillow writes iTXt for non-Latin-1 values)."""
    info = PngImagePlugin.PngInfo()
    for key, value in options.metadata.items():
        info.add_text(key, value)
    return _pil_bytes(Image.fromarray(image), "PNG", compress_level=options.png_compress_level, pnginfo=info)


def _encode_jpeg(image: np.ndarray, options: EncodeOptions) -> bytes:
    """JPEG at ``jpeg_quality``, with the metadata as a COM marker when it fits in one."""
    params: dict[str, Any] = {"quality": options.jpeg_quality}
    if options.metadata:
        comment = _json_comment(options.metadata).encode()
        if len(comment) <= _JPEG_MAX_COMMENT:
            params["comment"] = comment
    return _pil_bytes(Image.fromarray(image), "JPEG", **params)


def _encode_webp(image: np.ndarray, options: EncodeOptions) -> bytes:
    """Still WebP, lossy at ``webp_quality`` or lossless (then quality is the effort spent)."""
    return _pil_bytes(Image.fromarray(image), "WEBP", quality=options.webp_quality, lossless=options.webp_lossless)


def _frame_images(video: np.ndarray) -> list[Image.Image]:
    """One Pillow image per frame, converting floats frame by frame (never the whole clip at once)."""
    return [Image.fromarray(to_uint8(video[index])) for index in range(video.shape[0])]


def frame_durations(count: int, fps: int, tick_ms: int) -> list[int]:
    """Per-frame display times in ms for animated formats, as multiples of the format's tick.

    1000/fps is rarely a whole number of ticks (GIF counts in 10 ms, WebP in 1 ms), so a constant
    duration would drift: 16 fps in GIF would play at 16.7 fps. Rounding the frame *boundaries*
    instead keeps every frame within one tick of its true time and the clip's length exact. A frame
    is never shorter than one tick (fps beyond the format's resolution plays slower, not garbled).
    """
    ticks_per_second = 1000 // tick_ms
    edges = [round(index * ticks_per_second / fps) for index in range(count + 1)]
    return [max(end - start, 1) * tick_ms for start, end in itertools.pairwise(edges)]


def _encode_animated_webp(video: np.ndarray, options: EncodeOptions) -> bytes:
    """Animated WebP that loops forever; libwebp may merge identical consecutive frames."""
    first, *rest = _frame_images(video)
    return _pil_bytes(
        first,
        "WEBP",
        save_all=True,
        append_images=rest,
        duration=frame_durations(video.shape[0], options.fps, 1),
        loop=0,
        quality=options.webp_quality,
        lossless=options.webp_lossless,
    )


def _encode_gif(video: np.ndarray, options: EncodeOptions) -> bytes:
    """Animated GIF (256-colour palette per frame) that loops forever.

    Pillow merges identical consecutive frames into one longer frame, so the frame count can be
    lower than F while the timing stays right.
    """
    first, *rest = _frame_images(video)
    params: dict[str, Any] = {}
    if options.metadata:
        params["comment"] = _json_comment(options.metadata).encode()
    return _pil_bytes(
        first,
        "GIF",
        save_all=True,
        append_images=rest,
        duration=frame_durations(video.shape[0], options.fps, 10),
        loop=0,
        **params,
    )


def _can_open_encoder(name: str) -> bool:
    """Whether encoder ``name`` exists and opens for a small yuv420p stream on this machine.

    Listing is not enough: hardware encoders (nvenc, qsv, ...) are compiled in everywhere but
    only open where the hardware and driver are present.
    """
    try:
        context = av.CodecContext.create(name, "w")
        context.width = context.height = 64
        context.pix_fmt = "yuv420p"
        context.time_base = Fraction(1, 25)
        context.open()
    except (av.FFmpegError, ValueError, TypeError):
        return False
    return True


@functools.cache
def h264_encoder() -> str:
    """The FFmpeg name of the H.264 encoder that MP4 output uses, found once per process.

    Cached because probing opens an encoder (nvenc's probe takes a noticeable fraction of a second
    where it exists). Raises RuntimeError, saying what was tried, when no H.264 encoder works.
    """
    available = av.codecs_available
    for name in _H264_CANDIDATES:
        if name in available and _can_open_encoder(name):
            return str(av.Codec(name, "w").name)
    raise RuntimeError(
        "mp4 output needs an H.264 encoder, and none of these opens in this PyAV/FFmpeg build: "
        f"{', '.join(_H264_CANDIDATES)}; install PyAV's binary wheel (it bundles libx264)"
    )


def _even_frame(frame: np.ndarray) -> np.ndarray:
    """Pad an odd height or width by one edge-replicated row or column, for yuv420p.

    yuv420p stores colour at half resolution, so the encoder needs even sizes. Padding rather
    than cropping keeps every generated pixel; replicating the edge (rather than adding black)
    keeps the shared chroma sample of the last row/column the right colour. Even frames (every
    size the API allows, which are multiples of 8) are returned as they are, without a copy.
    """
    pad_height, pad_width = frame.shape[0] % 2, frame.shape[1] % 2
    if not (pad_height or pad_width):
        return frame
    return np.pad(frame, ((0, pad_height), (0, pad_width), (0, 0)), mode="edge")


class _SharedBuffer:
    """A growable in-memory file whose bytes can be opened again, for MP4 ``+faststart``.

    faststart moves the index (moov) in front of the media data when the file is closed, so a
    player can start before the whole file arrives. FFmpeg does that by reopening the output for
    reading while it rewrites it; an io.BytesIO cannot be reopened, so PyAV fails at close. This
    class hands FFmpeg (through PyAV's ``io_open``) a second cursor over the same bytes.
    """

    def __init__(self) -> None:
        self.data = bytearray()

    def cursor(self) -> _Cursor:
        """A new file-like view of the bytes with its own position, starting at 0."""
        return _Cursor(self)

    def open_for_ffmpeg(self, url: str, flags: int, options: dict[str, str]) -> _Cursor:
        """PyAV's ``io_open`` callback: every file FFmpeg reopens is this one buffer."""
        return self.cursor()


class _Cursor:
    """A seekable reader/writer over a ``_SharedBuffer``; just the methods PyAV calls."""

    def __init__(self, shared: _SharedBuffer) -> None:
        self._shared = shared
        self._position = 0

    def readable(self) -> bool:
        """PyAV checks this before it lets FFmpeg read (faststart reads the file back)."""
        return True

    def writable(self) -> bool:
        """PyAV checks this before it lets FFmpeg write."""
        return True

    def seekable(self) -> bool:
        """MP4 needs seeking: the muxer goes back to patch box sizes and to move the index."""
        return True

    def tell(self) -> int:
        """PyAV requires tell() alongside seek() to treat the file as seekable."""
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move this cursor only; other cursors over the same bytes keep their positions."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._shared.data)}[whence]
        self._position = base + offset
        return self._position

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes from this cursor's position (b'' at the end, as files do)."""
        data = self._shared.data
        end = len(data) if size < 0 else min(len(data), self._position + size)
        chunk = bytes(data[self._position : end])
        self._position += len(chunk)
        return chunk

    def write(self, chunk: bytes) -> int:
        """Overwrite or extend the shared bytes at this cursor's position (gaps read as zeros)."""
        data = self._shared.data
        if self._position > len(data):
            data.extend(bytes(self._position - len(data)))
        data[self._position : self._position + len(chunk)] = chunk
        self._position += len(chunk)
        return len(chunk)


def _mp4_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """Container tags: the prompt as ``title`` (what players show) and everything as ``comment``."""
    tags = {"comment": _json_comment(metadata)} if metadata else {}
    if "prompt" in metadata:
        tags["title"] = metadata["prompt"]
    return tags


def _encode_mp4(video: np.ndarray, options: EncodeOptions) -> bytes:
    """H.264 yuv420p MP4 at exactly ``fps`` (time base 1/fps, frame i at pts i), faststart.

    Frames go to the encoder one at a time straight from the view; each frame of a C-contiguous
    (F, H, W, 3) array is contiguous, so ``from_ndarray`` reads it without a copy of the clip.
    Colour is converted with the BT.709 matrix in limited range and tagged as such, so players
    convert back with the same matrix (untagged H.264 is read as BT.601 by some, BT.709 by others).
    A sound track (``options.audio``) goes in as AAC, as long as the video (``sound.Track``).
    """
    frame_count, height, width, _ = video.shape
    rate = Fraction(options.fps, 1)
    shared = _SharedBuffer()
    with av.open(
        shared.cursor(),
        mode="w",
        format="mp4",
        container_options={"movflags": "+faststart"},
        io_open=shared.open_for_ffmpeg,
    ) as container:
        container.metadata.update(_mp4_metadata(options.metadata))
        stream = container.add_stream(h264_encoder(), rate=rate)
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = 1 / rate
        _tag_bt709(stream.codec_context)
        track = None if options.audio is None else sound.Track(container, *options.audio, frame_count / options.fps)
        for index in range(frame_count):
            rgb = np.ascontiguousarray(_even_frame(to_uint8(video[index])))
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
                format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG
            )
            frame.pts, frame.time_base = index, 1 / rate
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
        if track is not None:
            track.write()
    return bytes(shared.data)


def _tag_bt709(context: Any) -> None:
    """Tag the stream BT.709 (matrix, primaries, transfer), limited range: what sRGB video uses."""
    context.colorspace = 1  # AVCOL_SPC_BT709
    context.color_primaries = 1  # AVCOL_PRI_BT709
    context.color_trc = 1  # AVCOL_TRC_BT709
    context.color_range = 1  # AVCOL_RANGE_MPEG


_STILL_ENCODERS: Final[Mapping[str, Callable[[np.ndarray, EncodeOptions], bytes]]] = MappingProxyType(
    {"png": _encode_png, "jpeg": _encode_jpeg, "webp": _encode_webp}
)
_VIDEO_ENCODERS: Final[Mapping[str, Callable[[np.ndarray, EncodeOptions], bytes]]] = MappingProxyType(
    {"mp4": _encode_mp4, "webp": _encode_animated_webp, "gif": _encode_gif}
)


def npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """A .npy version 1.0 header for a C-order array of ``dtype`` and ``shape``.

    With it, raw output is served as header then ``npy_payload(array)``: the bulk bytes go from
    the arena to the socket without being copied or passed through ``np.save``. Built with
    numpy.lib.format's documented ``write_array_header_1_0`` so it matches what np.save writes
    (including the padding that 64-byte-aligns the data). Object dtypes are refused: they would
    need pickle, which nothing in diffusiond reads or writes.
    """
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ValueError(f"dtype {dtype} holds Python objects and cannot be written as .npy without pickle")
    shape = tuple(int(dim) for dim in shape)
    if any(dim < 0 for dim in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    header = {"descr": npy_format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    buffer = io.BytesIO()
    npy_format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def npy_size(dtype: np.dtype[Any], shape: tuple[int, ...]) -> int:
    """Total bytes of the .npy file (header plus data), for Content-Length before streaming."""
    return len(npy_header(dtype, shape)) + math.prod(shape) * np.dtype(dtype).itemsize


def npy_payload(array: np.ndarray) -> memoryview:
    """The array's bytes, in C order, as a flat read-only-if-the-array-is memoryview (no copy).

    Refuses a non-contiguous array instead of silently copying it: arena outputs are always dense,
    so one that is not is a bug worth hearing about.
    """
    if not array.flags.c_contiguous:
        raise ValueError(f"array of shape {array.shape} is not C-contiguous; npy_payload does not copy")
    return array.reshape(-1).view(np.uint8).data  # ndarray.data: the memoryview, typed as one
