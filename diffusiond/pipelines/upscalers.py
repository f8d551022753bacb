"""Super-resolution models (ESRGAN and the other architectures spandrel knows), loaded once per worker.

spandrel reads a ``.pth`` or ``.safetensors`` state dict, recognises its architecture from the key
names and builds the model with the right widths and scale, so a user can serve the files that
ComfyUI, chaiNNer or A1111 use without saying what they are. ``.pth`` files go through spandrel's
restricted unpickler (tensors and plain containers only, never a class or a call); TorchScript
(``.pt``) and ``.ckpt`` are not served.

spandrel imports torchvision at its own import, for two architectures that are not upscalers
(LaMa, RestoreFormer). PyPI's torchvision is built for PyPI's CUDA torch and cannot load beside
torch's CPU build (the tests' set-up); without a torchvision that imports, those two names are
bound to stand-ins that raise if ever called, and the stand-in is taken out of ``sys.modules`` at
once, so diffusers and transformers in the same process still see no torchvision.

``python -m diffusiond.pipelines.upscalers NAME=PATH ...`` is the engine's check at start (the
engine never loads torch): it loads each file on the CPU and prints, as JSON, each one's scale and
architecture, or why spandrel cannot read it.

A picture larger than an upscaler's tile runs in overlapping tiles (pipelines/tiles.py); one no
larger runs whole, as it always did, to the byte. On a CUDA device each upscaler is probed once at
load for its working memory per pixel, and each run's tiles are chosen from the device's free memory
with it (``tiles.planned``).
"""

from __future__ import annotations

import json
import logging
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from diffusiond.ipc.upscale import UpscalerSetting
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.tiles import PROBE, TILE_BATCH, planned, smaller, upscale_tiled, whole

log = logging.getLogger(__name__)
SUFFIXES = (".pth", ".safetensors")


def _spandrel() -> Any:
    """spandrel, imported with torchvision's two names stood in for when no torchvision imports."""
    if "spandrel" in sys.modules:
        return sys.modules["spandrel"]
    try:
        import torchvision.transforms.functional  # noqa: F401
    except Exception:  # absent, or a CUDA build beside the CPU torch (it raises RuntimeError)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return _import_without_torchvision()
    import spandrel

    return spandrel


def _import_without_torchvision() -> Any:
    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise PipelineError("this architecture needs torchvision, which is not installed here")

    stub = types.ModuleType("torchvision.transforms.functional")
    stub.normalize = stub.rotate = missing  # type: ignore[attr-defined]
    stub.InterpolationMode = types.SimpleNamespace(BILINEAR="bilinear", NEAREST="nearest")  # type: ignore[attr-defined]
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({"torchvision": types.ModuleType("torchvision"),
                        "torchvision.transforms": types.ModuleType("torchvision.transforms"),
                        "torchvision.transforms.functional": stub})
    try:
        import spandrel
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old
    return spandrel


def load(path: str) -> Any:
    """spandrel's ``ImageModelDescriptor`` for ``path`` on the CPU, or a PipelineError saying why not."""
    p = Path(path)
    if p.suffix.lower() not in SUFFIXES:
        raise PipelineError(f"upscalers are read from {' or '.join(SUFFIXES)} files, not {p.suffix or 'no suffix'}")
    spandrel = _spandrel()
    try:
        model = spandrel.ModelLoader(device="cpu").load_from_file(str(p))
    except spandrel.UnsupportedModelError:
        raise PipelineError("spandrel recognises no architecture in it (not a super-resolution model it knows)") \
            from None
    except Exception as exc:
        raise PipelineError(f"spandrel cannot read it: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, spandrel.ImageModelDescriptor):
        raise PipelineError(f"it is a {model.architecture.name} model, which fills in images; an upscaler maps "
                            "an image to an image")
    if model.input_channels != 3 or model.output_channels != 3:
        raise PipelineError(f"it maps {model.input_channels} channels to {model.output_channels}; an upscaler "
                            "here takes and gives RGB")
    return model


def describe(model: Any) -> dict[str, Any]:
    """What ``GET /v1/upscalers`` shows of a model."""
    return {"scale": int(model.scale), "architecture": str(model.architecture.name), "purpose": str(model.purpose),
            "tags": [str(t) for t in model.tags]}


def per_pixel(model: Any, device: torch.device) -> float | None:
    """Device bytes ``model``'s forward holds per input pixel, output included: the caching allocator's
    peak over one ``PROBE``² picture, above what was allocated before. CUDA only (None elsewhere). Run
    at load, outside any batch, because it resets the peak a batch's working memory is measured by."""
    if device.type != "cuda":
        return None
    x = torch.rand(1, 3, PROBE, PROBE, device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        model(x)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / PROBE**2


def free_bytes(device: torch.device) -> int | None:
    """What the device can still give this process: the driver's free memory plus what torch's caching
    allocator holds unused. None off CUDA."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class Upscalers:
    """The upscalers one worker serves: loaded once at start, kept on the model's device (host while asleep)."""

    def __init__(self, settings: Mapping[str, UpscalerSetting], device: torch.device) -> None:
        self.device = device
        self.settings = dict(settings)
        self.models: dict[str, Any] = {}
        self.per_pixel: dict[str, float] = {}  # each one's probe (CUDA): what tiles.planned plans with
        self.ran: dict[str, tuple[int, int]] = {}  # the tiles each one last ran in: what an OOM retry halves
        for name, s in self.settings.items():
            try:
                self.models[name] = load(s.path).to(device).eval()
            except PipelineError as exc:  # the engine checked every file at start: this is a changed file
                raise PipelineError(f"upscaler {name!r} ({s.path}): {exc}") from None
            measured = per_pixel(self.models[name], device)
            if measured is not None:
                self.per_pixel[name] = measured

    def modules(self) -> list[torch.nn.Module]:
        """What these upscalers hold on the model's device (counted in its weight bytes)."""
        return [model.model for model in self.models.values()]

    def place(self, asleep: bool) -> None:
        for model in self.models.values():
            model.to(torch.device("cpu") if asleep else self.device)

    def upscale(self, name: str, images: torch.Tensor, tiles: tuple[int, int] | None = None,
                between: Callable[[], None] | None = None) -> torch.Tensor:
        """``images`` (N, 3, H, W) float in [0, 1] through upscaler ``name``: (N, 3, H*s, W*s), in [0, 1],
        in the tiles ``serve`` set for it unless ``tiles`` (side, overlap) says otherwise; ``between``
        runs before each forward (a cancelled batch's check, which raises to stop).
        Run in float32: the models are small next to a denoiser, and half precision makes some of
        them (ESRGAN's older checkpoints) overflow to black."""
        found = self.models.get(name)
        if found is None:
            raise PipelineError(f"upscaler {name!r} is not loaded in this worker")

        def model(x: torch.Tensor) -> torch.Tensor:
            if between is not None:
                between()
            return found(x)

        x = images.to(self.device, torch.float32)
        tile, overlap = tiles or self.plan(name, x)
        self.ran[name] = (tile, overlap)
        with torch.inference_mode():
            if whole(tile, x.shape[-2], x.shape[-1]):
                return model(x).clamp_(0, 1)
            return upscale_tiled(model, x, tile, overlap, TILE_BATCH).clamp_(0, 1)

    def tiles(self, name: str) -> tuple[int, int]:
        """The tile side and overlap ``serve`` set for upscaler ``name`` (0: whole pictures)."""
        s = self.settings.get(name)
        return (s.tile, s.overlap) if s is not None else (0, 0)

    def plan(self, name: str, images: torch.Tensor) -> tuple[int, int]:
        """The tiles ``images`` run in: serve's, or smaller where the device's free memory would not hold
        them (``tiles.planned``); serve's as given where nothing was measured (a CPU)."""
        tile, overlap = self.tiles(name)
        need, free = self.per_pixel.get(name), free_bytes(self.device)
        if need is None or free is None:
            return tile, overlap
        n, _, h, w = images.shape
        got = planned(tile, overlap, n, h, w, int(self.models[name].scale), need, free)
        if got != (tile, overlap):
            log.info("upscaler %r: %d %dx%d picture(s) in tiles of %d (overlap %d) rather than %s: %.2f GiB "
                     "free, %.0f bytes per pixel measured", name, n, w, h, got[0], got[1],
                     f"tiles of {tile}" if tile else "whole", free / 2**30, need)
        return got

    def last_tiles(self, name: str) -> tuple[int, int]:
        """The tiles upscaler ``name`` last ran in (serve's before it has run)."""
        return self.ran.get(name) or self.tiles(name)

    def smaller(self, name: str, images: torch.Tensor) -> tuple[int, int] | None:
        """The tiles to retry ``images`` with after running out of memory: half those that ran (None:
        none smaller)."""
        return smaller(*self.last_tiles(name), images.shape[-2], images.shape[-1])


def main(argv: list[str]) -> int:
    result: dict[str, Any] = {}
    for arg in argv:
        name, _, path = arg.partition("=")
        try:
            result[name] = describe(load(path))
        except PipelineError as exc:
            result[name] = {"error": str(exc)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
