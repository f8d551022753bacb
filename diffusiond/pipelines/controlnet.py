"""ControlNets on the loaded model: each loaded once per worker and kept, run through diffusers' ControlNet pipelines.

A ControlNet steers a text-to-image model by a picture (edges, a pose, depth). diffusers has one
pipeline class per family for it (``StableDiffusionControlNetPipeline``, its SDXL and FLUX
siblings); they are built here with ``from_pipe`` from the pipeline the worker already holds, the
way the edits are (``diffusers_pipeline._edit_pipes``), so the base weights are shared and only the
ControlNet's own weights are added. Several ControlNets in one request run as diffusers' multi
model (``MultiControlNetModel``): its residuals are summed, each at its own scale and step range.
A seed gives the model's own starting noise with or without ControlNets (FLUX's pipeline is made to
draw it in the model's order), so scale 0 is the plain picture, bit for bit, in every family.

Whether a ControlNet fits the model is decided at load time, from the family (an SD 1.5 ControlNet
cannot feed a FLUX transformer) and the shapes its residuals must match; the reasons go to the
engine in READY so requests naming an unfit pair are refused at admission, never mid-compute.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import PipelineError, PreviewSink, StepCallback

log = logging.getLogger(__name__)

# base pipeline class -> (ControlNet model class, its pipeline class, the class that runs several)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "StableDiffusionPipeline": ("ControlNetModel", "StableDiffusionControlNetPipeline", "MultiControlNetModel"),
    "StableDiffusionXLPipeline": ("ControlNetModel", "StableDiffusionXLControlNetPipeline", "MultiControlNetModel"),
    "FluxPipeline": ("FluxControlNetModel", "FluxControlNetPipeline", "FluxMultiControlNetModel"),
}


def plain_base(pipeline: Any) -> Any:
    """The ``DiffusersPipeline`` under ``pipeline``, or None (a synthetic or compiled model): what the
    sibling pipelines (ControlNet, IP-Adapter) are built on."""
    from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline

    return pipeline if isinstance(pipeline, DiffusersPipeline) else None


def unsupported(pipeline: Any) -> str | None:
    """Why ``pipeline`` takes no ControlNet at all (None: its family has ControlNet pipelines)."""
    base = plain_base(pipeline)
    if base is None:
        return f"model {pipeline.name} is not a plain diffusers text-to-image pipeline (compiled or synthetic)"
    family = type(base.pipe).__name__
    if family not in FAMILIES:
        return (f"model {base.name} is a {family}; ControlNets are served for "
                f"{', '.join(sorted(FAMILIES))} models")
    return None


# What a ControlNet shares with the model's denoiser: it reads the same latents and text (SD's
# cross-attention, SDXL's pooled text and size conditioning, FLUX's T5 and pooled CLIP) and its
# residuals are added to the denoiser's blocks. A pair differing in any of these fails on a shape
# mid-compute, so it is refused at load instead.
_UNET_KEYS = ("in_channels", "cross_attention_dim", "block_out_channels", "addition_embed_type",
              "projection_class_embeddings_input_dim")
_TRANSFORMER_KEYS = ("in_channels", "joint_attention_dim", "pooled_projection_dim")


def _fit(cn: Any, pipe: Any) -> str | None:
    """Why ControlNet ``cn`` cannot feed ``pipe``'s denoiser (None: it can)."""
    unet = getattr(pipe, "unet", None)
    if unet is not None:
        for key in _UNET_KEYS:
            mine, theirs = cn.config.get(key), unet.config.get(key)
            if key == "block_out_channels":
                mine, theirs = tuple(mine or ()), tuple(theirs or ())
            if mine != theirs:
                return f"its {key} is {mine!r} and the model's UNet has {theirs!r} (a ControlNet of another family)"
        return None
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        return None
    inner = lambda c: c.get("num_attention_heads", 0) * c.get("attention_head_dim", 0)  # noqa: E731
    if inner(cn.config) != inner(transformer.config):
        return f"its width is {inner(cn.config)} and the model's transformer has {inner(transformer.config)}"
    for key in _TRANSFORMER_KEYS:
        mine, theirs = cn.config.get(key), transformer.config.get(key)
        if mine != theirs:
            return f"its {key} is {mine!r} and the model's transformer has {theirs!r}"
    if cn.config.get("num_mode"):  # diffusers raises mid-compute on a union ControlNet given no mode
        return (f"it is a union ControlNet ({cn.config['num_mode']} control modes) and a request cannot "
                "choose a mode yet")
    return None


def _load(path: str, model_cls: str, dtype: torch.dtype) -> Any:
    """A ControlNet from a diffusers folder (its config names its class) or a single checkpoint file."""
    import diffusers

    p = Path(path).expanduser()
    if p.is_dir():
        config = p / "config.json"
        named = json.loads(config.read_text()).get("_class_name", model_cls) if config.is_file() else model_cls
        if named != model_cls:
            raise PipelineError(f"it is a {named}; this model's family takes a {model_cls}")
        return getattr(diffusers, model_cls).from_pretrained(str(p), torch_dtype=dtype, use_safetensors=True)
    cls = getattr(diffusers, model_cls)
    if not hasattr(cls, "from_single_file"):
        raise PipelineError(f"diffusers reads {model_cls} from a folder only (save_pretrained's); give one")
    if p.suffix != ".safetensors":
        raise PipelineError("single ControlNet files are read as .safetensors only (no pickle)")
    return cls.from_single_file(str(p), torch_dtype=dtype)


class ControlNets:
    """The ControlNets one worker serves its model with: loaded once, kept on the model's device."""

    def __init__(self, pipeline: Any, paths: Mapping[str, str]) -> None:
        self.pipeline = pipeline
        self.models: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self._pipes: dict[tuple[str, ...], tuple[Any, frozenset[str]]] = {}
        why = unsupported(pipeline)
        if why is not None:
            self.errors = dict.fromkeys(paths, why)
            return
        base = plain_base(pipeline)
        model_cls = FAMILIES[type(base.pipe).__name__][0]
        for name, path in paths.items():
            try:
                cn = _load(path, model_cls, base.dtype)
                misfit = _fit(cn, base.pipe)
                if misfit:
                    raise PipelineError(misfit)
            except Exception as exc:  # any loader failure is this ControlNet's, not the worker's
                self.errors[name] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PipelineError) else str(exc)
                log.warning("ControlNet %r (%s) does not fit %s: %s", name, path, base.name, self.errors[name])
                continue
            self.models[name] = cn.to(base.device).eval()

    def place(self, *, asleep: bool) -> None:
        """Follow the model to host memory when it sleeps and back when it wakes: a sleeping model
        must leave the device free, ControlNets included."""
        base = plain_base(self.pipeline)
        if base is None or base.device.type == "cpu":
            return
        for cn in self.models.values():
            cn.to("cpu" if asleep else base.device)

    def _pipe_for(self, names: tuple[str, ...]) -> tuple[Any, frozenset[str]]:
        """The family's ControlNet pipeline over the model's own components, one per set of names, kept."""
        cached = self._pipes.get(names)
        if cached is None:
            import diffusers

            from diffusiond.pipelines.diffusers_pipeline import call_args
            from diffusiond.pipelines.edit_pipes import sibling

            base = plain_base(self.pipeline)
            _, pipe_cls, multi_cls = FAMILIES[type(base.pipe).__name__]
            models = [self.models[n] for n in names]
            cn = models[0] if len(models) == 1 else getattr(diffusers, multi_cls)(models)
            pipe = sibling(getattr(diffusers, pipe_cls), base.pipe, controlnet=cn)
            pipe.set_progress_bar_config(disable=True)
            cached = (pipe, call_args(type(pipe)))
            self._pipes[names] = cached
        return cached

    def run(self, params: BatchParams, requests: Sequence[RequestSpec], images: Sequence[Sequence[np.ndarray]],
            on_step: StepCallback, on_preview: PreviewSink | None = None,
            more: Mapping[str, Any] | None = None) -> list[torch.Tensor]:
        """One diffusers call for a batch whose requests share ``params.controls``; ``images[k]`` are
        request k's control pictures (uint8 (H, W, 3)), in the order of ``params.controls``; ``more``
        are further call arguments (an IP-Adapter's reference image)."""
        base = plain_base(self.pipeline)
        if base is None:
            raise PipelineError(unsupported(self.pipeline) or "this model takes no ControlNet")
        names = tuple(c.name for c in params.controls)
        missing = [n for n in names if n not in self.models]
        if missing:
            why = self.errors.get(missing[0], "it is not configured")
            raise PipelineError(f"ControlNet {missing[0]!r} is not loaded here: {why}")
        pipe, args = self._pipe_for(names)
        per_control = [
            torch.from_numpy(np.stack([imgs[k] for imgs in images])).permute(0, 3, 1, 2).float() / 255
            for k in range(len(names))
        ]
        one = len(names) == 1
        extra: dict[str, Any] = {
            ("control_image" if "control_image" in args else "image"): per_control[0] if one else per_control,
            "controlnet_conditioning_scale": params.controls[0].scale if one else [c.scale for c in params.controls],
            "control_guidance_start": params.controls[0].start if one else [c.start for c in params.controls],
            "control_guidance_end": params.controls[0].end if one else [c.end for c in params.controls],
            **(more or {}),
        }
        drawn = _flux_noise(pipe, params, len(requests)) if type(base.pipe).__name__ == "FluxPipeline" else None
        return base._call(pipe, args, params, requests, on_step, extra, on_preview, drawn)


def _flux_noise(pipe: Any, params: BatchParams, n: int) -> Callable[[list[torch.Generator]], dict[str, Any]]:
    """FluxControlNetPipeline samples its control pictures' VAE latents from the requests' generators
    before it draws the initial noise, so the same seed would start from other noise than the model
    alone (and scale 0 would not give the plain picture): the noise is drawn here first, exactly as
    ``FluxPipeline.prepare_latents`` draws it (its dtype is the prompt embeddings', the first text
    encoder's), and the pipeline gets copies of the generators for the pictures."""

    def draw(gens: list[torch.Generator]) -> dict[str, Any]:
        dtype = (pipe.text_encoder if pipe.text_encoder is not None else pipe.transformer).dtype
        latents, _ = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, params.height, params.width,
                                          dtype, pipe._execution_device, gens)
        copies = []
        for g in gens:
            copy = torch.Generator(g.device)
            copy.set_state(g.get_state())
            copies.append(copy)
        return {"latents": latents, "generator": copies}

    return draw
