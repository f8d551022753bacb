"""``random:<preset>``: real diffusers architectures at their published sizes, with random weights.

Benchmarking the daemon on a GPU needs the compute, memory and output sizes of real models, and
nothing can be downloaded. A preset is the published model's shape written down as data (each
component's class and config numbers, the tokenizer's vocabulary size), built in code on the
target device in the target dtype (random initialisation of a 12B transformer is slow on a CPU and
fast on a GPU, and nothing is moved after it) with a generated tokenizer of the real vocabulary
size. It is then saved as safetensors into ``<cache>/models/random-<preset>-v1``
(``preset_tables.folder_name``: ``-v1.1`` for a preset at revision 1) and loaded back
through the ordinary folder loader, so benchmarks measure the path real models take. Saving tens of GB can
be slow: option ``save=0`` skips the round trip and serves the pipeline as built.

The outputs are noise. Everything a user sees says so: the pipeline's name, its
``capabilities.synthetic_weights``, and a warning logged at every load.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from diffusiond.pipelines.base import PipelineError
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.gen_tokenizers import clip_tokenizer, qwen_tokenizer, t5_tokenizer
from diffusiond.pipelines.loaders import load_folder
from diffusiond.pipelines.modelcache import ensure_built
from diffusiond.pipelines.preset_tables import Net, Part, Preset, Proc, Sched, Tok, folder_name, get_preset
from diffusiond.pipelines.qwen_edit import release_layout, stills_processor

log = logging.getLogger(__name__)

NOTICE = "random weights: outputs are noise; for benchmarks only"


# --- building ------------------------------------------------------------------------------------


def _class(name: str) -> type[Any]:
    import diffusers
    import transformers

    cls = getattr(diffusers, name, None) or getattr(transformers, name, None) or _ltx2_class(name)
    if not isinstance(cls, type):
        raise PipelineError(f"neither diffusers nor transformers has a class {name!r} (too old a version?)")
    return cls


def _ltx2_class(name: str) -> Any:
    """LTX-2's text connectors and vocoder, which diffusers keeps in its pipeline's package, not at the top."""
    if not name.startswith("LTX2"):
        return None
    import diffusers.pipelines.ltx2 as ltx2
    import diffusers.pipelines.ltx2.vocoder as vocoder

    return getattr(ltx2, name, None) or getattr(vocoder, name, None)


@contextmanager
def _init_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters on ``device`` in ``dtype`` directly: no float32 copy, no host-side init."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_part(part: Part, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> Any:
    """One component; on ``meta`` a model costs no memory (for counting parameters)."""
    if part is None:
        return None
    if isinstance(part, Tok):
        if part.kind == "clip":
            pad = {"pad_token": part.pad} if part.pad else {}
            return clip_tokenizer(part.size, max_length=part.max_length, **pad)
        if part.kind == "qwen":
            return qwen_tokenizer(part.size, max_length=part.max_length)
        return t5_tokenizer(part.size - part.extra_ids, extra_ids=part.extra_ids, max_length=part.max_length)
    if isinstance(part, Proc):
        return stills_processor(build_part(part.tokenizer), part.image)
    cls = _class(part.cls)
    if isinstance(part, Sched):
        return cls.from_config(dict(part.config))
    with _init_on(torch.device(device), dtype):
        config_class = getattr(cls, "config_class", None)
        if config_class is not None and cls.__module__.startswith("transformers"):
            model = cls(config_class(**part.config))
        else:
            model = cls(**part.config)
    return model.eval()


def parameter_counts(preset: Preset) -> dict[str, int]:
    """Weights per model component, counted on the meta device (no memory, well under a second).

    Saved buffers count too: a published figure counts what the released file holds, and SD 3's
    position table (226M numbers in 3.5 Medium) is a buffer in diffusers, not a parameter.
    """
    counts: dict[str, int] = {}
    for key, part in preset.parts.items():
        if isinstance(part, Net):
            counts[key] = _weights(build_part(part, "meta"))
    return counts


def _weights(model: torch.nn.Module) -> int:
    saved = [
        buffer for module in model.modules() for name, buffer in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set and buffer.is_floating_point()
    ]  # fmt: skip
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in saved)


def build_pipeline(preset: Preset, device: torch.device | str, dtype: torch.dtype) -> Any:
    """The diffusers pipeline with random weights, each model initialised on ``device``."""
    dev = torch.device(device)
    components: dict[str, Any] = {}
    rng_devices = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):  # leave the caller's RNG state alone
        for seed, (key, part) in enumerate(preset.parts.items()):
            torch.manual_seed(seed)
            components[key] = build_part(part, dev, dtype)
    return _class(preset.pipeline)(**components, **preset.pipeline_kwargs)


def _save(preset: Preset, out: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Build on the device, save as safetensors, and free the device before the load."""
    pipe = build_pipeline(preset, device, dtype)
    pipe.save_pretrained(str(out), safe_serialization=True)
    if any(isinstance(part, Proc) for part in preset.parts.values()):
        release_layout(out, pipe.processor)
    del pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synthetic_name(name: str | None, preset: Preset) -> str:
    """A name that says "random" wherever it is shown, whatever the config called the model."""
    if not name:
        return f"random:{preset.name}"
    return name if "random" in name.lower() else f"{name} (random weights)"


def load_preset(
    key: str,
    *,
    name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    options: Mapping[str, str],
    cache_dir: Path | None = None,
) -> DiffusersPipeline:
    """Build (or find in the cache) ``random:<key>`` and wrap it like any loaded model."""
    preset = get_preset(key)
    save = options.get("save", "1")
    if save not in {"0", "1"}:
        raise PipelineError(f"option save must be 0 or 1, not {save!r}")
    label = synthetic_name(name, preset)
    log.warning("%s (%s shapes): %s", label, preset.source, NOTICE)
    if save == "0":
        return DiffusersPipeline(
            build_pipeline(preset, device, dtype), name=label, device=device, dtype=dtype, options=options,
            defaults=preset.defaults, synthetic_weights=True,
        )  # fmt: skip
    if preset.needs_accelerate and importlib.util.find_spec("accelerate") is None:
        raise PipelineError(
            f"random:{preset.name} loads back through from_pretrained, which for {preset.pipeline} needs the "
            "accelerate package: install it, or set option save=0 to use the model as built"
        )
    folder = ensure_built(folder_name(preset), lambda out: _save(preset, out, device, dtype), cache_dir)
    return load_folder(
        folder, name=label, device=device, dtype=dtype, options=options, defaults=preset.defaults,
        synthetic_weights=True,
    )  # fmt: skip
