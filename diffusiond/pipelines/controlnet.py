"""ControlNets on the loaded model: each loaded once per worker and kept, run through diffusers' ControlNet pipelines.

A ControlNet steers a text-to-image model by a picture (edges, a pose, depth), and its edits too
(image-to-image and inpainting, as ComfyUI and Forge users run them). diffusers has one pipeline
class per family and task for it (``StableDiffusionControlNetPipeline``,
``StableDiffusionControlNetInpaintPipeline``, their SDXL and FLUX siblings); they are built here
with ``from_pipe`` from the pipeline the worker already holds, the
way the edits are (``edit_pipes.sibling``), so the base weights are shared and only the
ControlNet's own weights are added. Several ControlNets in one request run as diffusers' multi
model (``MultiControlNetModel``): its residuals are summed, each at its own scale and step range.
A union ControlNet (one model, several control modes: SDXL's ``ControlNetUnionModel`` with its own
pipelines, FLUX's ``FluxControlNetModel`` with ``num_mode``) gets each request's mode as ``control_mode``.
A seed gives the model's own starting noise with or without ControlNets (FLUX's pipeline is made to
draw it in the model's order), so scale 0 is the plain picture (or the plain edit), bit for bit, in every family.

Whether a ControlNet fits the model is decided at load time, from the family (an SD 1.5 ControlNet
cannot feed a FLUX transformer) and the shapes its residuals must match; the reasons go to the
engine in READY so requests naming an unfit pair are refused at admission, never mid-compute.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import EditArrays, PipelineError, PreviewSink, StepCallback
from diffusiond.pipelines.errors import fit_reason
from diffusiond.protocol import Task

log = logging.getLogger(__name__)

# The model's own pipeline class -> (ControlNet model class, the class that runs several, the
# ControlNet pipeline for each task: None text-to-image, else the edit's). A folder whose class is
# an edit pipeline (a dedicated inpainting model) is of its family too: its ControlNet reads the
# same latents, and the ControlNet inpainting pipeline feeds a 9-channel UNet the mask as its own does.
_SD = ("ControlNetModel", "MultiControlNetModel", {
    None: "StableDiffusionControlNetPipeline", Task.IMAGE_TO_IMAGE: "StableDiffusionControlNetImg2ImgPipeline",
    Task.INPAINTING: "StableDiffusionControlNetInpaintPipeline"})
_SDXL = ("ControlNetModel", "MultiControlNetModel", {
    None: "StableDiffusionXLControlNetPipeline", Task.IMAGE_TO_IMAGE: "StableDiffusionXLControlNetImg2ImgPipeline",
    Task.INPAINTING: "StableDiffusionXLControlNetInpaintPipeline"})
# SDXL's union ControlNets (one model, several control modes, xinsir's layout) have pipelines of their own;
# a list of them is wrapped by the pipeline itself (MultiControlNetUnionModel). FLUX's union is a
# FluxControlNetModel with ``num_mode``, run by the same pipelines with a ``control_mode``.
_SDXL_UNION = ("ControlNetUnionModel", "", {
    None: "StableDiffusionXLControlNetUnionPipeline",
    Task.IMAGE_TO_IMAGE: "StableDiffusionXLControlNetUnionImg2ImgPipeline",
    Task.INPAINTING: "StableDiffusionXLControlNetUnionInpaintPipeline"})
UNIONS = {"ControlNetUnionModel": _SDXL_UNION}
_FLUX = ("FluxControlNetModel", "FluxMultiControlNetModel", {
    None: "FluxControlNetPipeline", Task.IMAGE_TO_IMAGE: "FluxControlNetImg2ImgPipeline",
    Task.INPAINTING: "FluxControlNetInpaintPipeline"})
FAMILIES: dict[str, tuple[str, str, dict[Task | None, str]]] = {
    "StableDiffusionPipeline": _SD, "StableDiffusionImg2ImgPipeline": _SD, "StableDiffusionInpaintPipeline": _SD,
    "StableDiffusionXLPipeline": _SDXL, "StableDiffusionXLImg2ImgPipeline": _SDXL,
    "StableDiffusionXLInpaintPipeline": _SDXL,
    "FluxPipeline": _FLUX, "FluxImg2ImgPipeline": _FLUX, "FluxInpaintPipeline": _FLUX,
}  # fmt: skip


def plain_base(pipeline: Any) -> Any:
    """The ``DiffusersPipeline`` under ``pipeline`` (a compiled model's inner one), or None (a synthetic
    model): what the sibling pipelines (ControlNet, IP-Adapter) are built on."""
    from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline

    inner = getattr(pipeline, "inner", pipeline)
    return inner if isinstance(inner, DiffusersPipeline) else None


def not_diffusers(pipeline: Any) -> str:
    """Why a model that is not a diffusers pipeline takes no ControlNet nor IP-Adapter."""
    return f"model {pipeline.name} is not a diffusers text-to-image pipeline (a synthetic model)"


def eager(pipeline: Any) -> contextlib.AbstractContextManager[Any]:
    """Where a ControlNet or IP-Adapter batch of a ``--compile``d model runs: its modules eager.

    Their siblings share the compiled denoiser, and what they add to it (a ControlNet's residuals as new
    inputs, an IP-Adapter's attention processors) would make dynamo trace new graphs at any batch: a
    compile no ``compiling`` stage announced, counted against ``compile_shapes`` (so that plain batches
    of a new size would later run eager), and CUDA graphs for shapes nobody warmed. Run eager, the
    compiled graphs stay as they were, for the plain batches they serve. torch before 2.6 has no stance:
    there such a batch runs through the compiled modules, recompiling where its inputs are new."""
    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)
    if pipeline is plain_base(pipeline) or set_stance is None:
        return contextlib.nullcontext()
    return set_stance("force_eager")


def unsupported(pipeline: Any) -> str | None:
    """Why ``pipeline`` takes no ControlNet at all (None: its family has ControlNet pipelines)."""
    base = plain_base(pipeline)
    if base is None:
        return not_diffusers(pipeline)
    family = type(base.pipe).__name__
    if family not in FAMILIES:
        families = sorted({pipes[None].replace("ControlNet", "") for _, _, pipes in FAMILIES.values()})
        return (f"model {base.name} is a {family}; ControlNets are served for {', '.join(families)} models "
                "and their image-to-image and inpainting models")
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
            if key == "in_channels" and getattr(pipe, "vae", None) is not None:
                # what it reads is the latents: an inpainting UNet takes 9 channels (those, the mask and
                # the masked picture's latents) and its ControlNet the 4 of the latents alone
                theirs = pipe.vae.config.latent_channels
                if mine != theirs:
                    return f"its in_channels is {mine!r} and the model's latents have {theirs!r}"
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
    return None


def _load(path: str, model_cls: str, dtype: torch.dtype, union_cls: str | None = None) -> Any:
    """A ControlNet from a diffusers folder (its config names its class: ``model_cls``, or the family's
    union class ``union_cls``) or a single checkpoint file."""
    import diffusers

    p = Path(path).expanduser()
    if p.is_dir():
        config = p / "config.json"
        named = json.loads(config.read_text()).get("_class_name", model_cls) if config.is_file() else model_cls
        if named not in (model_cls, union_cls):
            takes = model_cls if union_cls is None else f"{model_cls} or a {union_cls}"
            raise PipelineError(f"it is a {named}; this model's family takes a {takes}")
        return getattr(diffusers, named).from_pretrained(str(p), torch_dtype=dtype, use_safetensors=True)
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
        # one pipeline per (ControlNets, edit task or None): the call's arguments and its FLUX rewind
        self._pipes: dict[tuple[tuple[str, ...], Task | None], tuple[Any, frozenset[str], _Rewind | None]] = {}
        why = unsupported(pipeline)
        if why is not None:
            self.errors = dict.fromkeys(paths, why)
            return
        base = plain_base(pipeline)
        family = FAMILIES[type(base.pipe).__name__]
        model_cls, union_cls = family[0], _SDXL_UNION[0] if family is _SDXL else None
        for name, path in paths.items():
            try:
                cn = _load(path, model_cls, base.dtype, union_cls)
                misfit = _fit(cn, base.pipe)
                if misfit:
                    raise PipelineError(misfit)
            except Exception as exc:  # any loader failure is this ControlNet's, not the worker's
                self.errors[name] = fit_reason(exc)
                log.warning("ControlNet %r (%s) does not fit %s: %s", name, path, base.name, self.errors[name])
                continue
            if family is _FLUX and getattr(cn, "union", False):
                cn.register_forward_pre_hook(_mode_per_picture, with_kwargs=True)
            self.models[name] = cn.to(base.device).eval()
            try:  # its text-to-image pipeline, built now (and kept): one that cannot be is refused at admission
                self._pipe_for((name,), None)
            except PipelineError as exc:
                del self.models[name]
                self.errors[name] = str(exc)
                log.warning("ControlNet %r (%s) is not served: %s", name, path, exc)

    def modules(self) -> list[torch.nn.Module]:
        """What these ControlNets hold on the model's device (counted in its weight bytes)."""
        return list(self.models.values())

    def place(self, *, asleep: bool) -> None:
        """Follow the model to host memory when it sleeps and back when it wakes: a sleeping model
        must leave the device free, ControlNets included."""
        base = plain_base(self.pipeline)
        if base is None or base.device.type == "cpu":
            return
        for cn in self.models.values():
            cn.to("cpu" if asleep else base.device)

    def _pipe_for(self, names: tuple[str, ...], task: Task | None) -> tuple[Any, frozenset[str], _Rewind | None]:
        """The family's ControlNet pipeline for ``task`` (None: text-to-image) over the model's own
        components, one per set of names and task, kept."""
        missing = [n for n in names if n not in self.models]
        if missing:
            why = self.errors.get(missing[0], "it is not configured")
            raise PipelineError(f"ControlNet {missing[0]!r} is not loaded here: {why}")
        cached = self._pipes.get((names, task))
        if cached is None:
            import diffusers

            from diffusiond.pipelines.diffusers_pipeline import call_args
            from diffusiond.pipelines.edit_pipes import sibling

            base = plain_base(self.pipeline)
            models = [self.models[n] for n in names]
            unions = {type(m).__name__ for m in models} & set(UNIONS)
            if unions and len(unions) != len({type(m).__name__ for m in models}):
                raise PipelineError("a union ControlNet runs with other union ControlNets only")
            _, multi_cls, pipes = UNIONS[unions.pop()] if unions else FAMILIES[type(base.pipe).__name__]
            if task not in pipes:
                raise PipelineError(f"model {base.name} has no ControlNet pipeline for {task}")
            cn = models[0] if len(models) == 1 else getattr(diffusers, multi_cls)(models) if multi_cls else models
            try:
                pipe = sibling(getattr(diffusers, pipes[task]), base.pipe, controlnet=cn)
            except Exception as exc:  # diffusers' own refusal (a module it cannot share): this request's, in words
                raise PipelineError(f"model {base.name} cannot run ControlNet(s) {', '.join(names)}: diffusers' "
                                    f"{pipes[task]} cannot be built on it ({fit_reason(exc)})") from exc
            pipe.set_progress_bar_config(disable=True)
            cached = (pipe, call_args(type(pipe)), _Rewind(pipe) if pipes is _FLUX[2] else None)
            self._pipes[(names, task)] = cached
        return cached

    def pipeline_for(self, params: BatchParams) -> tuple[Any, frozenset[str]]:
        """The pipeline ``params`` runs on and its call's arguments: what another part's arguments must fit
        (an IP-Adapter's embeddings)."""
        pipe, args, _ = self._pipe_for(tuple(c.name for c in params.controls),
                                       Task(params.edit) if params.edit is not None else None)
        return pipe, args

    def run(self, params: BatchParams, requests: Sequence[RequestSpec], images: Sequence[Sequence[np.ndarray]],
            on_step: StepCallback, on_preview: PreviewSink | None = None,
            more: Mapping[str, Any] | None = None, edits: Sequence[EditArrays] = ()) -> list[torch.Tensor]:
        """One diffusers call for a batch whose requests share ``params.controls``; ``images[k]`` are
        request k's control pictures (uint8 (H, W, 3)), in the order of ``params.controls``; ``more``
        are further call arguments (an IP-Adapter's reference image). With ``params.edit`` it is the
        edit's ControlNet sibling, and ``edits[k]`` request k's image and mask, as the model's edit takes them."""
        base = plain_base(self.pipeline)
        if base is None:
            raise PipelineError(unsupported(self.pipeline) or "this model takes no ControlNet")
        names = tuple(c.name for c in params.controls)
        task = Task(params.edit) if params.edit is not None else None
        pipe, args, rewind = self._pipe_for(names, task)
        per_control = [
            torch.from_numpy(np.stack([imgs[k] for imgs in images])).permute(0, 3, 1, 2).float() / 255
            for k in range(len(names))
        ]
        one = len(names) == 1
        union = type(self.models[names[0]]).__name__ in UNIONS  # its pipeline takes a list of pictures and modes
        extra: dict[str, Any] = {
            ("control_image" if "control_image" in args else "image"):
                per_control if union or not one else per_control[0],
            "controlnet_conditioning_scale": params.controls[0].scale if one else [c.scale for c in params.controls],
            "control_guidance_start": params.controls[0].start if one else [c.start for c in params.controls],
            "control_guidance_end": params.controls[0].end if one else [c.end for c in params.controls],
            **(more or {}),
        }
        modes = [c.mode for c in params.controls]
        if any(m is not None for m in modes):
            extra["control_mode"] = modes if union or not one else modes[0]
        with eager(self.pipeline):
            if task is not None:
                return base.edit(params, requests, edits, on_step, on_preview, extra, pipe=pipe, drawn=rewind)
            return base._call(pipe, args, params, requests, on_step, extra, on_preview, rewind)


def _mode_per_picture(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A FLUX union ControlNet's mode, one row per picture of the batch. diffusers' FLUX ControlNet edit
    pipelines (image-to-image, inpainting) give it one row for the whole batch, where their text-to-image
    sibling expands it, and its embedding is joined to each picture's text: an edit with a mode and more
    than one picture (``n`` 2, or two requests batched) failed mid-compute on the shapes."""
    mode, hidden = kwargs.get("controlnet_mode"), kwargs.get("hidden_states")
    if not (isinstance(mode, torch.Tensor) and isinstance(hidden, torch.Tensor) and mode.shape[0] == 1 < len(hidden)):
        return None
    return args, {**kwargs, "controlnet_mode": mode.expand(len(hidden), *mode.shape[1:])}


class _Rewind:
    """FLUX's ControlNet pipelines sample their control pictures' VAE latents from the requests'
    generators before anything else, so the same seed would start from other noise than the model
    alone (and scale 0 would not give the plain picture): the generators' states are noted when the
    call starts (``DiffusersPipeline._call``'s ``drawn``) and put back when the pipeline reaches its
    ``prepare_latents``, which then draws the initial noise (and an edit's image latents) exactly as
    the model's own pipeline does. Every draw after that (a masked picture's, flow-sde's per step)
    follows in the same order too."""

    def __init__(self, pipe: Any) -> None:
        self._noted: list[tuple[torch.Generator, torch.Tensor]] = []
        self._prepare = pipe.prepare_latents
        pipe.prepare_latents = self._prepare_latents  # the instance's, before the class's

    def __call__(self, gens: list[torch.Generator]) -> dict[str, Any]:
        self._noted = [(g, g.get_state()) for g in gens]
        return {}

    def _prepare_latents(self, *args: Any, **kwargs: Any) -> Any:
        noted, self._noted = self._noted, []
        for g, state in noted:
            g.set_state(state)
        return self._prepare(*args, **kwargs)
