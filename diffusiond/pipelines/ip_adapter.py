"""IP-Adapters on the loaded model: files read once per worker, the adapter loaded into the UNet while batches use it.

An IP-Adapter is two things: an image encoder (CLIP vision, ``CLIPVisionModelWithProjection``)
and small weights (``image_proj``: the encoder's embedding to a few tokens; ``ip_adapter``: a key
and value projection for those tokens in each cross-attention). diffusers' ``load_ip_adapter``
puts the second into the UNet by swapping its cross-attention processors for IP-Adapter ones and
setting ``unet.encoder_hid_proj``; the pipeline then takes ``ip_adapter_image``.

Loaded, or not, between jobs: an adapter stays loaded while consecutive batches use it, and is
unloaded before a batch that uses another one or none. Not kept loaded under plain batches,
because a UNet with an IP-Adapter in it demands image embeddings on every forward (it refuses a
call without), and the edit and ControlNet pipelines share that very UNet (``from_pipe``); nor
loaded per batch, because a stream of reference-image jobs would then pay the processor swap
each time. What a switch costs is small: the files are read once, at start, into host memory
(the encoder is kept on the model's device), so loading is building the processors from tensors
already read. The UNet's own processors are kept aside and put back on unload, not replaced by
diffusers' defaults, so whatever the model ran with before (a speed-up's processor) it runs with after.

The same sharing is how a reference combines with ControlNets or an edit (image-to-image,
inpainting): such a batch runs the sibling pipeline with ``ip_adapter_image`` while the adapter is in
the UNet, and a sibling takes the model's image encoder before each call (``edit_pipes.share_image_encoder``),
so it encodes with the adapter's while one is in and holds none after. Whatever the pipeline, the
adapter comes out before the next batch without a reference, so that batch runs as if none had been in.

Whether an adapter fits the model is decided at start, by loading it once and unloading it: the
reasons go to the engine in READY, so requests naming an unfit pair are refused at admission.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import EditArrays, PipelineError, PreviewSink, StepCallback
from diffusiond.pipelines.controlnet import ControlNets, plain_base

log = logging.getLogger(__name__)

FAMILIES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")  # diffusers' IPAdapterMixin, UNet models


def unsupported(pipeline: Any) -> str | None:
    """Why ``pipeline`` takes no IP-Adapter at all (None: its family does)."""
    base = plain_base(pipeline)
    if base is None:
        return f"model {pipeline.name} is not a plain diffusers text-to-image pipeline (compiled or synthetic)"
    family = type(base.pipe).__name__
    if family not in FAMILIES:
        return f"model {base.name} is a {family}; IP-Adapters are served for {', '.join(FAMILIES)} models"
    return None


def read_weights(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """The weights file as ``load_ip_adapter`` takes a state dict: ``image_proj`` and ``ip_adapter`` parts."""
    from safetensors import safe_open

    parts: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
    with safe_open(path, framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            head, _, rest = key.partition(".")
            if head in parts:
                parts[head][rest] = f.get_tensor(key)
    if not parts["image_proj"] or not parts["ip_adapter"]:
        raise PipelineError(f"{path} has no image_proj.* or no ip_adapter.* tensors; it is not an IP-Adapter file")
    return parts


class IpAdapters:
    """The IP-Adapters one worker serves its model with, and which one is in the UNet now."""

    def __init__(self, pipeline: Any, paths: Mapping[str, tuple[str, str]]) -> None:
        self.pipeline = pipeline
        self.errors: dict[str, str] = {}
        self._weights: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._encoders: dict[str, Any] = {}
        self.current: str | None = None  # the adapter loaded in the UNet now
        self._saved: tuple[dict[str, Any], Any, Any] | None = None  # the UNet's processors, the pipe's two modules
        why = unsupported(pipeline)
        if why is not None:
            self.errors = dict.fromkeys(paths, why)
            return
        for name, (weights, encoder) in paths.items():
            try:
                self._weights[name] = read_weights(weights)
                self._encoders[name] = self._read_encoder(encoder)
                self.activate(name)  # the fit test: diffusers builds every processor from these tensors
                self.release()
            except Exception as exc:  # any loader failure is this adapter's, not the worker's
                self.release()
                self._weights.pop(name, None)
                self._encoders.pop(name, None)
                self.errors[name] = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
                log.warning("IP-Adapter %r (%s) does not fit %s: %s", name, weights, pipeline.name, self.errors[name])

    def _read_encoder(self, folder: str) -> Any:
        from transformers import CLIPVisionModelWithProjection

        base = plain_base(self.pipeline)
        enc = CLIPVisionModelWithProjection.from_pretrained(folder, use_safetensors=True)
        return enc.to(base.device, base.dtype).eval()

    def activate(self, name: str) -> None:
        """Put adapter ``name`` into the UNet (nothing to do if it is there already)."""
        if self.current == name:
            return
        self.release()
        from transformers import CLIPImageProcessor

        pipe = plain_base(self.pipeline).pipe
        enc = self._encoders[name]
        proj = self._weights[name]["image_proj"].get("proj.weight")
        if proj is not None and proj.shape[-1] != enc.config.projection_dim:
            raise PipelineError(f"its image_proj takes {proj.shape[-1]}-wide embeddings and its image encoder "
                                f"makes {enc.config.projection_dim}: the encoder is another adapter's")
        self._saved = (dict(pipe.unet.attn_processors), getattr(pipe, "feature_extractor", None),
                       getattr(pipe, "image_encoder", None))
        side = enc.config.image_size
        pipe.register_modules(image_encoder=enc,
                              feature_extractor=CLIPImageProcessor(size=side, crop_size=side))
        self.current = name
        pipe.load_ip_adapter(self._weights[name], subfolder="", weight_name="", image_encoder_folder=None)

    def release(self) -> None:
        """Take the adapter out of the UNet, giving it back its own processors (before any batch without it)."""
        if self.current is None:
            return
        pipe = plain_base(self.pipeline).pipe
        self.current = None
        saved, self._saved = self._saved, None
        if getattr(pipe.unet, "encoder_hid_proj", None) is not None:
            pipe.unload_ip_adapter()
        if saved is not None:
            pipe.unet.set_attn_processor(saved[0])
            pipe.register_modules(feature_extractor=saved[1], image_encoder=saved[2])

    def place(self, *, asleep: bool) -> None:
        """A sleeping model leaves the device free: the adapter comes out, the encoders go to host memory."""
        base = plain_base(self.pipeline)
        if base is None:
            return
        self.release()
        if base.device.type != "cpu":
            for enc in self._encoders.values():
                enc.to("cpu" if asleep else base.device)

    def redraw(self, references: Sequence[Sequence[np.ndarray]]) -> Callable[..., list[torch.Tensor]]:
        """A batch's hires pass (worker/finish.py), with the first pass's ``references``: the adapter is
        still in the UNet, and the second pass is steered by the same picture (as a patched model in
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
        included, so request 0's picture is everyone's); ``references[k]`` are request k's pictures.

        With ``params.controls`` it runs on the ControlNet pipeline (``controls[k]``: request k's control
        pictures), with ``params.edit`` on the edit's (``edits[k]``: request k's image and mask): both are
        ``from_pipe`` siblings of the model, so the adapter in the UNet they share acts there too, and
        they take the reference as the model's own pipeline does (``ip_adapter_image``)."""
        from PIL import Image

        base = plain_base(self.pipeline)
        if base is None:
            raise PipelineError(unsupported(self.pipeline) or "this model takes no IP-Adapter")
        if len(params.ip_adapters) != 1 or not references or len(references[0]) != 1:
            raise PipelineError("a batch takes exactly one IP-Adapter and its reference image")
        ref = params.ip_adapters[0]
        if ref.name not in self._weights:
            raise PipelineError(f"IP-Adapter {ref.name!r} is not loaded here: "
                                f"{self.errors.get(ref.name, 'it is not configured')}")
        self.activate(ref.name)
        base.pipe.set_ip_adapter_scale(ref.scale)
        extra = {"ip_adapter_image": Image.fromarray(references[0][0])}
        if params.controls:
            if controlnets is None:
                raise PipelineError(f"model {base.name} takes no ControlNet here")
            return controlnets.run(params, requests, controls, on_step, on_preview, more=extra, edits=edits)
        if params.edit is not None:
            return base.edit(params, requests, edits, on_step, on_preview, more=extra)
        return base._call(base.pipe, base._args, params, requests, on_step, extra, on_preview)
