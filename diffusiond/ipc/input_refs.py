"""Where a request's input pixels lie in the sealed memfd that comes with its EXECUTE frame (``inputs.py``).

Apart from ``messages.py`` (which names it in ``RequestSpec``) so that the frame module stays a list of frames.
"""

from __future__ import annotations

import msgspec

from diffusiond.ipc.tensors import TensorDesc


class InputRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's input image (and mask) lie: in file descriptor ``fd`` (an index into the
    fds that came with the EXECUTE frame), a sealed memfd written by the engine. The frame carries
    only these descriptors; the pixels never travel in a frame."""

    fd: int
    image: TensorDesc | None = None  # uint8 (H, W, 3); None: a request with control images only
    mask: TensorDesc | None = None  # uint8 (H, W, 1): 255 where the image is repainted
    controls: tuple[TensorDesc, ...] = ()  # uint8 (H, W, 3) each, one per BatchParams.controls entry
    references: tuple[TensorDesc, ...] = ()  # uint8 (h, w, 3), one per BatchParams.ip_adapters entry
    # uint8 (h, w, 3) each, at its own size: an edit's input pictures before ``image`` ("Picture 1", ...), where
    # the model takes several (Qwen-Image-Edit Plus, issue 30); ``image`` is the last
    pictures: tuple[TensorDesc, ...] = ()
