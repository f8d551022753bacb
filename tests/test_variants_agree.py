"""The weights files a model loads from are the ones the engine sizes it by, whatever variants its folder holds.

The engine counts a model's bytes from its files' headers before any worker loads it (daemon/residency/sizes.py), and
the worker loads it through diffusers (pipelines/loaders.py), which takes one ``variant=`` for the whole pipeline.
Each folder here is the embedded ``tiny`` model saved and rearranged as downloads leave it, every variant's file
holding values of its own, so the values loaded tell which file each component was read from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_load_folders import loaded

from diffusiond.daemon.residency.sizes import model_weights
from diffusiond.pipelines.tiny import ensure_tiny
from diffusiond.pipelines.variants import pipeline_variants

COMPONENTS = ("unet", "vae", "text_encoder")
STORED = {"": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
OFFSET = {"": 0.0, "fp16": 1.0, "bf16": 2.0}  # every variant's values differ from every other's

LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    # component -> the variants of its weights in the folder ("" the plain files)
    "fp16 beside every component's plain files": dict.fromkeys(COMPONENTS, ("", "fp16")),
    "fp16 files only": dict.fromkeys(COMPONENTS, ("fp16",)),
    "fp16 for some components": {"unet": ("", "fp16"), "vae": ("fp16",), "text_encoder": ("",)},
    "two variants, each the only one of a component": {"unet": ("", "fp16"), "vae": ("bf16",), "text_encoder": ("",)},
    "no variants": dict.fromkeys(COMPONENTS, ("",)),
}


@pytest.fixture(scope="module")
def tiny_pipe(model_cache: Path) -> Any:
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(ensure_tiny(model_cache)), safety_checker=None)


def weights_name(component: Path, variant: str) -> str:
    """The file diffusers (or transformers, for the text encoder) reads for ``variant``."""
    stem = "model" if component.name == "text_encoder" else "diffusion_pytorch_model"
    return f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors"


def build(tiny_pipe: Any, folder: Path, layout: dict[str, tuple[str, ...]]) -> None:
    tiny_pipe.save_pretrained(str(folder), safe_serialization=True)
    for name, variants in layout.items():
        state = {k: v.contiguous() for k, v in getattr(tiny_pipe, name).state_dict().items()}
        plain = folder / name / weights_name(folder / name, "")
        for variant in variants:
            values = {k: (v + OFFSET[variant]).to(STORED[variant]) if v.is_floating_point() else v
                      for k, v in state.items()}
            save_file(values, str(folder / name / weights_name(folder / name, variant)))
        if "" not in variants:
            plain.unlink()


def read_from(component: Path, module: torch.nn.Module, dtype: torch.dtype) -> str:
    """The file among ``component``'s whose values ``module`` holds, as loading at ``dtype`` converts them."""
    state = module.state_dict()
    matches = [f.name for f in sorted(component.glob("*.safetensors"))
               if all(torch.equal(state[k], v.to(dtype) if v.is_floating_point() else v)
                      for k, v in load_file(str(f)).items() if k in state)]
    assert len(matches) == 1, f"{component.name} holds the values of {matches}"
    return matches[0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_files_a_model_loads_are_the_files_the_engine_counts(tiny_pipe: Any, tmp_path: Path, layout: str,
                                                                dtype: str) -> None:
    folder = tmp_path / "model"
    build(tiny_pipe, folder, LAYOUTS[layout])
    counted = model_weights(folder, dtype)
    pipe, _ = loaded(str(folder), dtype)
    for name in COMPONENTS:
        read = read_from(folder / name, getattr(pipe.pipe, name), getattr(torch, dtype))
        assert [f.path.name for f in counted.components[name]] == [read], name
        # the variant the dtype implies where the component has it, else its plain files, else what it has
        offered = LAYOUTS[layout][name]
        want = {"float16": "fp16", "bfloat16": "bf16"}.get(dtype, "")
        best = want if want in offered else "" if "" in offered else offered[0]
        assert read == weights_name(folder / name, best), name


def test_one_variant_for_the_pipeline_and_the_components_it_does_not_reach(tmp_path: Path) -> None:
    """What the loader asks diffusers for: one ``variant=``, which reaches every component with files of it, and the
    components whose best files that would miss, each with its own."""
    for name, names in {"unet": ["diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors"],
                        "vae": ["diffusion_pytorch_model.fp16.safetensors"], "text_encoder": ["model.safetensors"],
                        "tokenizer": ["vocab.json"]}.items():
        (tmp_path / name).mkdir()
        for f in names:
            (tmp_path / name / f).write_bytes(b"")
    names = ["unet", "vae", "text_encoder", "tokenizer"]
    assert pipeline_variants(tmp_path, names, "float16") == ("fp16", {})
    # at float32 the plain files, but the vae has only fp16 ones, and variant="fp16" would read the unet's too
    assert pipeline_variants(tmp_path, names, "float32") == (None, {"vae": "fp16"})
    assert pipeline_variants(tmp_path, ["text_encoder", "tokenizer"], "float16") == (None, {})


def test_a_safety_checker_the_loader_skips_is_not_counted(tiny_pipe: Any, tmp_path: Path) -> None:
    """The loader passes ``safety_checker=None`` (its outputs would be discarded), so its weights (1.2 GB in SD 1.5)
    take no memory and the engine must not count them against the budget."""
    folder = tmp_path / "model"
    build(tiny_pipe, folder, LAYOUTS["no variants"])
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(
        {**index, "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"]}))
    (folder / "safety_checker").mkdir()
    save_file({"w": torch.zeros(1000)}, str(folder / "safety_checker" / "model.safetensors"))
    assert "safety_checker" not in model_weights(folder, "float32").components
    pipe, _ = loaded(str(folder))
    assert pipe.pipe.safety_checker is None
