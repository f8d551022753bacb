"""What a model's worker keeps on its device beside the pipeline, from the files' headers, before it loads.

Each worker loads the configured ControlNets of its model's family and the image encoders of its family's
IP-Adapters once, and keeps them on its device with every upscaler (worker/process.py counts them in its READY
figure; an IP-Adapter's own weights join the denoiser only while a batch uses them, and are not counted there
nor here). ``offload=stream``'s plan fills the budget it is given with resident blocks, so it is given the budget
less these: a 6.6 GB union ControlNet beside FLUX.1-dev in 24 GiB left 1.4 GiB for activations when it was not
counted. Nothing else is planned in that room: auto chooses among the configurations against the
whole budget, as they leave it to activations, and residency learns their extras from READY.

Only those of the model's family are counted (a FLUX ControlNet is refused by an SDXL model before it loads;
SD 1.5's and SDXL's, one class, are told apart by the text width their config names). The count
still errs high where a family is assumed: a single-file ControlNet counts for both UNet families, and where the
model's pipeline is not known from its files (a single file, a GGUF) all are counted (``assumed``). So a stream
plan asked for whose least does not fit beside such a guess is that least plan, where it fits the budget alone
(model_config.resolve_stream): a guess costs resident blocks, not the model; beside a sure count it is refused at
start with the figures. A pinned model's plan also leaves room for the largest model beside it
(model_config.kept_beside: ``plus``). A file whose size the headers
cannot tell (an upscaler's ``.pth``, a pickle the engine does not open) is named in ``unknown``: what could be
read is still counted, and auto does not stream beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from diffusiond.daemon.residency.sizes import WeightFile, WeightsError, model_weights, read_tensors
from diffusiond.daemon.residency.units import format_bytes
from diffusiond.daemon.values import controlnet_config

UPSCALER_DTYPE: Final = "float32"  # pipelines/upscalers.py runs them in float32, whatever the model's dtype
CONTROL_FAMILIES: Final = frozenset({
    "StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline",
    "StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline",
    "FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"})
"""The pipelines ControlNets are served for (``pipelines/controlnet.FAMILIES``' keys; tests/test_fit.py checks)."""
ADAPTER_FAMILIES: Final = frozenset({"StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxPipeline"})
"""The pipelines IP-Adapters are served for (``pipelines/ip_adapter.FAMILIES``; tests/test_fit.py checks)."""
SDXL_TEXT_WIDTH: Final = 2048  # SDXL's UNet and ControlNets attend to text this wide (SD 1.5's 768, 2.x's 1024)
CONTROL_WEIGHTS: Final = "diffusion_pytorch_model.safetensors"  # what from_pretrained reads of a ControlNet folder
ENCODER_WEIGHTS: Final = "model.safetensors"  # and of an image encoder's
ENCODER_TENSORS: Final = ("vision_model.", "visual_projection.")  # CLIPVisionModelWithProjection's, of a whole CLIP


@dataclass(frozen=True)
class Beside:
    """The bytes kept beside the pipeline on each of its devices, what they are, and what could not be sized."""

    nbytes: int = 0
    what: str = ""
    unknown: str = ""  # the files whose size the headers do not tell ("": none)
    assumed: bool = False  # some counted by an assumed family (a single file's): the count may be high

    def room(self, budget: int) -> int:
        return max(0, budget - self.nbytes)

    def plus(self, what: str, nbytes: int | None, assumed: bool = False) -> Beside:
        """With ``what`` (``nbytes``; None: not known; ``assumed``: a figure that may be high) kept beside too."""
        if nbytes is None:
            return replace(self, unknown="; ".join(filter(None, (self.unknown, f"{what}, not sized before it loads"))))
        return replace(self, nbytes=self.nbytes + nbytes, assumed=self.assumed or assumed,
                       what=" and ".join(filter(None, (self.what, f"{what}'s {format_bytes(nbytes)}"))))

    def note(self, budget: int | None) -> str:
        """Words for the start's log line: the room a plan was given, and from what."""
        if not self.nbytes or budget is None:
            return ""
        return (f" (planned in {format_bytes(self.room(budget))}: the --device-memory budget of "
                f"{format_bytes(budget)} less {self.what}, kept beside it)")


NOTHING_BESIDE: Final = Beside()


def beside(controlnets: Iterable[str], ip_adapters: Iterable[tuple[str, str]], upscalers: Iterable[str],
           dtype: str, pipeline: str | None) -> Beside:
    """ControlNets' paths, IP-Adapters' (weights, image encoder) and upscalers' paths, those of ``pipeline``'s
    family (None: not known, all), at the model's ``dtype`` (upscalers at theirs)."""
    family = None if pipeline is None else _family(pipeline)
    flux = None if family is None else family == "flux"
    controls = {p: _control_family(p) for p in controlnets}  # each config.json read once
    counted: dict[str, int] = {}
    unknown: list[str] = []

    def add(kind: str, sized: Iterable[str], size: Callable[[str], int]) -> None:
        for path in sized:
            try:
                counted[kind] = counted.get(kind, 0) + size(path)
            except WeightsError as exc:
                unknown.append(f"{path} ({exc})")

    if pipeline is None or pipeline in CONTROL_FAMILIES:
        add("ControlNets", [p for p, of in controls.items() if _kept_by(family, of)],
            lambda p: _folder_bytes(Path(p), CONTROL_WEIGHTS, dtype, ()))
    if pipeline is None or pipeline in ADAPTER_FAMILIES:
        adapters = [(w, e) for w, e in ip_adapters if flux is None or _flux_adapter(w) in (flux, None)]
        add("IP-Adapters", [e for _, e in adapters], lambda p: _folder_bytes(Path(p), ENCODER_WEIGHTS, dtype,
                                                                             ENCODER_TENSORS))
    add("upscalers", upscalers, lambda p: model_weights(p, UPSCALER_DTYPE).bytes_at(UPSCALER_DTYPE))
    what = " and ".join(f"the {kind}' {format_bytes(n)}" for kind, n in counted.items() if n)
    # a guess: another family's may be counted where the model's is not known, or a single-file ControlNet's
    assumed = (family is None and bool(counted.get("ControlNets") or counted.get("IP-Adapters"))) or (
        pipeline in CONTROL_FAMILIES and family in ("sd", "sdxl") and None in controls.values())
    return Beside(sum(counted.values()), what, "; ".join(unknown), assumed)


def _family(pipeline: str) -> str:
    return "flux" if pipeline.startswith("Flux") else "sdxl" if pipeline.startswith("StableDiffusionXL") else "sd"


def _kept_by(family: str | None, of: str | None) -> bool:
    """Whether a model of ``family`` (None: not known) keeps a ControlNet of family ``of`` (None, a single file: a
    UNet family's)."""
    return family is None or of == family or (of is None and family != "flux")


def _control_family(path: str) -> str | None:
    """A ControlNet folder's family from its config: FLUX's by class, SDXL's and SD's (one class) by the width of
    the text they attend to; None for a single file (the UNet families': diffusers reads FLUX's from folders)."""
    config = controlnet_config(path)
    named, width = config.get("_class_name"), config.get("cross_attention_dim")
    if isinstance(named, str) and named.startswith("Flux"):
        return "flux"
    if named == "ControlNetUnionModel" or width == SDXL_TEXT_WIDTH:
        return "sdxl"
    return "sd" if isinstance(width, int) else None


def _flux_adapter(path: str) -> bool | None:
    """XLabs' FLUX adapter (its double-stream blocks' layers) or a UNet family's; None where unreadable."""
    try:
        names = read_tensors(path)
    except WeightsError:
        return None
    return any(n.startswith("double_blocks.") or n.endswith("to_k_ip.bias") for n in names)


def _folder_bytes(path: Path, main: str, dtype: str, only: tuple[str, ...]) -> int:
    """What ``from_pretrained`` reads of a component folder: its ``main`` weights file where it has one (a union
    ControlNet's folder may hold a second, ``_promax``, file), only the tensors named ``only``
    where given and present (a whole CLIP's text tower is not loaded by its vision model); else every weights
    file, as ``sizes.model_weights`` counts a folder."""
    file = path / main if path.is_dir() else path
    if not file.is_file():
        return model_weights(path, dtype).bytes_at(dtype)
    if only:
        tensors = read_tensors(file)
        picked = [(kind, nbytes) for name, (kind, nbytes, _) in tensors.items() if name.startswith(only)]
        by_dtype: dict[str, int] = {}
        for kind, nbytes in picked:
            by_dtype[kind] = by_dtype.get(kind, 0) + nbytes
        if picked:  # counted as sizes counts a file, by dtype
            return WeightFile(file, by_dtype, len(picked)).bytes_at(dtype)
    return model_weights(file, dtype).bytes_at(dtype)
