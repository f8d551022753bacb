"""What ``offload=auto`` passes over, and for which models: the one place that says where auto may stream.

``fit`` lists every configuration; auto takes the fastest that fits, less these. fp8 never: it changes outputs.
``offload=stream`` only for a pipeline it was measured on. Its plan is fixed at the daemon's start: the budget
filled with resident denoiser blocks, less one 1024² image's working memory (``fit.stream_configuration``). That
held for FLUX.1-dev's text-to-image pipeline: inside 24 GiB at 0.923x resident with byte-equal pictures on an
H100 (docs/benchmarks.md, 2026-12-05), where group, auto's choice before, ran at 0.33x (H200, 2026-12-02).
Denoisers laid out alike but with more tokens an image were not measured, and their activations may not fit
beside the blocks: HunyuanVideo's and MotifVideo's frames, Kontext's reference picture, Fill's and the control
models'. So the rule goes by the pipeline class the loader would build, read from the files as
it reads them, not by the denoiser's layout: other pipelines keep group, and ask for stream by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final

from diffusiond.daemon.residency.fit_tensors import Tensor
from diffusiond.daemon.residency.sizes import WeightsError, pipeline_class_name

AUTO_SKIPS: Final = {"fp8": "approximate", "stream": "measured on FLUX.1's text-to-image pipeline only"}
"""Listed by ``fit``, passed over by ``auto``, and why (the words of the hint when nothing else fits)."""
STREAM_MEASURED: Final = frozenset({"FluxPipeline"})
"""The pipelines auto may stream: those ``offload=stream`` was measured on."""
AUTO_STREAM_RESIDENT: Final = 0.25
"""The least share of the denoiser's blocks auto's stream keeps resident. It was measured at 36 of 57 (24 GiB);
with few resident it moves about what group moves over the bus each step (group is bus-bound: docs/benchmarks.md)
and keeps its ring's slots on the device besides, room that activations lose."""
FLUX1_MARK: Final = "double_blocks.0.img_attn.norm.key_norm.scale"
"""What marks a single file as FLUX's (diffusers' ``CHECKPOINT_KEY_NAMES["flux"]``, ComfyUI's prefix stripped)."""
NOT_FLUX1: Final = ("single_stream_modulation.lin.weight", "early_stream_modulations.image.lin.weight",
                    "distilled_guidance_layer.in_proj.bias")
"""FLUX.2's, FLUX.3's and Chroma's marks, which diffusers checks first: such a file is not FLUX.1's."""
NOT_TEXT_TO_IMAGE: Final = {384: "flux-fill", 128: "flux-depth"}
"""``img_in``'s input width of the guidance-distilled files diffusers infers as another model than flux-dev."""


def too_few_resident(resident: int | None, blocks: int | None) -> bool:
    """A stream plan auto passes over: fewer than ``AUTO_STREAM_RESIDENT`` of its denoiser's blocks resident."""
    return resident is not None and bool(blocks) and resident < AUTO_STREAM_RESIDENT * (blocks or 0)


def skips(pipeline: str | None) -> dict[str, str]:
    """``AUTO_SKIPS`` for a model whose pipeline class is ``pipeline`` (None: not known from its files)."""
    return {k: v for k, v in AUTO_SKIPS.items() if not (k == "stream" and pipeline in STREAM_MEASURED)}


def pipeline_of(kind: str, folder: Path | None, options: Mapping[str, str],
                components: Mapping[str, list[Tensor]]) -> str | None:
    """The pipeline class a spec loads as, from its files: a folder's (a hub id's, a built preset's) index; for a
    single file, ``pipeline_class=`` or FLUX.1's own layout (what the loader infers it as). None for the rest
    (a GGUF, whose quantized tensors stream refuses anyway) and where the index cannot be read."""
    if kind == "checkpoint":
        if options.get("pipeline_class"):
            return options["pipeline_class"]
        return "FluxPipeline" if _flux1_file(components) else None
    if folder is None:
        return None
    try:
        return pipeline_class_name(folder)
    except WeightsError:
        return None


def _flux1_file(components: Mapping[str, list[Tensor]]) -> bool:
    """A single file the loader infers as flux-dev or flux-schnell, both FluxPipeline: diffusers'
    ``infer_diffusers_model_type`` over the headers (the engine imports no torch), ComfyUI's prefix stripped as
    the file was read."""
    names = {t.name: t for tensors in components.values() for t in tensors}
    if FLUX1_MARK not in names or any(n in names for n in NOT_FLUX1):
        return False
    img_in = names.get("img_in.weight")
    guided = "guidance_in.in_layer.bias" in names  # schnell has no guidance embedding, and no variants
    return not (guided and img_in is not None and img_in.dims[1:2] and img_in.dims[1] in NOT_TEXT_TO_IMAGE)
