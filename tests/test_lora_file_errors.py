"""LoRA files as users have them, registered with a worker's adapters (``pipelines/loras.py``), in process.

The engine reads a LoRA's header only (daemon/core/loras.py), so a file whose header is whole but whose tensors
were cut short (a download stopped) and a LoRA of another base model both reach the worker; each must come back as
a reason that says what is wrong and what to do, and leave the model serving as before.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from diffusiond.ipc.messages import BatchParams, LoraRef, RequestSpec
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.loras import Adapters

P = BatchParams(width=64, height=64, steps=2, guidance=5.0)


@pytest.fixture(scope="module")
def sd15_lora(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    from lorakit import build_lora

    return build_lora(tmp_path_factory.mktemp("sd15-lora") / "ink", seed=1)


def image(pipe: Any) -> torch.Tensor:
    return pipe.run(P, [RequestSpec(request_id="r", prompt="a fox", seed=3)], lambda _s, _t: True)[0].cpu()


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_a_truncated_lora_is_refused_naming_the_file_and_the_cause(sd15_lora: Path, tmp_path: Path,
                                                                  layout: str) -> None:
    """Was "OSError: Unable to load weights from checkpoint file for '<file>' at '<file>'.": no word of the
    cause (the file is shorter than its header says) nor of what to do."""
    from lorakit import to_kohya

    whole = sd15_lora / "pytorch_lora_weights.safetensors" if layout == "diffusers" else \
        to_kohya(sd15_lora, tmp_path / "kohya" / "ink.safetensors")
    cut = tmp_path / "cut" / "ink lora.safetensors"
    cut.parent.mkdir()
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    pipe = load_pipeline("tiny")
    adapters = Adapters(pipe.pipe, "tiny", {}, 2)  # type: ignore[attr-defined]
    why = adapters.register("ink", str(cut))
    assert f"{cut} is truncated or corrupt" in why and "download it again" in why, why
    assert "not fully covered" in why, why  # the cause, from safetensors
    assert adapters.loaded == {} and adapters._adapter_names() == set()


def test_an_sd15_lora_on_sdxl_is_refused_as_made_for_another_model_and_sdxl_serves_on(
        sd15_lora: Path, tmp_path: Path, model_cache: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from sdxlkit import build_sdxl

    pipe = load_pipeline(str(build_sdxl(tmp_path / "sdxl")))
    before = image(pipe)
    adapters = Adapters(pipe.pipe, "sdxl", {}, 2)  # type: ignore[attr-defined]
    why = adapters.register("ink", str(sd15_lora))
    assert "made for another base model than sdxl" in why, why
    assert "size mismatch" in why and "more tensors" in why, why  # the first mismatch, and a count of the rest
    adapters.activate(())
    assert adapters._adapter_names() == set()
    with pytest.raises(Exception, match="not registered"):
        adapters.activate((LoraRef(name="ink", weight=1.0),))
    assert torch.equal(image(pipe), before), "the base model, untouched"
