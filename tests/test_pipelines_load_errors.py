"""What a failed load says, in the loaders' own process: the part that failed, the file or folder it came from, and
what to do, never advice that does not apply (a single file's missing configs when ``config=`` was given and one
component of it failed to load); and the load's checks leave the arguments they are shown unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.loras import Adapters
from diffusiond.pipelines.pipeline_classes import check_components


def test_a_component_of_config_that_fails_to_load_is_named_not_blamed_on_missing_configs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformer-only checkpoint reads its text encoders and VAE from ``config=``'s folder. One of them damaged
    was reported as "diffusers needs the model's configs ... give config=<folder>", to a user who had given it."""
    from fluxkit import bfl_state_dict, build_flux, tiny_transformer
    from safetensors.torch import save_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = build_flux(tmp_path / "FLUX configs")
    weights = config / "text_encoder" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])  # a download cut short
    checkpoint = tmp_path / "flux1-dev.safetensors"
    save_file({k: v.contiguous() for k, v in bfl_state_dict(tiny_transformer()).items()}, str(checkpoint))

    with pytest.raises(PipelineError) as got:
        load_pipeline(f"{checkpoint},config={config}")
    message = str(got.value)
    assert "diffusers needs the model's configs" not in message, message
    assert "text_encoder" in message and str(config) in message and checkpoint.name in message, message
    assert "download" in message, message  # what to do


def test_a_lora_of_another_base_model_is_refused_saying_what_to_do(tmp_path: Path, model_cache: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from lorakit import build_lora
    from sdxlkit import build_sdxl

    pipe = load_pipeline(str(build_sdxl(tmp_path / "sdxl")))
    adapters = Adapters(pipe.pipe, "sdxl", {}, 2)  # type: ignore[attr-defined]
    why = adapters.register("ink", str(build_lora(tmp_path / "sd15-lora", seed=1)))
    assert "made for another base model than sdxl; serve it with a model of its own family" in why, why
    assert "size mismatch" in why, why  # and what did not fit


def test_checking_a_folders_components_leaves_the_load_arguments_as_given(tmp_path: Path) -> None:
    """An SD folder without its safety checker's image processor loads (test_load_folders.py); the check that
    allows it changed the arguments it was shown, which the load then used."""
    for name in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        (tmp_path / name).mkdir()
    index: dict[str, Any] = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
                             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
                             "tokenizer": ["transformers", "CLIPTokenizer"],
                             "scheduler": ["diffusers", "PNDMScheduler"],
                             "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
                             "feature_extractor": ["transformers", "CLIPImageProcessor"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    passed: dict[str, Any] = {"safety_checker": None, "requires_safety_checker": False}
    before = dict(passed)
    with pytest.raises(PipelineError, match="has no feature_extractor/ folder"):
        check_components(tmp_path, index, passed)  # what the load does not give is looked for on disk
    assert passed == before
    check_components(tmp_path, index, {**passed, "feature_extractor": None})
