"""The engine's one decoder of pictures a client sent (an edit's image and mask): bytes in, pixels or a 400.

Every untrusted picture goes through ``open_image`` (multipart uploads, base64 fields and files
under ``--input-dir`` alike), so three rules hold in one place:

- Only the formats people send are decoded: ``ACCEPTED_FORMATS``. Pillow knows some forty, and
  each decoder is attack surface with its own failure modes (a fuzz run found DDS raising
  ``NotImplementedError``, SPIDER ``AttributeError``, TIFF ``TypeError``); nobody edits a DDS
  texture or a SPIDER volume here. TIFF stays in: scanners and photo tools export it. Any other
  format is refused by name when its signature is known (``OTHER_SIGNATURES``).
- The daemon's own pixel bound (``limits.max_input_pixels``) is checked from the header, before
  a pixel is decoded. Pillow has a bound of its own (``Image.MAX_IMAGE_PIXELS``) which raises
  ``DecompressionBombError`` from ``Image.open`` itself, before our check could run, so a
  gigapixel header was a 500. Ours is the one that governs: Pillow's is switched off in this
  process (this module is the engine's only ``Image.open``), and its errors are still caught.
- Whatever a decoder raises while opening, loading, transposing or converting (``OSError``,
  ``ValueError``, ``SyntaxError``, ``struct.error``, ``EOFError``, ``MemoryError``, and the odd
  ``TypeError`` of a broken file) is a 400 ``invalid_image`` naming the field: nothing inside
  these calls is the daemon's own logic, so any exception there means the bytes are not a
  usable picture. Modes that do not convert plainly (16-bit and float greys, LAB, CMYK, P with
  transparency) are converted here, by rules that cannot fail.

Runs in the encode pool (never on the event loop): decoding costs milliseconds to seconds.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

from diffusiond.daemon.config import Limits
from diffusiond.daemon.errors import InvalidRequest, invalid
from diffusiond.protocol import ErrorCode

if TYPE_CHECKING:
    from PIL import Image

# Pillow's format ids of what is accepted; the order is the order Pillow tries them in.
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
ACCEPTED_NAMES = "PNG, JPEG, WebP, GIF, BMP or TIFF"
# Formats Pillow (or others) know and this daemon does not decode, by their first bytes: only for the message.
OTHER_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"qoif", "QOI"), (b"DDS ", "DDS"), (b"8BPS", "PSD"), (b"\x00\x00\x01\x00", "ICO"), (b"\x00\x00\x02\x00", "CUR"),
    (b"icns", "ICNS"), (b"%PDF", "PDF"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"\xffO\xffQ", "JPEG 2000"),
    (b"FORM", "IFF"), (b"\x59\xa6\x6a\x95", "Sun raster"), (b"gimp xcf", "XCF"), (b"<svg", "SVG"),
    (b"<?xml", "SVG/XML"), (b"\x76\x2f\x31\x01", "OpenEXR"), (b"#?RADIANCE", "HDR"), (b"P6", "PPM"),
    (b"P5", "PGM"), (b"P4", "PBM"), (b"BLP", "BLP"), (b"FTEX", "FTEX"), (b"\x0a\x05\x01", "PCX"),
)
_ISO_BMFF_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF"}


def _refuse(field: str, message: str) -> InvalidRequest:
    return invalid(f"{field} {message}", field=field, code=ErrorCode.INVALID_IMAGE)


def format_name(data: bytes) -> str | None:
    """The name of a format this daemon does not decode, from its signature (None: unknown)."""
    if data[4:8] == b"ftyp":
        return _ISO_BMFF_BRANDS.get(data[8:12], "an ISO media file (HEIF/AVIF/MP4)")
    return next((name for magic, name in OTHER_SIGNATURES if data.startswith(magic)), None)


def open_image(data: bytes, field: str, limits: Limits) -> Image.Image:
    """The decoded picture in ``data`` (rotated as its EXIF says), or a 400 naming ``field``:
    not an accepted format, over the pixel bound (checked before decoding), or undecodable."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = None  # ours governs (see the module's docstring); the same value from every thread
    try:
        img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)  # reads the header only
    except UnidentifiedImageError:
        other = format_name(data)
        what = f"is {other}, which this daemon does not read" if other else "is not an image in an accepted format"
        raise _refuse(field, f"{what}; send {ACCEPTED_NAMES}") from None
    except Image.DecompressionBombError as exc:  # only if something switched Pillow's bound back on
        raise _refuse(field, f"has too many pixels ({exc}); the limit is {limits.max_input_pixels} "
                             "(limits.max_input_pixels): send a smaller image") from None
    except Exception as exc:  # a decoder's failure on hostile bytes, whatever its type
        raise _refuse(field, f"is not a readable {ACCEPTED_NAMES} file: its header is broken "
                             f"({type(exc).__name__}: {str(exc)[:120]})") from None
    try:
        w, h = img.size
        if w * h > limits.max_input_pixels:
            raise _refuse(field, f"is {w}x{h} = {w * h} pixels; the limit is {limits.max_input_pixels} "
                                 "(limits.max_input_pixels): send a smaller image")
        if w < 1 or h < 1:
            raise _refuse(field, f"is {w}x{h}: it has no pixels")
        try:
            img.load()
            return ImageOps.exif_transpose(img) or img  # what the camera meant, as viewers show it
        except Exception as exc:  # as above: the pixels are not decodable
            raise _refuse(field, f"could not be decoded ({img.format} {w}x{h}): "
                                 f"{type(exc).__name__}: {str(exc)[:120]}") from None
    except BaseException:
        img.close()
        raise


def _grey8(img: Image.Image) -> np.ndarray:
    """A one-channel picture as uint8: 8-bit as it is; 16-bit, 32-bit and float greys scaled by
    their own range (Pillow's convert("L") clips those to 0..255, which turns most of them white)."""
    if img.mode in ("1", "L"):
        return np.asarray(img.convert("L"), dtype=np.uint8)
    a = np.asarray(img, dtype=np.float64)
    a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = float(a.min(initial=0.0)), float(a.max(initial=0.0))
    if img.mode.startswith("I;16") or (img.mode == "I" and lo >= 0 and hi <= 65535 and hi > 255):
        lo, hi = 0.0, 65535.0
    elif img.mode == "F" and lo >= 0 and hi <= 1:
        lo, hi = 0.0, 1.0
    span = hi - lo if hi > lo else 1.0
    return np.clip((a - lo) * (255.0 / span), 0, 255).astype(np.uint8)


def _convert(img: Image.Image, mode: str, field: str) -> Image.Image:
    try:
        return img.convert(mode)
    except Exception as exc:  # a mode Pillow cannot convert, or a decoder fault shown late
        raise _refuse(field, f"is a {img.mode} picture that cannot be converted to {mode} ({exc}); "
                             "send an RGB or greyscale image") from None


def rgb_array(img: Image.Image, field: str) -> np.ndarray:
    """(H, W, 3) uint8 of an input image, whatever its mode (alpha is dropped, as before)."""
    mode = img.mode
    if mode in ("I", "F") or mode.startswith("I;"):
        return np.repeat(_grey8(img)[..., None], 3, axis=2)
    if mode == "LAB":  # Pillow has no LAB -> RGB convert; lightness alone, as a greyscale picture
        return np.repeat(np.asarray(img.getchannel(0), dtype=np.uint8)[..., None], 3, axis=2)
    if mode == "P" and "transparency" in img.info:
        img = _convert(img, "RGBA", field)
    return np.asarray(_convert(img, "RGB", field), dtype=np.uint8)


def mask_array(img: Image.Image, field: str) -> np.ndarray:
    """(H, W) uint8, 255 where to repaint: transparent areas of a mask with alpha (OpenAI's
    convention), else white (diffusers')."""
    mode = img.mode
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or (mode == "P" and "transparency" in img.info):
        alpha = np.asarray(_convert(img, "RGBA", field), dtype=np.uint8)[..., 3]
        return (255 - alpha).astype(np.uint8)
    if mode in ("I", "F") or mode.startswith("I;"):
        return _grey8(img)
    if mode == "LAB":  # lightness is what a grey mask means
        return np.asarray(img.getchannel(0), dtype=np.uint8)
    return np.asarray(_convert(img, "L", field), dtype=np.uint8)
