"""IP-Adapters on the loaded model: files read once per worker, loaded into the denoiser while batches use them.

An IP-Adapter is two things: an image encoder (CLIP vision, ``CLIPVisionModelWithProjection``)
and small weights (``image_proj``: the encoder's embedding to a few tokens; ``ip_adapter``: a key
and value projection for those tokens in each cross-attention). diffusers' ``load_ip_adapter``
puts the second into the UNet (SD 1.5, SDXL) or the FLUX transformer's double-stream blocks (XLabs'
format) by swapping attention processors for IP-Adapter ones and setting ``encoder_hid_proj``.
A batch may name several (each its own reference picture and scale, the same adapter twice
included): diffusers loads them side by side and each processor adds every adapter's attention
times its scale.

Loaded, or not, between jobs: an adapter set (the batch's names, in its order) stays loaded while
consecutive batches use it, and is unloaded before a batch that uses another set or none. Not kept
loaded under plain batches, because a denoiser with an IP-Adapter in it demands image embeddings
on every forward (it refuses a call without), and the edit and ControlNet pipelines share that
very denoiser (``from_pipe``); nor loaded per batch, because a stream of reference-image jobs would
then pay the processor swap each time. What a switch costs is small: the files are read once, at
start, into host memory (the encoders are kept on the model's device), so loading is building the
processors from tensors already read. The denoiser's own processors are kept aside and put back on
unload, not replaced by diffusers' defaults, so whatever the model ran with before (a speed-up's
processor) it runs with after.

The reference pictures are encoded here, each by its own adapter's encoder (diffusers' pipelines
hold one ``image_encoder``, and adapters trained on different encoders cannot share it), with the
pipeline's own ``encode_image``, and reach the pipeline as ``ip_adapter_image_embeds`` in the shape
its ``prepare_ip_adapter_image_embeds`` takes: for the UNet families one tensor per adapter with
the negative half first when the call runs classifier-free guidance (the half ``encode_image``
makes: zeros, or a black picture's hidden states for "plus" adapters); for FLUX the negative
embeddings apart (a black picture's, as FluxPipeline makes them; only true CFG reads them). The
same embeddings serve the ControlNet and edit siblings (image-to-image, inpainting), which run
while the adapters are in the denoiser they share, and a hires pass on the image-to-image one.
Whatever the pipeline, the adapters come out before the next batch without a reference, so that
batch runs as if none had been in.

Whether an adapter fits the model is decided at start, by loading it once and unloading it: the
reasons go to the engine in READY, so requests naming an unfit pair are refused at admission.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import EditArrays, PipelineError, PreviewSink, StepCallback
from diffusiond.pipelines.controlnet import ControlNets, eager, not_diffusers, plain_base
from diffusiond.pipelines.errors import fit_reason
from diffusiond.pipelines.spec import FP8_ROWS_NAME

log = logging.getLogger(__name__)

UNET_FAMILIES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")  # diffusers' IPAdapterMixin
FLUX_FAMILY = "FluxPipeline"  # FluxIPAdapterMixin: XLabs' adapters, in the double-stream blocks
FAMILIES = (*UNET_FAMILIES, FLUX_FAMILY)
# XLabs' names (flux-ip-adapter.safetensors) and diffusers' for the same tensors, as FluxIPAdapterMixin reads them
_XLABS = {"ip_adapter_proj_model": "image_proj", "double_blocks": "ip_adapter"}
_XLABS_RENAMES = (("ip_adapter_double_stream_k_proj", "to_k_ip"), ("ip_adapter_double_stream_v_proj", "to_v_ip"),
                  ("processor.", ""))


def unsupported(pipeline: Any) -> str | None:
    """Why ``pipeline`` takes no IP-Adapter at all (None: its family does)."""
    base = plain_base(pipeline)
    if base is None:
        return not_diffusers(pipeline)
    family = type(base.pipe).__name__
    if family not in FAMILIES:
        return f"model {base.name} is a {family}; IP-Adapters are served for {', '.join(FAMILIES)} models"
    if family in UNET_FAMILIES and FP8_ROWS_NAME in base.capabilities.approximations:
        # diffusers' UNet loader ends with the UNet's own .to(dtype), which would cast the fp8 weights back to
        # full width without their scales, and every later job would fail
        return (f"model {base.name} runs with fp8=rowwise, and diffusers' IP-Adapter load casts its UNet's fp8 "
                "layers back to full width without their scales: serve it without fp8=rowwise to use IP-Adapters")
    unet: Any = getattr(base.pipe, "unet", None)
    if unet is not None and any(getattr(m, "fused_projections", False) for m in unet.modules()):
        # fusion.fuse_qkv deleted the separate projections diffusers' IP-Adapter processors read
        return (f"model {base.name} runs with fuse_qkv=1, whose fused attentions keep no separate query, key and "
                "value projections, which diffusers' IP-Adapter processors read: serve it without fuse_qkv=1 to use "
                "IP-Adapters")
    return None


def read_weights(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """The weights file as ``load_ip_adapter`` takes a state dict: ``image_proj`` and ``ip_adapter`` parts
    (XLabs' FLUX names renamed as FluxIPAdapterMixin renames them)."""
    from safetensors import safe_open

    parts: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
    with safe_open(path, framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            head, _, rest = key.partition(".")
            part = _XLABS.get(head, head)
            if part not in parts:
                continue
            if head == "double_blocks":
                for old, new in _XLABS_RENAMES:
                    rest = rest.replace(old, new)
            parts[part][rest] = f.get_tensor(key)
    if not parts["image_proj"] or not parts["ip_adapter"]:
        raise PipelineError(f"{path} has no image_proj.* or no ip_adapter.* tensors (nor XLabs' "
                            "ip_adapter_proj_model.* and double_blocks.*); it is not an IP-Adapter file")
    return parts


def for_flux(weights: Mapping[str, Mapping[str, torch.Tensor]]) -> bool:
    """FLUX's key and value projections have biases (XLabs' layers); the UNet families' have none."""
    return any(k.endswith("to_k_ip.bias") for k in weights["ip_adapter"])


@dataclass
class _Adapter:
    """One served adapter as read at start: its state dict, its encoder (on the model's device) and that
    encoder's picture processor."""

    weights: dict[str, dict[str, torch.Tensor]]
    encoder: Any
    processor: Any


class IpAdapters:
    """The IP-Adapters one worker serves its model with, and which set of them is in the denoiser now."""

    def __init__(self, pipeline: Any, paths: Mapping[str, tuple[str, str]]) -> None:
        self.pipeline = pipeline
        self.errors: dict[str, str] = {}
        self._adapters: dict[str, _Adapter] = {}
        self.current: tuple[str, ...] | None = None  # the adapters loaded in the denoiser now, in load order
        self._saved: tuple[dict[str, Any], Any, Any] | None = None  # its own processors, the pipe's two modules
        self._flux = False
        why = unsupported(pipeline)
        if why is not None:
            self.errors = dict.fromkeys(paths, why)
            return
        self._flux = type(plain_base(pipeline).pipe).__name__ == FLUX_FAMILY
        for name, (weights, encoder) in paths.items():
            try:
                self._adapters[name] = self._read(weights, encoder)
                self.activate((name,))  # the fit test: diffusers builds every processor from these tensors
                self.release()
            except Exception as exc:  # any loader failure is this adapter's, not the worker's
                self.release()
                self._adapters.pop(name, None)
                self.errors[name] = fit_reason(exc)
                log.warning("IP-Adapter %r (%s) does not fit %s: %s", name, weights, pipeline.name, self.errors[name])

    def _read(self, weights_file: str, folder: str) -> _Adapter:
        from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

        base = plain_base(self.pipeline)
        weights = read_weights(weights_file)
        if for_flux(weights) != self._flux:
            kind = "a FLUX IP-Adapter (XLabs' layout)" if for_flux(weights) else "an SD 1.5 / SDXL IP-Adapter"
            takes = "FLUX ones" if self._flux else "SD 1.5 / SDXL ones (h94's layout)"
            raise PipelineError(f"it is {kind} and model {base.name} is a {type(base.pipe).__name__}, "
                                f"which takes {takes}")
        enc = CLIPVisionModelWithProjection.from_pretrained(folder, use_safetensors=True)
        proj = weights["image_proj"].get("proj.weight")
        if proj is not None and proj.shape[-1] != enc.config.projection_dim:
            raise PipelineError(f"its image_proj takes {proj.shape[-1]}-wide embeddings and its image encoder "
                                f"makes {enc.config.projection_dim}: the encoder is another adapter's")
        side = enc.config.image_size
        return _Adapter(weights, enc.to(base.device, base.dtype).eval(),
                        CLIPImageProcessor(size=side, crop_size=side))

    def _denoiser(self, pipe: Any) -> Any:
        return pipe.transformer if self._flux else pipe.unet

    def _use_encoder(self, pipe: Any, name: str) -> None:
        """The pipe's ``image_encoder`` and ``feature_extractor`` become adapter ``name``'s."""
        a = self._adapters[name]
        pipe.register_modules(image_encoder=a.encoder, feature_extractor=a.processor)

    def activate(self, names: tuple[str, ...]) -> None:
        """Put adapters ``names`` into the denoiser, in that order (nothing to do if they are there already)."""
        if self.current == names:
            return
        self.release()
        pipe = plain_base(self.pipeline).pipe
        self._saved = (dict(self._denoiser(pipe).attn_processors), getattr(pipe, "feature_extractor", None),
                       getattr(pipe, "image_encoder", None))
        self._use_encoder(pipe, names[0])  # so the loader finds an encoder and loads none itself
        dicts = [self._adapters[n].weights for n in names]
        blank = [""] * len(names)
        try:
            if self._flux:
                pipe.load_ip_adapter(dicts, weight_name=blank, subfolder=blank,
                                     image_encoder_pretrained_model_name_or_path=None)
            else:
                pipe.load_ip_adapter(dicts, subfolder=blank, weight_name=blank, image_encoder_folder=None)
        except BaseException:
            # a load that failed midway (out of memory) may have swapped some processors: put the
            # denoiser's own back, so the next batch naming these adapters loads them again
            self.release()
            raise
        self.current = names  # only once they are all in: a batch with the same names skips the load

    def release(self) -> None:
        """Take the adapters out of the denoiser, giving it back its own processors (before any batch without
        them, and after a load that failed)."""
        if self.current is None and self._saved is None:
            return
        pipe = plain_base(self.pipeline).pipe
        self.current = None
        saved, self._saved = self._saved, None
        if getattr(self._denoiser(pipe), "encoder_hid_proj", None) is not None:
            pipe.unload_ip_adapter()
        if saved is not None:
            self._denoiser(pipe).set_attn_processor(saved[0])
            pipe.register_modules(feature_extractor=saved[1], image_encoder=saved[2])

    def modules(self) -> list[torch.nn.Module]:
        """What these adapters hold on the model's device: their image encoders (counted in its weight bytes;
        the adapters' own weights wait in host memory until a batch puts them into the denoiser)."""
        return [a.encoder for a in self._adapters.values()]

    def place(self, *, asleep: bool) -> None:
        """A sleeping model leaves the device free: the adapters come out, the encoders go to host memory."""
        base = plain_base(self.pipeline)
        if base is None:
            return
        self.release()
        if base.device.type != "cpu":
            for a in self._adapters.values():
                a.encoder.to("cpu" if asleep else base.device)

    def _embeds(self, params: BatchParams, names: Sequence[str], pictures: Sequence[Any]) -> dict[str, Any]:
        """The call's ``ip_adapter_image_embeds`` (and FLUX's negative ones): each picture encoded by its
        own adapter's encoder, through the pipeline's ``encode_image``, in the shapes the module docstring says."""
        from diffusers.models.embeddings import ImageProjection

        base = plain_base(self.pipeline)
        pipe, device = base.pipe, base.device
        layers = self._denoiser(pipe).encoder_hid_proj.image_projection_layers
        # the UNet pipelines' ``do_classifier_free_guidance``, which decides whether a negative half is expected
        cfg = not self._flux and params.guidance > 1 and pipe.unet.config.time_cond_proj_dim is None
        positive: list[torch.Tensor] = []
        negative: list[torch.Tensor] = []
        for name, picture, layer in zip(names, pictures, layers, strict=True):
            self._use_encoder(pipe, name)
            if self._flux:
                positive.append(pipe.encode_image(picture, device, 1)[None])
                negative.append(pipe.encode_image(np.zeros_like(np.asarray(picture)), device, 1)[None])
                continue
            pos, neg = pipe.encode_image(picture, device, 1, not isinstance(layer, ImageProjection))
            positive.append(torch.cat([neg[None], pos[None]]) if cfg else pos[None])
        if self._flux:
            return {"ip_adapter_image_embeds": positive, "negative_ip_adapter_image_embeds": negative}
        return {"ip_adapter_image_embeds": positive}

    def redraw(self, references: Sequence[Sequence[np.ndarray]]) -> Callable[..., list[torch.Tensor]]:
        """A batch's hires pass (worker/finish.py), with the first pass's ``references``: the adapters are
        still in the denoiser, and the second pass is steered by the same pictures (as a patched model in
        ComfyUI steers both samplers)."""

        def again(params: BatchParams, requests: Sequence[RequestSpec], inputs: Sequence[EditArrays],
                  on_step: StepCallback, on_preview: PreviewSink | None) -> list[torch.Tensor]:
            return self.run(params, requests, references, on_step, on_preview, edits=inputs)

        return again

    def run(self, params: BatchParams, requests: Sequence[RequestSpec], references: Sequence[Sequence[np.ndarray]],
            on_step: StepCallback, on_preview: PreviewSink | None = None, *, edits: Sequence[EditArrays] = (),
            controls: Sequence[Sequence[np.ndarray]] = (), controlnets: ControlNets | None = None,
            ) -> list[torch.Tensor]:
        """One diffusers call for a batch whose requests share ``params.ip_adapters`` (reference digests
        included, so request 0's pictures are everyone's); ``references[k]`` are request k's pictures,
        one per entry of ``params.ip_adapters``.

        With ``params.controls`` it runs on the ControlNet pipeline (``controls[k]``: request k's control
        pictures), with ``params.edit`` on the edit's (``edits[k]``: request k's image and mask): both are
        ``from_pipe`` siblings of the model, so the adapters in the denoiser they share act there too."""
        from PIL import Image

        base = plain_base(self.pipeline)
        if base is None:
            raise PipelineError(unsupported(self.pipeline) or "this model takes no IP-Adapter")
        names = tuple(r.name for r in params.ip_adapters)
        if not names or not references or len(references[0]) != len(names):
            raise PipelineError(f"a batch with {len(names)} IP-Adapter(s) came with "
                                f"{len(references[0]) if references else 0} reference image(s)")
        for name in names:
            if name not in self._adapters:
                raise PipelineError(f"IP-Adapter {name!r} is not loaded here: "
                                    f"{self.errors.get(name, 'it is not configured')}")
        self.activate(names)
        scales = [r.scale for r in params.ip_adapters]
        base.pipe.set_ip_adapter_scale(scales[0] if len(scales) == 1 else scales)
        with eager(self.pipeline):
            extra = self._embeds(params, names, [Image.fromarray(p) for p in references[0]])
            if params.controls:
                if controlnets is None:
                    raise PipelineError(f"model {base.name} takes no ControlNet here")
                pipe, args = controlnets.pipeline_for(params)
                if "ip_adapter_image_embeds" not in args:
                    extra = _through_attention_kwargs(extra, args, len(requests), type(pipe).__name__)
                return controlnets.run(params, requests, controls, on_step, on_preview, more=extra, edits=edits)
            if params.edit is not None:
                return base.edit(params, requests, edits, on_step, on_preview, more=extra)
            return base._call(base.pipe, base._args, params, requests, on_step, extra, on_preview)


def _through_attention_kwargs(extra: Mapping[str, Any], args: frozenset[str], batch: int,
                              pipeline: str) -> dict[str, Any]:
    """``extra`` for a FLUX pipeline without an ``ip_adapter_image_embeds`` argument: diffusers'
    ``FluxControlNetImg2ImgPipeline`` and ``FluxControlNetInpaintPipeline`` have none (their text-to-image
    sibling has), though their transformer holds the adapters all the same. They hand
    ``joint_attention_kwargs`` to every transformer call, which is where ``FluxPipeline`` puts the
    prepared embeddings (one tensor per adapter, repeated for each picture of the batch); the negative
    ones only true CFG reads, which they do not run. Without this a reference with control and an edit
    failed mid-compute on the unexpected argument."""
    if "joint_attention_kwargs" not in args:
        raise PipelineError(f"{pipeline} takes no IP-Adapter reference")
    out = dict(extra)
    positive = out.pop("ip_adapter_image_embeds")
    out.pop("negative_ip_adapter_image_embeds", None)
    out["joint_attention_kwargs"] = {**(out.get("joint_attention_kwargs") or {}),
                                     "ip_adapter_image_embeds": [torch.cat([e] * batch) for e in positive]}
    return out
