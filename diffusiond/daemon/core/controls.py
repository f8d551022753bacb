"""ControlNets: the ones this daemon serves, and a request's control images from bytes to a sealed buffer.

A ControlNet is registered by name (``serve --controlnet NAME=PATH[,modes=A:B:...]``, TOML
``[controlnets]``): a diffusers folder (``save_pretrained``'s) or a single ``.safetensors`` checkpoint.
The configuration only checks that the path is there, that a single file is no union ControlNet (by
its header's tensor names: diffusers reads those from folders only) and that a union one's mode names
match its config (``values.check_controlnet``, ``values.check_mode_names``); each worker loads every one once
at start, keeps it, and reports those that do not fit its model (``Model.controlnet_errors``), so
admission refuses such pairs with a 400 naming the field.

A request's control images are decoded like edit images (``images.open_image``: the same
formats, the same pixel bound, every decoder failure a 400 naming the field), resized to the
output size and, for ``preprocess: canny``, turned into an edge map with OpenCV; all of it in the
encode pool, never on the event loop. Each picture's digest joins the batch key, so requests
with different control images never share a forward.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from diffusiond.daemon.config import Limits
from diffusiond.daemon.core import images
from diffusiond.daemon.core.inputs import Source, _bytes_of
from diffusiond.daemon.errors import InvalidRequest, Unavailable
from diffusiond.daemon.values import ControlNetSetting, control_modes, controlnet_config
from diffusiond.ipc.inputs import InputBuffer, read_inputs, read_pictures
from diffusiond.ipc.messages import ControlRef

MAX_CONTROLS = 4  # ControlNets in one request: each one is a second denoiser-sized forward per step
PREPROCESS = ("none", "canny")
CANNY_LOW, CANNY_HIGH = 100, 200  # diffusers' and A1111's defaults for canny ControlNets


class ModelControls(Protocol):
    @property
    def name(self) -> str: ...

    controlnet_errors: dict[str, str]


class ControlRegistry:
    """The ControlNets this daemon serves, by name (fixed at start)."""

    def __init__(self, settings: Mapping[str, ControlNetSetting]) -> None:
        self.paths = {name: s.path for name, s in settings.items()}
        self.modes = {name: control_modes(path) for name, path in self.paths.items()}
        # a union ControlNet's mode names, in mode order (serve's modes=; checked against its config at start)
        self.mode_names = {name: s.modes for name, s in settings.items() if s.modes}
        self.classes = {name: control_class(path) for name, path in self.paths.items()}

    def resolve(self, model: ModelControls, names: Sequence[str]) -> None:
        """Admission: each named ControlNet is served and fits ``model``."""
        resolve_names(names, self.paths, model.controlnet_errors, model.name, "ControlNet", "--controlnet", "control")


def resolve_names(names: Sequence[str], served: Mapping[str, object], errors: Mapping[str, str], model: str,
                  what: str, flag: str, field: str) -> None:
    """Admission of a request's add-ons by name (ControlNets, IP-Adapters): each is served and fits the model.
    A name echoed back is cut at 64 characters: the request chose its length, and the error went to the log."""
    for i, name in enumerate(names):
        if name not in served:
            known = ", ".join(sorted(served)) or f"none are served (serve {flag} NAME=PATH)"
            raise InvalidRequest(f"no {what} named {name[:64]!r}; known: {known}", field=f"{field}[{i}].name")
        why = errors.get(name)
        if why is not None:
            raise InvalidRequest(f"{what} {name!r} does not fit model {model!r}: {why}", field=f"{field}[{i}].name")


def control_class(path: str) -> str:
    """The diffusers class a ControlNet folder names ("" when unknown)."""
    named = controlnet_config(path).get("_class_name")
    return named if isinstance(named, str) else ""


@dataclass(frozen=True)
class ControlEntry:
    """One checked entry of a request's ``control`` (what history shows of it; the image is not kept)."""

    name: str
    source: Source
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    preprocess: str = "none"
    mode: int | None = None  # a union ControlNet's control mode
    mode_name: str | None = None  # the mode as the request named it, until admission finds its number


@dataclass
class ControlInput:
    """A request's decoded control images in a sealed buffer (with an edit's image and mask first, when
    it has them); the job owns it (the engine closes it)."""

    entries: tuple[ControlEntry, ...]
    refs: tuple[ControlRef, ...]
    buffer: InputBuffer

    def close(self) -> None:
        self.buffer.close()


def cv2_missing() -> bool:
    """OpenCV (the ``control`` extra) is needed for ``preprocess: canny`` only."""
    return importlib.util.find_spec("cv2") is None


def canny_unavailable(field: str) -> Unavailable:
    return Unavailable(f"{field}: preprocess 'canny' needs OpenCV, which this daemon's Python lacks; "
                       "install diffusiond[control] (opencv-python-headless), or send an edge map with "
                       "preprocess 'none'", field=field)


def _canny(rgb: np.ndarray) -> np.ndarray:
    import cv2

    edges = cv2.Canny(np.ascontiguousarray(rgb), CANNY_LOW, CANNY_HIGH)
    return np.repeat(edges[..., None], 3, axis=2)


def decode_controls(entries: Sequence[ControlEntry], *, width: int, height: int, limits: Limits,
                    input_dir: str | None, joined: InputBuffer | None = None) -> ControlInput:
    """Decode, check, resize (to the output's size) and preprocess each control image (in the encode pool).

    ``joined`` is an edit's input (its image and mask): a job's input travels as one buffer, so the
    new one holds those arrays first, read back from the sealed memfd (what admission validated)."""
    from PIL import Image

    pictures: list[np.ndarray] = []
    refs: list[ControlRef] = []
    for e in entries:
        field = e.source.field
        img = images.open_image(_bytes_of(e.source, limits, input_dir), field, limits)
        try:
            rgb = images.rgb_array(img, field)
        finally:
            img.close()
        if rgb.shape[:2] != (height, width):
            rgb = np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.LANCZOS))
        if e.preprocess == "canny":
            try:
                rgb = _canny(rgb)
            except ImportError:
                raise canny_unavailable(field.rpartition(".")[0] + ".preprocess") from None
        rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
        digest = hashlib.blake2b(rgb.tobytes(), digest_size=12).hexdigest()
        pictures.append(rgb)
        refs.append(ControlRef(e.name, e.scale, e.start, e.end, digest, e.mode))
    if joined is None:
        buffer = InputBuffer(None, None, controls=pictures, name="diffusiond-control")
    else:
        image, mask = read_inputs([joined.fd], joined.ref(0))
        earlier = read_pictures([joined.fd], joined.ref(0))  # a several-picture edit's
        buffer = InputBuffer(image, mask, controls=pictures, pictures=earlier, name=joined.name)
    return ControlInput(entries=tuple(entries), refs=tuple(refs), buffer=buffer)

