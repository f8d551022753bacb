"""An edit's input image and mask: from the bytes a client sent to a sealed buffer for the worker.

Decoding, resizing and checking an image costs milliseconds to seconds, so it all runs in the
encode thread pool (``decode_in_pool`` runs ``decode_edit`` there, and the control and reference
images' decoders, which read their bytes here too), never on the event loop. What a client can
get wrong here is answered with an ``InvalidRequest`` naming the field: bytes that are not an
image, an image over the pixel limit, a mask whose size differs from the image, a path outside
``--input-dir`` or one no file can have (a NUL byte, too long, a symlink loop). Pictures are
decoded by ``images.py``, the engine's one decoder: its format allow-list, its pixel bound
(checked from the header, before the pixels are decoded, so a small file that decodes to
gigapixels costs nothing) and every decoder error as ``invalid_image``.

Masks follow the OpenAI edits API: where the mask PNG is transparent (alpha 0) the image is
repainted. A mask without an alpha channel is read the diffusers way: white is repainted. The
worker gets the mask as one uint8 channel, 255 where to repaint.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from diffusiond.daemon.config import Limits
from diffusiond.daemon.core import images
from diffusiond.daemon.errors import UploadTooLarge, invalid
from diffusiond.ipc.inputs import InputBuffer
from diffusiond.protocol import ErrorCode, Task

if TYPE_CHECKING:
    from PIL import Image

MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 4096  # Linux's NAME_MAX and PATH_MAX


@dataclass(frozen=True)
class Source:
    """Where one input comes from: bytes the client sent, or a path under ``--input-dir``."""

    field: str  # the request field, for error messages
    data: bytes | None = None
    b64: str | None = None
    path: str | None = None


@dataclass
class EditInput:
    """A decoded, validated edit input, owned by its job (the engine closes it when the job ends)."""

    task: Task
    strength: float
    buffer: InputBuffer
    width: int
    height: int

    def close(self) -> None:
        self.buffer.close()


class _Owner(Protocol):
    def close(self) -> None: ...


Decoded = TypeVar("Decoded", bound=_Owner)


async def decode_in_pool(executor: Executor, work: Callable[[], Decoded]) -> Decoded:
    """``work()`` in the encode pool: a decode of a request's pictures into a sealed buffer (an edit's
    ``EditInput``, control images, IP-Adapter references). A client that hangs up gets its handler
    cancelled (aiohttp's ``handler_cancellation``), but not the thread: the decode ends anyway, and what
    it returns, owned by nobody, kept an fd and the pictures' memory for the daemon's life. It is closed
    as it comes instead."""
    future = asyncio.get_running_loop().run_in_executor(executor, work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_unowned)
        raise


def _close_unowned(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def _bytes_of(src: Source, limits: Limits, input_dir: str | None) -> bytes:
    if src.data is not None:
        data = src.data
    elif src.b64 is not None:
        text = src.b64
        if text.startswith("data:"):  # a data URL: data:image/png;base64,....
            text = text.partition(",")[2]
        if len(text) * 3 // 4 > limits.max_upload_bytes:
            raise UploadTooLarge(f"{src.field} is over the upload limit of {limits.max_upload_bytes} bytes",
                                 field=src.field)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"{src.field} is not valid base64 (send the image file's bytes, base64-encoded)",
                          field=src.field, code=ErrorCode.INVALID_IMAGE) from None
    else:
        assert src.path is not None
        data = _read_path(src, limits, input_dir)
    if len(data) > limits.max_upload_bytes:
        raise UploadTooLarge(f"{src.field} is {len(data)} bytes; the upload limit is {limits.max_upload_bytes}",
                             field=src.field)
    return data


def _check_path_text(src: Source) -> None:
    """Refuse, as text and before any system call, a path no file can have: the OS would raise
    ValueError (a NUL byte) or ENAMETOOLONG, and the message could not say which field."""
    assert src.path is not None
    path = src.path
    if not path.strip() or "\x00" in path:
        raise invalid(f"{src.field} {path[:80]!r} is empty or holds a NUL character; name a file inside --input-dir",
                      field=src.field)
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError:
        raise invalid(f"{src.field} {path[:80]!r} cannot be a file name", field=src.field) from None
    longest = max(len(part) for part in encoded.split(b"/"))
    if len(encoded) >= MAX_PATH_BYTES or longest > MAX_NAME_BYTES:
        raise invalid(f"{src.field} is too long for a file name ({len(encoded)} bytes, a part of {longest}; "
                      f"the system allows {MAX_NAME_BYTES} a name and {MAX_PATH_BYTES - 1} in all)", field=src.field)


def _read_path(src: Source, limits: Limits, input_dir: str | None) -> bytes:
    """Read a file only if it lies inside ``input_dir`` once every symlink is resolved."""
    assert src.path is not None
    if input_dir is None:
        raise invalid(f"{src.field}: this daemon reads no input files (it was started without --input-dir); "
                      "send the image itself", field=src.field)
    _check_path_text(src)
    root = Path(input_dir).resolve()
    try:
        target = (root / src.path).resolve()  # an absolute src.path replaces root here, then fails the check
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11's resolve)
        raise invalid(f"{src.field} {src.path!r} cannot be resolved: {getattr(exc, 'strerror', None) or exc}; "
                      "name a file inside --input-dir", field=src.field) from None
    if not target.is_relative_to(root):
        raise invalid(f"{src.field} {src.path!r} is outside the input folder; name a file inside --input-dir",
                      field=src.field)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise invalid(f"{src.field} {src.path!r} cannot be read: {exc.strerror}", field=src.field) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise invalid(f"{src.field} {src.path!r} is not a regular file", field=src.field)
        if st.st_size > limits.max_upload_bytes:
            raise UploadTooLarge(f"{src.field} {src.path!r} is {st.st_size} bytes; the upload limit is "
                                 f"{limits.max_upload_bytes}", field=src.field)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limits.max_upload_bytes + 1)
    finally:
        os.close(fd)


def decode_edit(image: Source, mask: Source | None, *, task: Task, strength: float,
                width: int | None, height: int | None, limits: Limits, input_dir: str | None,
                step: int = 8, floor: int = 0, pictures: Sequence[Source] = ()) -> EditInput:
    """Decode, check and resize an edit's inputs into a sealed buffer (in the encode pool).

    The output size is ``width`` x ``height`` when the request gave one, else the image's own
    size rounded down to a multiple of ``step``, the model's (8, 16 for FLUX, 32 for LTX): the
    user sent no size to be told about, and a size the model refuses would be theirs to fix for a
    picture whose size they did not choose for it. The image and mask are resized to it. ``floor``: the model's
    smallest side where above the limits' (LTX-2's 64). ``pictures``: an edit's input pictures before ``image``
    (a request's ``images``), decoded at their own sizes: the pipeline resizes each to its own aspect ratio."""
    from PIL import Image

    img = images.open_image(_bytes_of(image, limits, input_dir), image.field, limits)
    w0, h0 = img.size
    w = width if width is not None else w0 // step * step
    h = height if height is not None else h0 // step * step
    low = max(limits.min_size, floor)
    if (width is None or height is None) and not (low <= w <= limits.max_size and low <= h <= limits.max_size):
        raise invalid(
            f"{image.field} is {w0}x{h0}; outputs are {low} to {limits.max_size} pixels a side: "
            "send a larger or smaller image, or a size to resize it to", field=image.field,
            code=ErrorCode.INVALID_IMAGE)
    plane = None
    if mask is not None:
        m = images.open_image(_bytes_of(mask, limits, input_dir), mask.field, limits)
        if m.size != (w0, h0):
            raise invalid(f"{mask.field} is {m.size[0]}x{m.size[1]} but {image.field} is {w0}x{h0}; "
                          "a mask must have the size of its image", field=mask.field, code=ErrorCode.INVALID_IMAGE)
        plane = images.mask_array(m, mask.field)
        if (w, h) != (w0, h0):
            plane = np.asarray(Image.fromarray(plane).resize((w, h), Image.Resampling.BILINEAR))
        plane = plane[..., None]
    rgb = images.rgb_array(img, image.field)
    if (w, h) != (w0, h0):
        rgb = np.asarray(Image.fromarray(rgb).resize((w, h), Image.Resampling.LANCZOS))
    earlier = [images.rgb_array(_picture(images.open_image(_bytes_of(p, limits, input_dir), p.field, limits), p.field),
                                p.field) for p in pictures]
    buffer = InputBuffer(rgb, plane, pictures=earlier)
    return EditInput(task=task, strength=strength, buffer=buffer, width=w, height=h)


MAX_PICTURE_RATIO = 100  # an earlier picture of an edit is resized by the pipeline to a fixed area; past ~144:1 a side
# of Qwen-Image-Edit Plus's 384x384 condition area rounds to 0 and the batch failed


def _picture(img: Image.Image, field: str) -> Image.Image:
    """An earlier picture of a several-picture edit, refused where the pipeline could not size it."""
    w, h = img.size
    if max(w, h) > MAX_PICTURE_RATIO * min(w, h):
        raise invalid(f"{field} is {w}x{h}: its long side is over {MAX_PICTURE_RATIO} times its short side, which "
                      "the pipeline cannot resize to its working area; crop it", field=field,
                      code=ErrorCode.INVALID_IMAGE)
    return img
