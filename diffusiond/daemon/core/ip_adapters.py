"""IP-Adapters: the ones this daemon serves, and a request's reference images from bytes to a sealed buffer.

An IP-Adapter steers a model by a reference picture: its image encoder (CLIP vision) turns the
picture into a few extra tokens that a second, small cross-attention in every UNet block (every
double-stream block of a FLUX transformer) reads beside the prompt's. One is registered by name
(``serve --ip-adapter NAME=PATH[,image_encoder=DIR]``, TOML ``[ip_adapters]``): the weights file
(diffusers' ``load_ip_adapter`` format, or XLabs' for FLUX) and its encoder's folder. The
configuration only checks that both are there (``values.check_ip_adapter``); each worker reads them
at start and reports those that do not fit its model (``Model.ip_adapter_errors``), so admission
refuses such pairs with a 400 naming the field.

A reference image is decoded like an edit image (``images.open_image``: the same formats, the same
pixel bound, every decoder failure a 400 naming the field), in the encode pool, never on the event
loop. It keeps its own size: its adapter's CLIP image processor resizes and crops it for that
adapter's encoder, as diffusers does for ``ip_adapter_image``. Its digest joins the batch key (so requests
with different references never share a forward) and is what history and output metadata show.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from diffusiond.daemon.config import Limits
from diffusiond.daemon.core import images
from diffusiond.daemon.core.controls import resolve_names
from diffusiond.daemon.core.inputs import Source, _bytes_of
from diffusiond.ipc.inputs import InputBuffer
from diffusiond.ipc.messages import IpAdapterRef

# Several act at once, each with its own picture (the worker encodes each with its own adapter's
# encoder); past a few, each only dilutes the others and adds an attention per block.
MAX_IP_ADAPTERS = 4
MAX_SCALE = 4.0  # past the usual 0-1.5, the reference only burns the picture


class ModelIpAdapters(Protocol):
    @property
    def name(self) -> str: ...

    ip_adapter_errors: dict[str, str]


class IpAdapterRegistry:
    """The IP-Adapters this daemon serves, by name (fixed at start): name -> (weights, image encoder)."""

    def __init__(self, paths: Mapping[str, tuple[str, str]]) -> None:
        self.paths = dict(paths)

    def resolve(self, model: ModelIpAdapters, names: Sequence[str]) -> None:
        """Admission: each named IP-Adapter is served and fits ``model``."""
        resolve_names(names, self.paths, model.ip_adapter_errors, model.name, "IP-Adapter", "--ip-adapter",
                      "ip_adapter")


@dataclass(frozen=True)
class IpAdapterEntry:
    """One checked entry of a request's ``ip_adapter`` (the image itself is not kept past decoding)."""

    name: str
    source: Source
    scale: float = 1.0


@dataclass
class IpAdapterInput:
    """A request's decoded reference images in a sealed buffer; the job owns it (the engine closes it)."""

    refs: tuple[IpAdapterRef, ...]
    buffer: InputBuffer

    def close(self) -> None:
        self.buffer.close()


def decode_references(entries: Sequence[IpAdapterEntry], *, limits: Limits, input_dir: str | None,
                      joined: InputBuffer | None = None) -> IpAdapterInput:
    """Decode and check each reference image (in the encode pool); digest what the worker will see.

    ``joined`` is the job's input so far (an edit's image and mask, or its control images): a job's
    input travels as one buffer, so the new one holds those arrays too and the job sends it instead."""
    pictures: list[np.ndarray] = []
    refs: list[IpAdapterRef] = []
    for e in entries:
        img = images.open_image(_bytes_of(e.source, limits, input_dir), e.source.field, limits)
        try:
            rgb = np.ascontiguousarray(images.rgb_array(img, e.source.field), dtype=np.uint8)
        finally:
            img.close()
        h = hashlib.blake2b(rgb.tobytes(), digest_size=12)
        h.update(repr(rgb.shape).encode())  # the same bytes in another shape are another picture
        pictures.append(rgb)
        refs.append(IpAdapterRef(e.name, e.scale, h.hexdigest()))
    if joined is not None:
        return IpAdapterInput(refs=tuple(refs), buffer=joined.with_references(pictures))
    return IpAdapterInput(refs=tuple(refs), buffer=InputBuffer(None, None, references=pictures,
                                                               name="diffusiond-reference"))
