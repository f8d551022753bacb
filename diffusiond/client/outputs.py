"""How a job's outputs become PIL images and numpy arrays on the client's side.

Apart from ``aio.py`` so that numpy and PIL stay out of it: each is imported inside the
function that needs it, the first time an output is asked for in that form.
"""

from __future__ import annotations

import asyncio
import io
from typing import TYPE_CHECKING, Any

import aiohttp

from diffusiond.client.errors import ClientError, DaemonError

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from PIL import Image

    from diffusiond.client.zerocopy import OutputMapper

_CHUNK = 256 * 1024


def decoded(data: bytes, as_array: bool, what: str) -> Any:
    """``what`` (output ``k`` of job ``j``, its content type) as a PIL image, or its pixels; a ValueError saying
    what to ask for instead where it is no picture PIL reads (mp4), or, for an array, more than one (an animated
    GIF or WebP: its first frame alone, returned as the whole, dropped the rest without a word)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{what} is no picture to decode: fetch it with output='bytes', or ask for "
                         "output_format='npy' (output='array' on generate) for its frames as an array") from None
    if not as_array:
        return image
    frames = int(getattr(image, "n_frames", 1))
    if frames > 1:
        raise ValueError(f"{what} has {frames} frames, and an array of one would drop the others: ask for "
                         "output_format='npy' (output='array' on generate) for all of them as one array, or "
                         "output='pil' to seek() through them")
    import numpy as np

    return np.asarray(image.convert("RGB"))


def image_of(array: NDArray[Any]) -> Image.Image:
    """An npy image as a PIL image: floats in [0, 1] are scaled to uint8; a video has no one image."""
    import numpy as np
    from PIL import Image

    if array.ndim != 3:
        raise ValueError(f"an array of shape {array.shape} is not one image: ask for output='array'")
    if array.dtype != np.uint8:
        array = (np.clip(array.astype(np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(array))


async def read_npy(stream: aiohttp.StreamReader) -> NDArray[Any]:
    """An ``.npy`` body read straight into the array's own memory (one copy, no second buffer
    of the whole output), with numpy's own header reader. Object arrays are refused: loading
    one would unpickle.

    A body that is not a whole ``.npy`` (it ends early, or its header does not parse) is the daemon's
    answer, complete as HTTP, so a DaemonError ``bad_response``, never a raw asyncio or numpy error.
    A connection lost midway is aiohttp's payload error: the caller's DaemonUnreachable."""
    import numpy as np
    from numpy.lib import format as npy

    try:
        head = await stream.readexactly(10)  # magic, version, and the first two bytes of the header length
        if head[:6] != b"\x93NUMPY":
            raise _bad("is not an .npy stream")
        if head[6] >= 2:
            head += await stream.readexactly(2)  # versions 2 and 3 give the length in 4 bytes
        header = await stream.readexactly(int.from_bytes(head[8:], "little"))
    except asyncio.IncompleteReadError as exc:
        raise _bad(f"ended inside its .npy header, {len(exc.partial)} bytes short of it") from None
    fp = io.BytesIO(head + header)
    try:
        version = npy.read_magic(fp)
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, fortran, dtype = read_header(fp)
    except ValueError as exc:
        raise _bad(f"has a malformed .npy header: {exc}") from None
    if dtype.hasobject:
        raise _bad("holds Python objects")
    count = 1
    for dim in shape:
        count *= int(dim)
    raw = np.empty(count * dtype.itemsize, np.uint8)
    view, filled = raw.data, 0
    while filled < len(raw):
        chunk = await stream.read(min(_CHUNK, len(raw) - filled))
        if not chunk:
            raise _bad(f"ended after {filled} of its {len(raw)} bytes of data (shape {tuple(shape)}, {dtype})")
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return raw.view(dtype).reshape(shape, order="F" if fortran else "C")


def _bad(what: str) -> DaemonError:
    return DaemonError(200, "bad_response", f"the daemon's array output {what}")


async def open_mapper(socket_path: str, timeout: float | None, required: bool | None) -> OutputMapper | None:
    """``AsyncClient``'s zero-copy mapper, connected in a worker thread; None where that path does not work here
    (no output socket: a daemon over TCP, on another machine, of another user), or ``required`` raises. Closing
    it leaves the memory under the arrays it handed out theirs until the last of them goes (``OutputMapper``)."""
    try:
        from diffusiond.client.zerocopy import OutputMapper, ZeroCopyUnavailable
    except ImportError as exc:  # an install without the module: HTTP is the only path
        if required:
            raise ClientError(f"zero-copy outputs are not available here: {exc}") from exc
        return None
    try:
        wait = min(timeout or 30.0, 30.0)  # the client's own timeout
        return await asyncio.to_thread(OutputMapper, socket_path, timeout=wait)
    except ZeroCopyUnavailable:
        if required:
            raise
        return None


def torch_views(arrays: dict[str, NDArray[Any]], dtypes: dict[str, str]) -> dict[str, Any]:
    """CPU tensors over the same memory as ``arrays`` (no copy); raw uint16 words of a ``bfloat16``
    array become torch.bfloat16. torch is imported only here, for callers that ask for tensors."""
    import warnings

    import torch

    views = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that read-only memory is not writable
        for name, a in arrays.items():
            t = torch.from_numpy(a)
            views[name] = t.view(torch.bfloat16) if dtypes.get(name) == "bfloat16" else t
    return views
