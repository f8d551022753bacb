"""What a folder that does not load says, through the loading code a worker runs: a truncated
safetensors file was reported as "Unable to load weights" with a hint to allow .bin weights, which the folder did
not have; the cause (the file shorter than its header says) lay three exceptions down, unsaid.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.tiny import ensure_tiny


@pytest.fixture
def folder(model_cache: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ensure_tiny(), tmp_path / "copy"))


def test_a_truncated_file_is_named_with_its_cause_and_the_check_that_finds_it(folder: Path) -> None:
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(PipelineError) as got:
        load_pipeline(str(folder), device="cpu", dtype="float32")
    message = str(got.value)
    assert "unet/diffusion_pytorch_model.safetensors" in message
    assert "SafetensorError" in message and "not fully covered" in message, message
    assert "diffusiond fit FOLDER" in message
    assert "allow_unsafe_weights" not in message, "the folder has no .bin weights to allow"


def test_pickled_weights_are_named_where_the_folder_has_them(folder: Path) -> None:
    unet = folder / "unet"
    (unet / "diffusion_pytorch_model.safetensors").rename(unet / "diffusion_pytorch_model.bin")
    with pytest.raises(PipelineError) as got:
        load_pipeline(str(folder), device="cpu", dtype="float32")
    message = str(got.value)
    assert "unet/diffusion_pytorch_model.bin is not read: only safetensors weights load by default" in message
    assert "allow_unsafe_weights=1" in message
