"""Qwen-Image-Edit served by a real daemon (issue 30): the tiny QwenImageEditPipeline of tests/qwenkit.py, saved as
the folder a user's Qwen/Qwen-Image-Edit download is and loaded through the daemon's own folder loader, without
torchvision (the test environment has none, like a CPU-only install); and ``random:qwen-image-edit``'s build, save
and load, on a scaled-down copy of its table.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import torch
from daemonkit import Daemon, http, shared_daemon
from qwenkit import build_qwen_edit
from test_edits import blocky, png_bytes
from test_image_tasks import job, output_bytes
from test_presets import SMALL_NEW, always, req

from diffusiond.ipc.messages import BatchParams
from diffusiond.pipelines import PipelineError, Task, load_pipeline
from diffusiond.pipelines.preset_tables import PRESETS, Net

W, H = 64, 96  # a picture taller than wide: the size rules hold off the square


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen_edit(tmp_path_factory.mktemp("qwen-folder") / "qwen-edit")


@pytest.fixture(scope="module")
def qwen_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, qwen_folder: Path) -> Iterator[Daemon]:
    args = ["--model", f"qwen-edit={qwen_folder}", "--workers", "1", "--job-timeout", "120",
            "--warmup", f"{W}x{H}:1"]  # an edit-only model warms up through its edit path
    with shared_daemon(tmp_path_factory.mktemp("qwen-edit"), args, model_cache) as d:
        yield d


def test_a_hub_id_not_in_the_cache_yet_loads_its_processor_without_torchvision_on_the_first_start(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, qwen_folder: Path) -> None:
    """With nothing cached, diffusers downloaded the snapshot and built transformers' processor
    itself, which needs torchvision; the start failed saying the model could not be downloaded. The hub here is a
    function that puts the folder in the cache as a download would (no network in tests)."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fetched: list[Any] = []

    def download(repo_id: str, allow_patterns: Any = None, **_: Any) -> str:
        fetched.append(allow_patterns)
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        shutil.copytree(qwen_folder, repo / "snapshots" / ("0" * 40))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
        return str(repo / "snapshots" / ("0" * 40))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    pipe = load_pipeline("someone/qwen-edit", name="q", device="cpu", dtype="float32")
    assert pipe.task is Task.INSTRUCTION_EDIT and fetched == [["model_index.json", "processor/*"]]


def test_a_hub_id_cached_without_its_processor_fetches_it_before_loading(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, qwen_folder: Path) -> None:
    """A download cut short after model_index.json (the case ``serve`` lets through: the index is cached): the
    processor is fetched too, rather than built by diffusers, which needs torchvision."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    repo = cache / "models--someone--qwen-cut"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(qwen_folder, snapshot, ignore=lambda where, _names: ["processor"] if where == str(qwen_folder)
                    else [])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    fetched: list[Any] = []

    def download(repo_id: str, allow_patterns: Any = None, **_: Any) -> str:
        fetched.append(allow_patterns)
        shutil.copytree(qwen_folder / "processor", snapshot / "processor")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    pipe = load_pipeline("someone/qwen-cut", name="q", device="cpu", dtype="float32")
    assert pipe.task is Task.INSTRUCTION_EDIT and fetched == [["model_index.json", "processor/*"]]


def picture(seed: int) -> str:
    return base64.b64encode(png_bytes(blocky(seed, H)[:, :W])).decode()


async def edited(s: aiohttp.ClientSession, body: dict[str, Any]) -> np.ndarray:
    return np.load(io.BytesIO(await output_bytes(s, body)))


def test_warmup_of_an_edit_only_model_runs_an_edit_before_it_is_ready(qwen_daemon: Daemon) -> None:
    """It runs nothing without an input image, so ``--warmup`` failed its start; it warms up on a grey picture."""
    assert f"warmed up {W}x{H} batch 1" in qwen_daemon.log_path.read_text(errors="replace")


async def test_qwen_image_edit_is_listed_as_an_instruction_edit_model(qwen_daemon: Daemon) -> None:
    async with http(qwen_daemon.socket) as s, s.get("/v1/models") as r:
        listed = {m["id"]: m for m in (await r.json())["data"]}
    assert (listed["qwen-edit"]["task"], listed["qwen-edit"]["edits"]) == ("instruction-edit", ["instruction-edit"])


async def test_qwen_image_edit_edits_the_image_it_is_sent_at_its_size(qwen_daemon: Daemon) -> None:
    base = {"model": "qwen-edit", "prompt": "make it red", "steps": 2, "seed": 3, "guidance_scale": 4.0,
            "output_format": "npy"}
    async with http(qwen_daemon.socket) as s:
        one = await edited(s, {**base, "image": picture(1)})
        two = await edited(s, {**base, "image": picture(2)})
        # true CFG: the negative prompt is what the guidance pushes away from
        negative = await edited(s, {**base, "image": picture(1), "negative_prompt": "blurry"})
        # guidance_scale is the true CFG scale (the pipeline's own default is 4.0): at 1.0 there is no negative pass
        unguided = {**base, "image": picture(1), "guidance_scale": 1.0}
        low = await edited(s, unguided)
        low_negative = await edited(s, {**unguided, "negative_prompt": "blurry"})
        status, no_image = await job(s, base)
        assert status == 400 and no_image["error"]["field"] == "image", no_image
        status, masked = await job(s, {**base, "image": picture(1), "mask": picture(2)})
        assert status == 400 and masked["error"]["field"] == "model" and "inpainting" in masked["error"]["message"]
    assert one.shape[:2] == (H, W), one.shape  # the image's size, though the pipeline conditions at 1024²
    assert not np.array_equal(one, two) and not np.array_equal(one, negative)
    assert not np.array_equal(one, low) and np.array_equal(low, low_negative)


def test_the_qwen_image_edit_preset_builds_saves_loads_back_and_edits(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    nets = {k: v for k, v in SMALL_NEW["qwen-image"].parts.items() if isinstance(v, Net)}  # the small qwen-image's
    small = dataclasses.replace(PRESETS["qwen-image-edit"], name="test-qwen-image-edit",
                                parts={**PRESETS["qwen-image-edit"].parts, **nets})
    monkeypatch.setitem(PRESETS, small.name, small)
    monkeypatch.setenv("DIFFUSIOND_CACHE", str(tmp_path))
    pipe = load_pipeline(f"random:{small.name}")
    caps = pipe.capabilities  # no preview factors here for Qwen-Image's latents, as for qwen-image
    assert (pipe.task, caps.edits, caps.size_step, caps.previews) == (Task.INSTRUCTION_EDIT, ("instruction-edit",), 16,
                                                                      False)
    params = BatchParams(width=W, height=H, steps=2, guidance=4.0, edit=Task.INSTRUCTION_EDIT.value)
    (out,) = pipe.edit(params, [req(3)], [(blocky(1, H)[:, :W], None)], always)
    assert tuple(out.shape) == (3, H, W) and torch.isfinite(out).all()
    # admission refuses one step, but may judge by capabilities remembered from another run: the worker refuses too
    one = msgspec.structs.replace(params, steps=1)
    with pytest.raises(PipelineError, match=r"steps=1: model .* takes at least 2 steps"):
        pipe.edit(one, [req(3)], [(blocky(1, H)[:, :W], None)], always)
