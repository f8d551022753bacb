"""Request validation: JSON bodies -> ``JobRequest``, or an ``InvalidRequest`` that names the field.

Bodies are decoded by msgspec into typed structs (unknown fields in the jobs API are refused, so
a typo never silently falls back to a default), then checked against the limits of docs/api.md and
the model's ``Capabilities``, so a value that cannot run is refused at admission instead of
failing a job in the worker. OpenAI's Images bodies are read in ``forms.py`` and checked here too.

The closed sets checked here (formats, dtypes, scheduler names) come from ``protocol.py``, not
from the encoders or the pipelines, so admission loads neither Pillow/PyAV nor torch. The errors
carry no HTTP status: ``status.py`` maps them (``errors.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast

import msgspec

from diffusiond.daemon.config import Limits
from diffusiond.daemon.core.inputs import EditInput
from diffusiond.daemon.core.jobs import JobRequest, PreviewSpec
from diffusiond.daemon.edge.audio import check_audio
from diffusiond.daemon.edge.controls import ControlBody
from diffusiond.daemon.edge.ip_adapters import IpAdapterBody
from diffusiond.daemon.edge.pictures import PictureBody
from diffusiond.daemon.edge.sizes import ModelLike, check_side, check_steps
from diffusiond.daemon.edge.trajectory import TrajectoryBody, check_trajectory
from diffusiond.daemon.edge.upscale import HiresBody, UpscaleBody
from diffusiond.daemon.errors import MAX_INT_DIGITS, OutputTooLarge, invalid, shown
from diffusiond.daemon.residency.units import parse_duration
from diffusiond.ipc.tensors import itemsize
from diffusiond.protocol import (
    EDIT_TASKS,
    ETA_MAX,
    IMAGE_FORMATS,
    NOISE_LEVEL_MAX,
    OUTPUT_DTYPES,
    PREVIEW_FORMATS,
    SCHEDULERS,
    VIDEO_FORMATS,
    VIDEO_TASKS,
    ErrorCode,
    OutputDtype,
    Task,
    frame_count_neighbours,
    schedulers_for,
)

ModelResolver = Callable[[str | None], ModelLike]
"""The model a request names (None: the default one); raises ModelNotFound for an unknown name."""

T = TypeVar("T")
MIN_PREVIEW_SIDE, MAX_PREVIEW_SIDE = 16, 1024  # previews are glimpses; the output is the full picture
# the path msgspec names, entries' indices kept: `$.images[0]` is images[0], not images
FIELD_PATH = re.compile(r"`\$\.?([A-Za-z_](?:[\w.]|\[\d+\])*)")
MISSING_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]+)`")  # msgspec's wording
UNKNOWN_TOP = re.compile(r"^Object contains unknown field `([^`]+)`$")  # one at the body's top level
# The jobs API and the OpenAI-style endpoints spell the step count each its own way (one spelling per endpoint is
# the contract), and the CLI's flags differ again: a body in the other spelling is told this endpoint's.
OTHER_SPELLINGS = {"steps": "num_inference_steps", "num_inference_steps": "steps", "guidance": "guidance_scale",
                   "negative": "negative_prompt"}


class PreviewBody(msgspec.Struct, forbid_unknown_fields=True):
    every: int = 1
    format: str = "jpeg"
    max_side: int = 256


class LoraBody(msgspec.Struct, forbid_unknown_fields=True):
    """One entry of ``loras``: a registered adapter and its weight."""

    name: str
    weight: float = 1.0


LoraCheck = Callable[[str, list[tuple[str, float]]], None]
"""Admission of a request's adapters against the registry (unknown name, does not fit the model,
too many): ``Engine.check_loras``."""


class JobBody(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str
    model: str | None = None
    n: int = 1
    width: int | None = None
    height: int | None = None
    size: str | None = None  # "512x512", as /v1/images/generations takes it; or width and height
    steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    output_format: str | None = None
    output_dtype: str = "uint8"
    num_frames: int | None = None
    fps: int | None = None
    timeout_s: float | None = None
    scheduler: str | None = None
    noise_level: float | None = None  # flow-sde's noise (issue 29)
    eta: float | None = None  # ddim's noise
    preview: PreviewBody | None = None
    loras: list[LoraBody] | None = None
    trajectory: TrajectoryBody | None = None
    audio: bool | None = None  # the model's sound track (daemon/edge/audio.py); None: when it makes one
    # edits: the input image as base64 (or a data URL), or a path under --input-dir; same for the mask
    image: str | None = None
    image_path: str | None = None
    mask: str | None = None
    mask_path: str | None = None
    strength: float | None = None
    images: list[str | PictureBody] | None = None  # several input pictures for one edit (daemon/edge/pictures.py)
    control: list[ControlBody] | None = None  # ControlNets and their images (daemon/edge/controls.py)
    ip_adapter: list[IpAdapterBody] | None = None  # IP-Adapters and their reference images (edge/ip_adapters.py)
    upscale: UpscaleBody | None = None  # post-processing and a second pass (daemon/edge/upscale.py)
    hires: HiresBody | None = None
    # how long the model stays on its device after this job: "10m", seconds, 0, -1 (as Ollama's field)
    keep_alive: str | float | None = None


class AddLoraBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/loras``: register the adapter at ``path`` (a folder or a .safetensors file) as ``name``."""

    name: str
    path: str




def decode(body: bytes, cls: type[T]) -> T:
    """A JSON body as ``cls``, or a 400: not JSON, nested too deep for msgspec (``RecursionError``,
    even inside a field that is ignored), a field of the wrong type, or an integer so large that
    no field's range can hold it (refused here, by its length, before a range check formats it)."""
    if not body.strip():
        raise invalid("request body is empty; send a JSON object", code=ErrorCode.INVALID_JSON)
    try:
        decoded = msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as exc:
        raise refused(exc, cls) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}", code=ErrorCode.INVALID_JSON) from None
    except RecursionError:
        raise invalid("request body is nested too deeply (over about 1,000 levels of lists or objects); "
                      "no field of this API nests more than 3", code=ErrorCode.INVALID_JSON) from None
    if isinstance(decoded, msgspec.Struct):
        check_int_sizes(decoded)
    return decoded


def refused(exc: msgspec.ValidationError, cls: type) -> Exception:
    """The 400 for a body ``cls`` does not take, naming the field; a field this endpoint spells otherwise
    (``steps`` on /v1/images/generations) is told the spelling it takes rather than only "unknown"."""
    unknown = UNKNOWN_TOP.match(str(exc))
    right = OTHER_SPELLINGS.get(unknown.group(1), "") if unknown else ""
    if unknown and right in getattr(cls, "__struct_fields__", ()):
        return invalid(f"unknown field {unknown.group(1)!r}: this endpoint takes {right}", field=unknown.group(1))
    m = FIELD_PATH.search(str(exc)) or MISSING_FIELD.search(str(exc))
    return invalid(f"invalid request: {exc}", field=m.group(1) if m else None)


def check_int_sizes(struct: msgspec.Struct) -> None:
    """Refuse an integer field of more than ``MAX_INT_DIGITS`` digits: msgspec takes any size, and
    formatting one of over 308 digits as a float (a range message's ``:g``) overflows. Only the
    fields typed int: OpenAI's ignored fields stay ignored, whatever they hold."""
    hints = type(struct).__annotations__
    for name, value in msgspec.structs.asdict(struct).items():
        if "int" not in str(hints.get(name, "")):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 66:
            raise invalid(f"{name} is a number of over {MAX_INT_DIGITS} digits; see docs/api.md for its range",
                          field=name)


def _range(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise invalid(f"{name} must be between {lo:g} and {hi:g}, got {shown(value)}", field=name)


def check_lora_list(entries: list[Any] | None, limits: Limits) -> tuple[tuple[str, float], ...]:
    """The shape of ``loras``: names not repeated, weights in range; sorted by name, so the same set
    in any order is one batch key and one sum (adapter order changes float rounding)."""
    if not entries:
        return ()
    pairs = [(e["name"], e["weight"]) if isinstance(e, dict) else (e.name, e.weight) for e in entries]
    top = limits.max_lora_weight
    seen: set[str] = set()
    for name, weight in pairs:
        if name in seen:
            raise invalid(f"LoRA {name!r} is named twice in loras; give each adapter once", field="loras")
        seen.add(name)
        if not -top <= weight <= top:
            raise invalid(f"the weight of LoRA {name!r} must be between {-top:g} and {top:g}, got {weight:g}",
                          field="loras")
    return tuple(sorted(pairs))


def check(
    req: dict[str, Any], limits: Limits, model: ModelLike, *, size_field: str | None = None,
    loras: LoraCheck | None = None,
    edit: EditInput | None = None,
) -> JobRequest:
    """Apply limits and the model's defaults; ``req`` is a decoded body as a dict, so both
    endpoints share one set of checks (``size_field`` names the field the user actually sent).
    ``edit`` is the decoded input of an edit (``edits.plan_edit``, then ``bodies.decode_edit``): its size is the
    output's size."""
    size_field = size_field or req.get("size_field")
    if edit is None and req.get("strength") is not None:
        raise invalid("strength applies only to edits: send an image with it", field="strength")
    if edit is not None:
        req = {**req, "width": edit.width, "height": edit.height}
    elif model.capabilities.task in EDIT_TASKS:
        mask = " and a mask (mask; --mask FILE)" if model.capabilities.task == Task.INPAINTING.value else ""
        top = model.capabilities.max_input_images
        several = (f", or up to {top} pictures for one edit (images on /v1/jobs, several image[] on /v1/images/edits, "
                   "--image repeated on the CLI)") if top > 1 else ""
        raise invalid(f"model {model.name!r} does {model.capabilities.task} only: send an image (image on /v1/jobs, "
                      f"/v1/images/edits; --image FILE on the CLI){mask}{several}", field="image")
    prompt = req["prompt"]
    if not prompt.strip():
        raise invalid("prompt must not be empty", field="prompt")
    if len(prompt) > limits.max_prompt_chars:
        raise invalid(
            f"prompt is {len(prompt)} characters; the limit is {limits.max_prompt_chars}", field="prompt"
        )
    neg = req.get("negative_prompt")
    if neg is not None and len(neg) > limits.max_prompt_chars:
        raise invalid(f"negative_prompt is over {limits.max_prompt_chars} characters", field="negative_prompt")
    if neg and neg.strip() and not model.capabilities.negative_prompt:  # it would be recorded as if it had acted
        raise invalid(f"model {model.name!r} has no negative prompt (a guidance-distilled model such as FLUX "
                      "ignores one); leave negative_prompt out (--negative on the CLI)", field="negative_prompt")
    _range("n", req["n"], 1, limits.max_n)
    d = model.capabilities
    # ``is None``, not ``or``: an explicit 0 is out of range, not a request for the default
    width = d.width if req.get("width") is None else req["width"]
    height = d.height if req.get("height") is None else req["height"]
    check_side("width", width, limits, size_field, model)
    check_side("height", height, limits, size_field, model)
    steps = d.steps if req.get("steps") is None else req["steps"]
    check_steps(req.get("steps_field", "steps"), steps, model, limits.max_steps)
    guidance = req.get("guidance_scale")
    guidance = d.guidance if guidance is None else guidance
    _range("guidance_scale", guidance, 0, 100)
    seed = req.get("seed")
    top = 2**63 - req["n"]  # output k gets seed + k, and each must fit a torch.Generator seed
    if seed is not None and not 0 <= seed <= top:
        raise invalid(f"seed must be between 0 and {top} (2**63 - n), got {shown(seed)}", field="seed")
    video = d.task in VIDEO_TASKS
    if edit is not None and steps * edit.strength < 1:
        raise invalid(
            f"strength {edit.strength:g} x {steps} steps runs no denoising step; raise strength to at least "
            f"{1 / steps:.3g} or the steps to at least {int(1 / edit.strength) + 1}", field="strength")
    frames = req.get("num_frames")
    if frames is not None and not video:
        raise invalid(
            f"num_frames is only for text-to-video models; {model.name!r} is {d.task}", field="num_frames"
        )
    if video:
        frames = d.num_frames if frames is None else frames
        _range("num_frames", frames, 1, limits.max_frames)
        step = d.num_frames_step  # e.g. LTX makes 8k+1 frames, Wan 4k+1
        nearest = frame_count_neighbours(frames, step)
        if nearest is not None:
            lower, upper = nearest
            raise invalid(
                f"num_frames must be {step}k+1 for {model.name!r}; use {lower} or {upper}, got {frames}",
                field="num_frames",
            )
    fps = req.get("fps")
    if fps is not None and not video:
        raise invalid(f"fps is only for text-to-video models; {model.name!r} is {d.task}", field="fps")
    _range("fps", fps, 1, 240)
    fps = fps or d.fps
    fmt = req.get("output_format") or ("mp4" if video else "png")
    allowed = VIDEO_FORMATS if video else IMAGE_FORMATS
    if fmt not in allowed:
        raise invalid(
            f"output_format {fmt!r} is not available for {d.task}; use one of {', '.join(sorted(allowed))}",
            field="output_format",
        )
    dtype = req.get("output_dtype", "uint8")
    if dtype not in OUTPUT_DTYPES:
        raise invalid(f"output_dtype must be one of {', '.join(OUTPUT_DTYPES)}", field="output_dtype")
    if dtype != "uint8" and fmt != "npy":
        raise invalid("raw float output (output_dtype) needs output_format 'npy'", field="output_dtype")
    timeout = req.get("timeout_s")
    if timeout is not None:
        _range("timeout_s", timeout, 0.001, limits.max_timeout_s)
    scheduler = req.get("scheduler")
    if scheduler is not None:
        if scheduler not in SCHEDULERS:
            raise invalid(f"scheduler {scheduler!r} is not one of {', '.join(SCHEDULERS)}", field="scheduler")
        flow = d.flow_scheduler  # set by models that have schedulers; the others ignore the field
        if flow is not None and scheduler not in schedulers_for(flow):
            raise invalid(
                f"scheduler {scheduler!r} does not fit {model.name!r} (a "
                f"{'flow-matching' if flow else 'noise-prediction'} model); use one of "
                f"{', '.join(schedulers_for(flow))}",
                field="scheduler",
            )
    noise_level, eta = _noise(req, scheduler)
    trajectory = check_trajectory(req.get("trajectory"), scheduler, eta,
                                  inpainting=edit is not None and edit.task is Task.INPAINTING)
    preview = _preview(req.get("preview"), model, steps)
    lora_pairs = check_lora_list(req.get("loras"), limits)
    if lora_pairs:
        if loras is None:
            raise invalid("this daemon takes no LoRA adapters", field="loras")
        loras(model.name, list(lora_pairs))
    elem = itemsize(dtype)
    out_bytes = req["n"] * (frames or 1) * width * height * 3 * elem
    if out_bytes > limits.max_output_bytes:
        raise OutputTooLarge(
            f"the job would produce {out_bytes / 2**30:.1f} GiB of output (n x frames x width x height x "
            f"3 x {elem} bytes); the limit is {limits.max_output_bytes / 2**30:.1f} GiB: ask for fewer "
            "or smaller outputs", field="n" if req["n"] > 1 else ("num_frames" if frames else "width"))
    return JobRequest(
        model=model.name,
        prompt=prompt,
        n=req["n"],
        width=width,
        height=height,
        steps=steps,
        guidance=guidance,
        output_format=fmt,
        seed=seed,
        negative_prompt=neg,
        num_frames=frames,
        fps=fps, fps_conditions=model.capabilities.fps_conditions,
        timeout_s=timeout,
        output_dtype=cast(OutputDtype, dtype),  # checked above against OUTPUT_DTYPES
        scheduler=scheduler,
        noise_level=noise_level,
        eta=eta,
        preview=preview,
        trajectory=trajectory,
        audio_rate=check_audio(req.get("audio"), model),
        loras=lora_pairs,
        edit=edit,
        keep_alive_s=_keep_alive(req.get("keep_alive")),
    )


def _noise(req: dict[str, Any], scheduler: str | None) -> tuple[float | None, float | None]:
    """The stochastic samplers' noise: ``noise_level`` belongs to ``flow-sde`` and ``eta`` to ``ddim``;
    sent with another scheduler it would be silently ignored, so it is a 400 naming it. ``eta`` 0 is
    plain DDIM, so it is kept as None (such requests batch with those that leave it out)."""
    level, eta = req.get("noise_level"), req.get("eta")
    if level is not None:
        if scheduler != "flow-sde":
            raise invalid(f"noise_level applies only to scheduler 'flow-sde', not {_named(scheduler)}",
                          field="noise_level")
        if not 0 < level <= NOISE_LEVEL_MAX:
            raise invalid(f"noise_level must be above 0 and at most {NOISE_LEVEL_MAX:g}, got {shown(level)}",
                          field="noise_level")
    if eta is not None:
        if scheduler != "ddim":
            raise invalid(f"eta applies only to scheduler 'ddim', not {_named(scheduler)}", field="eta")
        _range("eta", eta, 0, ETA_MAX)
    return (None if level is None else float(level)), (float(eta) if eta else None)


def _named(scheduler: str | None) -> str:
    return "the model's default (send scheduler)" if scheduler is None else repr(scheduler)


def _keep_alive(value: Any) -> float | None:
    """``keep_alive`` of a request in seconds (a negative one: forever); the daemon caps it later."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise invalid(f"keep_alive must be a duration such as \"10m\" or a number of seconds, got {value!r}",
                      field="keep_alive")
    if isinstance(value, int | float) and not math.isfinite(value) and value > 0:
        raise invalid("keep_alive must be finite; use -1 to keep the model forever", field="keep_alive")
    try:
        return parse_duration(value if isinstance(value, str) else float(value))
    except (ValueError, OverflowError) as exc:
        raise invalid(f"keep_alive: {exc}", field="keep_alive") from None


def _preview(body: PreviewBody | None, model: ModelLike, steps: int) -> PreviewSpec | None:
    """``preview`` of a request: every N steps (1..steps), a picture format, a side in pixels."""
    if body is None:
        return None
    if not model.capabilities.previews:
        raise invalid(f"model {model.name!r} cannot show previews (no preview decoder for its latents); "
                      "leave out preview", field="preview")
    every, fmt, side = body.every, body.format, body.max_side
    if not 1 <= every <= steps:
        raise invalid(f"preview.every must be between 1 and steps ({steps}), got {shown(every)}", field="preview.every")
    if fmt not in PREVIEW_FORMATS:
        raise invalid(f"preview.format must be one of {', '.join(PREVIEW_FORMATS)}, got {fmt!r}",
                      field="preview.format")
    if not MIN_PREVIEW_SIDE <= side <= MAX_PREVIEW_SIDE:
        raise invalid(f"preview.max_side must be between {MIN_PREVIEW_SIDE} and {MAX_PREVIEW_SIDE}, got {shown(side)}",
                      field="preview.max_side")
    return PreviewSpec(every=every, format=fmt, max_side=side)
