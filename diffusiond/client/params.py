"""What a job asks for, as the Python client takes it: the typed parameters of ``generate`` and
``submit``, and how they become a jobs API body (docs/api.md)."""

from __future__ import annotations

import base64
import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict, cast

from diffusiond.client.errors import DaemonError
from diffusiond.protocol import OutputDtype

Output = Literal["pil", "array", "bytes"]
"""How ``generate`` and ``outputs`` hand outputs over: PIL images, numpy arrays, encoded bytes."""


class JobParams(TypedDict, total=False):
    """The job fields of docs/api.md, as ``generate`` and ``submit`` take them; left out means the
    daemon's default for the model. ``size`` is ``(width, height)`` or ``"WxH"``."""

    n: int
    size: tuple[int, int] | str
    steps: int
    guidance_scale: float
    negative_prompt: str
    seed: int
    output_format: str
    output_dtype: OutputDtype
    num_frames: int
    fps: int
    scheduler: str
    noise_level: float  # flow-sde's noise (0 < a <= 2, default 0.7)
    eta: float  # ddim's noise (0 to 1, default 0)
    # each output's latents at every step and the steps' log-probs (flow-sde, or ddim with eta > 0):
    # {"latents": True, "log_probs": True, "dtype": "float32"|"bfloat16"|"float16"}; read with trajectory(k)
    trajectory: Mapping[str, Any]
    audio: bool  # the model's sound track (LTX-2; its default there): False leaves it out; read with audio(k)
    timeout_s: float
    model: str
    preview: dict[str, Any]  # {"every": N, "format": "jpeg"|"webp"|"png", "max_side": 256}: preview events
    # LoRA name -> weight (GET /v1/loras), or (name, weight) pairs, or {"name", "weight"} entries as in the HTTP API
    loras: Mapping[str, float] | Sequence[tuple[str, float] | Mapping[str, Any]]
    # edits: the input image (and mask) as the file's bytes or a local file's path (sent base64), base64 or a
    # data: URL (sent as they are), or a path the daemon reads itself under its --input-dir (image_path, mask_path)
    image: ImageInput
    mask: ImageInput
    image_path: str
    mask_path: str
    strength: float
    # several input pictures for one edit (a model whose GET /v1/models entry has max_input_images > 1, as
    # Qwen-Image-Edit Plus): "Picture 1", "Picture 2", ... in order, the last setting the output size; each as
    # ``image`` takes it, or {"image_path": ...} (read by the daemon under its --input-dir)
    images: Sequence[ImageInput | Mapping[str, str]]
    # ControlNets (GET /v1/controlnets): {"name", "image" (as ``image`` takes it) or "image_path",
    # "scale", "start", "end", "preprocess", "mode" (a union ControlNet's mode: its number, or its name where
    # GET /v1/controlnets lists names)}, one dict each
    control: Sequence[Mapping[str, Any]]
    # IP-Adapters (GET /v1/ip-adapters): {"name", "image" (as ``image`` takes it) or "image_path",
    # "scale"}, one dict each, up to 4 acting together (the same adapter twice with two pictures too)
    ip_adapter: Sequence[Mapping[str, Any]]
    # every output through an upscaler (GET /v1/upscalers): its name, or {"name", "scale"} (the model's own scale
    # when left out); a second, image-to-image pass at a larger size first: a scale, or {"scale", "strength",
    # "steps", "upscaler"}
    upscale: str | Mapping[str, Any]
    hires: float | Mapping[str, Any]
    # how long the model stays on its device after this job: "10m", "1h30m", seconds, 0 (leave at once),
    # -1 (forever); capped by the daemon's --max-keep-alive
    keep_alive: str | float


ImageInput = bytes | str | os.PathLike[str]
"""An edit's image or mask (or a control or reference picture): the encoded file (PNG, JPEG, WebP) as
bytes, a local file to read, or, as a ``str``, what the API itself takes: base64 or a ``data:`` URL."""


def job_body(prompt: str, params: JobParams) -> dict[str, Any]:
    """The POST /v1/jobs body: only what was given, so the daemon's defaults stay in charge."""
    body: dict[str, Any] = {"prompt": prompt}
    for key, value in params.items():
        if key not in JobParams.__annotations__:
            raise TypeError(f"unknown job parameter {key!r}")
        check_finite(value, key)
        if value is None:
            continue
        if key == "size":
            body["width"], body["height"] = _size(value)
        elif key == "loras":
            body["loras"] = _loras(value)
        elif key == "trajectory":
            body[key] = dict(cast(Mapping[str, Any], value))
        elif key in ("image", "mask"):
            body[key] = image_text(cast(ImageInput, value), key)
        elif key == "images":
            body[key] = [{k: image_text(v, f"images[{i}]") if k == "image" else v for k, v in dict(p).items()}
                         if isinstance(p, Mapping) else image_text(p, f"images[{i}]")
                         for i, p in enumerate(cast(Sequence[Any], value))]
        elif key in ("control", "ip_adapter"):
            body[key] = [{k: image_text(v, f"{key}[{i}].image") if k == "image" else v for k, v in dict(c).items()}
                         for i, c in enumerate(cast(Sequence[Mapping[str, Any]], value))]
        elif key in ("upscale", "hires"):
            short = "name" if key == "upscale" else "scale"
            body[key] = dict(cast(Mapping[str, Any], value)) if isinstance(value, Mapping) else {short: value}
        else:
            body[key] = value
    return body


def _loras(value: Any) -> list[dict[str, Any]]:
    """``loras`` as the daemon takes it, from any of the forms a caller writes: {name: weight}, (name, weight)
    pairs, or the HTTP API's own {"name": ..., "weight": ...} entries (sent as they are, for the daemon to check
    each key). Anything else is a ValueError naming the entry, not a failed float() of some part of it."""
    entries: Any = value.items() if isinstance(value, Mapping) else value
    loras = []
    for i, entry in enumerate(entries):
        if isinstance(entry, Mapping):
            loras.append(dict(entry))
            continue
        try:
            name, weight = entry
            loras.append({"name": str(name), "weight": float(weight)})
        except (TypeError, ValueError):
            raise ValueError(f"loras[{i}] is {entry!r}; give loras as {{name: weight}}, as (name, weight) pairs, "
                             "or as {'name': name, 'weight': weight} entries") from None
    return loras


def check_finite(value: Any, where: str) -> None:
    """A ValueError naming ``where`` (``guidance_scale``, ``loras[0].weight``) for a NaN or an infinity inside
    ``value``. JSON has no words for them: Python's encoder writes ``NaN``, which the daemon refuses as a body
    that is not JSON at all, naming no field."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where or 'a parameter'} must be a finite number, got {value!r}")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_finite(v, f"{where}[{i}]")


def image_b64(value: ImageInput) -> str:
    """An edit's image or mask for a JSON body: the file's bytes, base64-encoded."""
    data = value if isinstance(value, bytes) else Path(value).read_bytes()
    return base64.b64encode(data).decode("ascii")


_BASE64 = re.compile(r"[A-Za-z0-9+/]{16,}={0,2}")
"""Base64 of more than a few bytes, in the alphabet the daemon decodes: no file name a person types,
with its dot and extension, looks like it."""


def image_text(value: ImageInput, field: str) -> str:
    """A picture for a JSON body, as the client takes it (``ImageInput``): a ``str`` that is a ``data:``
    URL, or base64 that names no file, goes as it is, since the API takes both; anything else is a file.
    A ``str`` that is none of the three is a ValueError naming ``field``, not the file system's error."""
    if isinstance(value, str):
        if value.startswith("data:"):
            return value
        if not os.path.exists(value):
            if _BASE64.fullmatch(value):
                return value
            raise ValueError(f"{field}: {value[:60]!r} is no file, nor base64 or a data: URL; "
                             "pass bytes, a path or a data URL")
    return image_b64(value)


def parse_size(text: str) -> tuple[int, int]:
    """``WxH`` -> (width, height): the client's ``size`` as text, and the command line's ``--size``."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.strip().isdecimal() or not h.strip().isdecimal() or int(w) <= 0 or int(h) <= 0:
        raise ValueError(f"expected WxH with positive integers, e.g. 512x512, got {text!r}")
    return int(w), int(h)


def _size(size: Any) -> tuple[int, int]:
    if isinstance(size, str):
        try:
            return parse_size(size)
        except ValueError as exc:
            raise ValueError(f"size: {exc} (or a (width, height) pair)") from None
    width, height = size
    return int(width), int(height)


@contextlib.contextmanager
def pil_needs_a_format(output: Output, asked: JobParams) -> Iterator[None]:
    """``output="pil"`` asks for PNG where no ``output_format`` is given, which a video model refuses (a 400 on
    ``output_format``, before any job exists): a ValueError that says what to pass, rather than a DaemonError
    about a PNG the caller never asked for."""
    try:
        yield
    except DaemonError as exc:
        if output != "pil" or asked.get("output_format") is not None or exc.field != "output_format":
            raise
        model = asked.get("model")
        raise ValueError(f"output='pil' asks for PNG, which {f'model {model!r}' if model else 'the default model'} "
                         f"does not make ({exc.message}): pass output_format='gif' or 'webp' (an animated picture, "
                         "each frame reached with seek()), or output='array' for the frames") from None


def params_for(output: Output, params: JobParams) -> JobParams:
    """The format that makes ``output`` cheap: PNG (lossless) for images, ``npy`` for arrays."""
    fmt = params.get("output_format")
    if output == "array":
        if fmt not in (None, "npy"):
            raise ValueError(f"output='array' comes from npy outputs, not {fmt!r}")
        return {**params, "output_format": "npy"}
    if output == "pil":
        return {**params, "output_format": fmt or "png"}
    if output != "bytes":
        raise ValueError(f"output must be 'pil', 'array' or 'bytes', not {output!r}")
    return params
