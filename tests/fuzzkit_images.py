"""Images of every format, and what can go wrong with them, for the fuzzing kit (part of
tests/fuzzkit.py): small real images in every format and mode this Pillow writes, headers that claim
bombs in each format, formats the daemon has no business decoding, byte-level mutations, and the
base64 and data-URL spellings of an image in a JSON body.

Apart because it is a corpus, not a surface: the base64 and ``image_path`` families, the edits form,
the header family and the daemon's ``--input-dir`` (tests/fuzzkit_env.py) all use it.
"""

from __future__ import annotations

import base64
import functools
import io
import struct
import zlib
from collections.abc import Iterable
from typing import Any

from hypothesis import strategies as st


def _save(img: Any, fmt: str, **kw: Any) -> bytes | None:
    buf = io.BytesIO()
    try:
        img.save(buf, format=fmt, **kw)
    except Exception:  # a format this Pillow cannot write (no encoder, no ghostscript): none of it
        return None
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (and one tiny IDAT): a bomb that costs nothing."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + _png_chunk(b"IEND", b""))


def bmp_header(width: int, height: int) -> bytes:
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 54 + 64, 0, 0, 54) + info + b"\0" * 64


def gif_header(width: int, height: int) -> bytes:
    return (b"GIF89a" + struct.pack("<HH", width, height) + b"\x80\x00\x00" + b"\0\0\0\xff\xff\xff"
            + b"\x2c" + struct.pack("<HHHH", 0, 0, width, height) + b"\x00\x02\x02\x44\x01\x00\x3b")


def jpeg_header(width: int, height: int, base: bytes) -> bytes:
    """A real JPEG whose SOF0 dimensions are rewritten."""
    i = base.find(b"\xff\xc0")
    if i < 0:
        return base
    return base[: i + 5] + struct.pack(">HH", height, width) + base[i + 9:]


def webp_header(width: int, height: int) -> bytes:
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0\0\0\0" + (width - 1).to_bytes(3, "little") + (
        height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def qoi_header(width: int, height: int) -> bytes:
    return b"qoif" + struct.pack(">II", width, height) + b"\x03\x00" + b"\0" * 7 + b"\x01"


def tiff_header(width: int, height: int) -> bytes:
    entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (273, 4, 1, 8 + 2 + 12 * 8 + 4), (278, 4, 1, height), (279, 4, 1, 16)]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\0\0\0\0"
    return b"II*\0" + struct.pack("<I", 8) + ifd + b"\0" * 16


ISSUE_GIF = base64.b64decode("R0lGODlh/////4AAAAAAAP///ywAAAAA/////wACAkQBADs=")


@functools.cache
def image_corpus() -> dict[str, bytes]:
    """Small real images in every format this Pillow writes, in several modes, then the hostile
    ones: headers claiming 10^10 pixels (above Pillow's own bomb limit) or just above the daemon's
    16.7 MP (between the two), formats the daemon has no business decoding (DDS with an unknown
    pixel format, SPIDER, a LAB TIFF), and nothing-images."""
    from PIL import Image

    Image.init()
    rgb = Image.new("RGB", (64, 64), (40, 120, 200))
    for x in range(0, 64, 4):
        rgb.putpixel((x, x), (255, 0, 0))
    out: dict[str, bytes] = {}
    for fmt in sorted(Image.SAVE):
        for mode in ("RGB", "RGBA", "L", "P", "1", "CMYK", "I;16", "F", "LAB"):
            data = _save(rgb.convert(mode) if mode not in ("I;16", "LAB") else rgb.convert("L").convert(mode)
                         if mode == "I;16" else rgb.convert("LAB"), fmt)
            if data:
                out[f"{fmt.lower()}-{mode.lower().replace(';', '')}"] = data
    anim = [Image.new("P", (64, 64), i * 40) for i in range(3)]
    gif = io.BytesIO()
    anim[0].save(gif, format="GIF", save_all=True, append_images=anim[1:])
    out["gif-animated"] = gif.getvalue()
    out["png-mask-72"] = _save(Image.new("RGBA", (72, 72), (0, 0, 0, 0)), "PNG") or b""
    out["png-72x64"] = _save(Image.new("RGB", (72, 64)), "PNG") or b""
    jpeg = out.get("jpeg-rgb", b"")
    for w, h, tag in ((100_000, 100_000, "bomb"), (4097, 4097, "over-limit"), (65500, 65500, "bomb-max"),
                      (1, 100_000_000, "bomb-thin")):
        out[f"png-{tag}"] = png_header(w, h)
        out[f"bmp-{tag}"] = bmp_header(w, h)
        out[f"tiff-{tag}"] = tiff_header(w, h)
        out[f"qoi-{tag}"] = qoi_header(w, h)
        if w <= 65535 and h <= 65535:
            out[f"gif-{tag}"] = gif_header(w, h)
            out[f"jpeg-{tag}"] = jpeg_header(w, h, jpeg)
        if w <= 1 << 24 and h <= 1 << 24:
            out[f"webp-{tag}"] = webp_header(w, h)
    out["gif-issue26"] = ISSUE_GIF
    dds = out.get("dds-rgba") or out.get("dds-rgb")
    if dds:
        out["dds-unknown-fourcc"] = dds[:84] + b"ZZZZ" + dds[88:]
        out["dds-fourcc-flag"] = dds[:80] + struct.pack("<I", 4) + b"ZZZZ" + dds[88:]
    out.update({"empty": b"", "png-magic": b"\x89PNG\r\n\x1a\n", "gif-magic": b"GIF89a", "zeros": b"\0" * 64,
                "text": b"hello, not an image", "svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
                "eps-magic": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100000 100000\n"})
    return out


def mutate(data: bytes, ops: Iterable[tuple[int, int, int]]) -> bytes:
    """Byte edits (kind, where, value): flip a byte, set a byte, cut the file, or repeat a slice.
    ``where`` counts from the start modulo the length, so most edits land in the header."""
    buf = bytearray(data)
    for kind, where, value in ops:
        if not buf:
            break
        i = where % len(buf)
        if kind == 0:
            buf[i] ^= 1 << (value % 8)
        elif kind == 1:
            buf[i] = value % 256
        elif kind == 2:
            del buf[i:]
        else:
            buf[i:i] = buf[i: i + value % 64]
    return bytes(buf)


@st.composite
def image_bytes(draw: st.DrawFn) -> bytes:
    """A real or hostile image, half the time mutated (flips in the header, truncations)."""
    corpus = image_corpus()
    data = corpus[draw(st.sampled_from(sorted(corpus)))]
    if draw(st.integers(0, 1)):
        ops = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 63) | st.integers(0, 1 << 20),
                                      st.integers(0, 255)), min_size=1, max_size=4))
        data = mutate(data, ops)
    return data


def as_base64(data: bytes, style: int) -> str:
    b64 = base64.b64encode(data).decode()
    return [b64, "data:image/png;base64," + b64, "data:image/gif;base64," + b64, b64[:-1], "data:;base64," + b64,
            b64 + "===="][style % 6]
