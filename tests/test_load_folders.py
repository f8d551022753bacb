"""Model folders as users have them on disk, loaded through the code a worker runs (``load_pipeline``).

No weights can be downloaded here, so each layout is built from the embedded ``tiny`` model (or tiny SDXL, tiny
FLUX) with diffusers' own ``save_pretrained`` and rearranged the way downloads leave it: only the fp16 variant
files (``hf download --include "*.fp16.safetensors"``), an HF cache snapshot of symlinks into ``blobs/``, a
component folder left out, a single-file checkpoint that holds only the transformer (BFL's flux1-dev.safetensors).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.base import weight_bytes
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.load_progress import reporting
from diffusiond.pipelines.tiny import ensure_tiny


@pytest.fixture(scope="module")
def tiny_pipe(model_cache: Path) -> Any:
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(ensure_tiny(model_cache)), safety_checker=None)


@pytest.fixture(scope="module")
def tiny_half(model_cache: Path) -> Any:
    """What fp16 variant files hold: the weights in float16 (``variant=`` alone only names the files)."""
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(ensure_tiny(model_cache)), safety_checker=None,
                                                   torch_dtype=torch.float16)


def weights(pipe: Any) -> dict[str, torch.Tensor]:
    return {f"{c}.{k}": v for c in ("unet", "vae", "text_encoder") for k, v in getattr(pipe, c).state_dict().items()}


def loaded(spec: str, dtype: str = "float32") -> tuple[Any, list[int]]:
    reports: list[int] = []
    with reporting(reports.append):
        pipe = load_pipeline(spec, dtype=dtype)
    return pipe, reports


# --- fp16 variant files ---------------------------------------------------------------------------


def test_a_folder_of_fp16_variant_files_only_loads_them_and_reports_its_whole_size(tiny_half: Any,
                                                                                  tmp_path: Path) -> None:
    """Every component saved as ``*.fp16.safetensors`` (the unet sharded, with its ``index.fp16.json``): the load
    failed on "no file named model.safetensors", though the engine sizes such a folder by its fp16 files."""
    folder = tmp_path / "fp16 only"
    tiny_half.save_pretrained(str(folder), variant="fp16", safe_serialization=True)
    for f in (folder / "unet").glob("*.safetensors"):
        f.unlink()
    tiny_half.unet.save_pretrained(str(folder / "unet"), variant="fp16", max_shard_size="50KB")
    assert (folder / "unet" / "diffusion_pytorch_model.safetensors.index.fp16.json").is_file()
    assert all(".fp16" in f.name for f in folder.glob("*/*.safetensors")), "only variant files"

    pipe, reports = loaded(str(folder))
    assert pipe.dtype == torch.float32
    want = weights(tiny_half)
    got = weights(pipe.pipe)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k].float()) for k in want), "the fp16 files' values, at float32"
    # the load's progress: a report per component, ending at what the loaded model holds
    assert len(reports) == 3 and reports == sorted(reports) and reports[-1] == weight_bytes(pipe)


def test_the_variant_read_is_the_one_the_dtype_implies_where_both_are_there(tiny_pipe: Any, tiny_half: Any,
                                                                          tmp_path: Path) -> None:
    """The engine sizes a float16 model by its fp16 files and a float32 one by its plain files
    (daemon/residency/sizes.choose_variant): the loader reads the same ones. The fp16 UNet here holds other values."""
    folder = tmp_path / "both"
    tiny_pipe.save_pretrained(str(folder), safe_serialization=True)
    shifted = {k: v + 1 for k, v in tiny_half.unet.state_dict().items()}
    tiny_half.save_pretrained(str(folder), variant="fp16", safe_serialization=True)
    from safetensors.torch import save_file

    save_file(shifted, str(folder / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    half = load_pipeline(str(folder), dtype="float16").pipe.unet.state_dict()  # type: ignore[attr-defined]
    full = load_pipeline(str(folder), dtype="float32").pipe.unet.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(half[k], v) for k, v in shifted.items()), "float16 reads the fp16 files"
    assert all(torch.equal(full[k], v) for k, v in tiny_pipe.unet.state_dict().items()), "float32: the plain files"


def snapshot(cache: Path, repo: str, source: Path) -> Path:
    """``source`` as the HF cache keeps a download: files in ``blobs/`` by hash, the snapshot's files symlinks."""
    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / ("0" * 40)
    (base / "blobs").mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("0" * 40)
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snap


def test_an_hf_cache_snapshot_of_fp16_files_loads_by_its_folder_and_its_hub_id(tiny_half: Any, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    source = tmp_path / "saved"
    tiny_half.save_pretrained(str(source), variant="fp16", safe_serialization=True)
    cache = tmp_path / "hub cache"
    snap = snapshot(cache, "someone/tiny-fp16", source)
    assert (snap / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_symlink()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    want = weights(tiny_half)
    for spec in (str(snap), "someone/tiny-fp16"):
        got = weights(load_pipeline(spec).pipe)  # type: ignore[attr-defined]
        assert all(torch.equal(got[k], want[k].float()) for k in want), spec


# --- a component folder left out ------------------------------------------------------------------


def sdxl_folder(root: Path) -> Path:
    from sdxlkit import build_sdxl

    return build_sdxl(root / "sdxl")


@pytest.mark.parametrize(("model", "component"), [
    ("tiny", "tokenizer"),  # was loaded with a 2-token vocabulary: every prompt the same unknown tokens
    ("tiny", "vae"),  # was "no file named config.json found in directory <the model's folder>"
    ("sdxl", "text_encoder_2"),  # was "no file named model.safetensors found in directory <the model's folder>"
])
def test_a_folder_missing_a_component_is_refused_naming_it(model_cache: Path, tmp_path: Path, model: str,
                                                            component: str) -> None:
    folder = Path(shutil.copytree(ensure_tiny(model_cache) if model == "tiny" else sdxl_folder(tmp_path),
                                  tmp_path / "copy"))
    shutil.rmtree(folder / component)
    with pytest.raises(PipelineError) as got:
        load_pipeline(str(folder))
    message = str(got.value)
    assert f"has no {component}/ folder" in message and str(folder) in message, message
    assert "model_index.json" in message and "download" in message, message


def test_an_sd_folder_without_its_safety_checker_and_feature_extractor_folders_loads(tiny_pipe: Any,
                                                                                    tmp_path: Path) -> None:
    """SD 1.5 folders name both (runwayml's and its copies); people delete the two to save 1.2 GB. The safety
    checker is never loaded, and its image processor serves nothing else here (an IP-Adapter brings its own)."""
    folder = tmp_path / "sd15"
    tiny_pipe.save_pretrained(str(folder), safe_serialization=True)
    index = json.loads((folder / "model_index.json").read_text())
    index.update(safety_checker=["stable_diffusion", "StableDiffusionSafetyChecker"],
                 feature_extractor=["transformers", "CLIPImageProcessor"], requires_safety_checker=True)
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = load_pipeline(str(folder))
    assert pipe.pipe.feature_extractor is None and pipe.pipe.safety_checker is None  # type: ignore[attr-defined]


def test_an_unknown_pipeline_class_is_refused_saying_what_to_do(tiny_pipe: Any, tmp_path: Path) -> None:
    folder = tmp_path / "custom"
    tiny_pipe.save_pretrained(str(folder), safe_serialization=True)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "MyFancyPipeline"}))
    with pytest.raises(PipelineError) as got:
        load_pipeline(str(folder))
    message = str(got.value)
    assert "'MyFancyPipeline'" in message and str(folder / "model_index.json") in message
    assert "pip install -U diffusers" in message, message


# --- a single-file checkpoint of the transformer alone ----------------------------------------------


def test_a_transformer_only_checkpoint_loads_the_rest_from_the_config_folder(
        model_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """BFL's flux1-dev.safetensors holds the transformer alone, under BFL's names. The daemon says to give the
    configs as ``config=<diffusers folder>``; that failed anyway ("Failed to load CLIPTextModel. Weights for this
    component appear to be missing in the checkpoint"): diffusers looks in that folder only for weights named
    diffusion_pytorch_model.*, which a text encoder's are not, and then fails on the VAE too."""
    from diffusers import AutoencoderKL
    from diffusers.loaders import single_file_model
    from fluxkit import TRANSFORMER, bfl_state_dict, build_flux, tiny_transformer
    from safetensors.torch import save_file
    from transformers import CLIPTextModel, T5EncoderModel

    from diffusiond.pipelines.loaders import flux_from_bfl

    # diffusers' converter splits each single block at FLUX.1's width (3072) written into its code; the tiny
    # transformer is narrower, so its file is converted by the width-agnostic split the GGUF loader uses
    width = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
    monkeypatch.setitem(single_file_model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"],
                        "checkpoint_mapping_fn", lambda checkpoint, **_: flux_from_bfl(checkpoint, width))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = build_flux(tmp_path / "FLUX configs")
    source = tiny_transformer()
    checkpoint = tmp_path / "flux1 dév.safetensors"
    save_file({k: v.contiguous() for k, v in bfl_state_dict(source).items()}, str(checkpoint))

    reports: list[int] = []
    with reporting(reports.append):
        pipe = load_pipeline(f"{checkpoint},config={config}")
    inner = pipe.pipe  # type: ignore[attr-defined]
    assert type(inner).__name__ == "FluxPipeline"
    assert all(torch.equal(inner.transformer.state_dict()[k], v) for k, v in source.state_dict().items())
    for name, cls in (("vae", AutoencoderKL), ("text_encoder", CLIPTextModel), ("text_encoder_2", T5EncoderModel)):
        ref = cls.from_pretrained(str(config), subfolder=name).state_dict()
        mine = getattr(inner, name).state_dict()
        assert all(torch.equal(mine[k], v) for k, v in ref.items()), name
    assert reports and reports[-1] == weight_bytes(pipe), "every component read counts toward the load's progress"


def test_a_gguf_loads_progress_counts_its_transformer(tmp_path: Path) -> None:
    """The GGUF transformer is read outside diffusers' component loaders: the reports left it out (the largest
    part: 12 GB of FLUX's 22), so a job waiting for the load saw it stop short and jump to the end at READY."""
    pytest.importorskip("gguf")
    from fluxkit import build_flux, tiny_transformer, write_gguf

    flux = build_flux(tmp_path / "flux")
    write_gguf(tiny_transformer(), tmp_path / "t.gguf")
    reports: list[int] = []
    with reporting(reports.append):
        pipe = load_pipeline(f"{tmp_path / 't.gguf'},base={flux}")
    assert len(reports) == 4 and reports == sorted(reports), reports  # the transformer, then 2 encoders and the VAE
    assert reports[-1] == weight_bytes(pipe)
