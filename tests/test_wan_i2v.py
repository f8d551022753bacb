"""Wan image-to-video on a real daemon (issue 30): tiny Wan folders built in code (tests/wankit.py), loaded as a
user's Wan checkpoint is (``--model NAME=FOLDER``; the class in model_index.json decides the task).

A Wan 2.2 TI2V folder (WanPipeline with ``expand_timesteps``) animates an image through WanImageToVideoPipeline
built on its weights; a Wan 2.1 T2V folder cannot and says so; a Wan 2.1 I2V folder (with its CLIP image
encoder) does image-to-video only. Batches of them give each request what it gets alone.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from daemonkit import Daemon, http, shared_daemon, wait_job
from test_image_tasks import b64, job
from test_lora import assert_same_but_rounding
from wankit import build_wan

BASE = {"prompt": "a boat", "width": 64, "height": 64, "steps": 2, "num_frames": 5, "output_format": "npy"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wan")
    return {kind: build_wan(tmp / kind, kind) for kind in ("t2v", "ti2v", "i2v")}


@pytest.fixture(scope="module")
def wan_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
               folders: dict[str, Path]) -> Iterator[Daemon]:
    args = [a for kind, folder in folders.items() for a in ("--model", f"{kind}={folder}")]
    with shared_daemon(tmp_path_factory.mktemp("wan-daemon"), [*args, "--workers", "1", "--batch-wait-ms", "300",
                                                               "--job-timeout", "120"], model_cache) as d:
        yield d


async def outputs(s: aiohttp.ClientSession, body: dict[str, Any]) -> list[tuple[bytes, int, int]]:
    """Each output's bytes, seed and batch."""
    status, made = await job(s, {**BASE, **body})
    assert status == 202, made
    done = await wait_job(s, made["id"], timeout=120)
    assert done["status"] == "succeeded", done
    got = []
    for out in done["outputs"]:
        async with s.get(out["url"]) as r:
            assert r.status == 200
            got.append((await r.read(), out["seed"], out["batch"]))
    return got


async def test_each_wan_folder_lists_what_it_does(wan_daemon: Daemon) -> None:
    async with http(wan_daemon.socket) as s, s.get("/v1/models") as r:
        listed = {m["id"]: (m["task"], m["edits"]) for m in (await r.json())["data"]}
    assert listed["ti2v"] == ("text-to-video", ["image-to-video"])  # Wan 2.2 TI2V: the "I" too
    assert listed["t2v"] == ("text-to-video", [])  # a Wan 2.1 T2V transformer has no input for an image
    assert listed["i2v"] == ("image-to-video", ["image-to-video"])


async def test_ti2v_animates_the_image_and_batches_keep_requests_apart(wan_daemon: Daemon) -> None:
    async with http(wan_daemon.socket) as s:
        [(plain, _, _)] = await outputs(s, {"model": "ti2v", "seed": 5})
        [(first, _, _)] = await outputs(s, {"model": "ti2v", "seed": 5, "image": b64(1)})
        [(other, _, _)] = await outputs(s, {"model": "ti2v", "seed": 5, "image": b64(2)})
        [(sixth, _, _)] = await outputs(s, {"model": "ti2v", "seed": 6, "image": b64(1)})
        pair = await outputs(s, {"model": "ti2v", "seed": 5, "image": b64(1), "n": 2})  # failed: N² image latents
        status, refused = await job(s, {**BASE, "model": "t2v", "image": b64(1)})
    assert np.load(io.BytesIO(first)).shape[0] == 5  # a video, of the frames asked for
    assert first not in (plain, other)  # the image is what changed it
    assert [seed for _, seed, _ in pair] == [5, 6] and len({b for _, _, b in pair}) == 1
    for (got, seed, _), alone in zip(pair, (first, sixth), strict=True):
        assert_same_but_rounding(got, alone, f"seed {seed} of n=2 against it alone")
    assert status == 400 and refused["error"]["field"] == "model", refused
    assert "cannot do image-to-video (it does text-to-video)" in refused["error"]["message"], refused


async def test_wan21_i2v_runs_batches_of_requests_each_as_alone(wan_daemon: Daemon) -> None:
    """n=2 and two requests with different images in one forward: each output is the one it gets alone (the
    pipeline made N² image embeddings and latents for N requests, and failed)."""
    async with http(wan_daemon.socket) as s:
        alone = {(img, seed): (await outputs(s, {"model": "i2v", "seed": seed, "image": b64(img)}))[0][0]
                 for img, seed in ((1, 5), (1, 6), (2, 7))}
        pair = await outputs(s, {"model": "i2v", "seed": 5, "image": b64(1), "n": 2})
        apart = await asyncio.gather(*(outputs(s, {"model": "i2v", "seed": seed, "image": b64(img)})
                                       for img, seed in ((1, 5), (2, 7))))
        status, no_image = await job(s, {**BASE, "model": "i2v"})
    assert alone[1, 5] != alone[2, 7] and alone[1, 5] != alone[1, 6]
    assert [seed for _, seed, _ in pair] == [5, 6]
    for got, seed, _ in pair:
        assert_same_but_rounding(got, alone[1, seed], f"seed {seed} of n=2 against it alone")
    for [(got, seed, _)], img in zip(apart, (1, 2), strict=True):
        assert_same_but_rounding(got, alone[img, seed], f"image {img} batched against it alone")
    assert status == 400 and no_image["error"]["field"] == "image", no_image


def test_clip_sees_the_pictures_pixels(folders: dict[str, Path]) -> None:
    """The CLIP processor normalises 8-bit pixels (rescale by 1/255, then its mean and std); it was handed the
    [0, 1] batch and rescaled it again, so the encoder saw a near-black picture (every value about -1.8)."""
    from diffusiond.ipc.messages import BatchParams, RequestSpec
    from diffusiond.pipelines.registry import load_pipeline

    model: Any = load_pipeline(str(folders["i2v"]), name="i2v")
    seen: list[torch.Tensor] = []
    model.pipe.image_encoder.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["pixel_values"].clone()), with_kwargs=True)
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2)]
    params = BatchParams(width=64, height=64, steps=1, guidance=1.0, num_frames=5, edit="image-to-video")
    requests = [RequestSpec(request_id=f"r{k}", prompt="a boat", seed=k) for k in range(2)]
    out = model.edit(params, requests, [(p, None) for p in pictures], lambda _i, _t: True)
    assert len(out) == 2 and len(seen) == 2  # one encoding per picture
    processor = model.pipe.image_processor
    for picture, pixels in zip(pictures, seen, strict=True):
        want = processor(images=picture, return_tensors="pt")["pixel_values"]
        assert torch.allclose(pixels, want, atol=1e-5)
        assert pixels.std() > 0.1 and pixels.mean() > -1.0  # its pixels, not a near-black picture at about -1.8


def test_the_ti2v_preset_animates_an_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """``random:wan2.2-5b`` (at test size: its pipeline, ``expand_timesteps`` and Wan 2.2 VAE layout kept)
    declares image-to-video and makes a video from a picture."""
    from test_presets import SMALL_NEW

    from diffusiond.ipc.messages import BatchParams, RequestSpec
    from diffusiond.pipelines.preset_tables import PRESETS
    from diffusiond.pipelines.registry import load_pipeline

    preset = SMALL_NEW["wan2.2-5b"]
    monkeypatch.setitem(PRESETS, preset.name, preset)
    model: Any = load_pipeline(f"random:{preset.name},save=0")
    assert model.capabilities.edits == ("image-to-video",)
    picture = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    params = BatchParams(width=64, height=64, steps=1, guidance=5.0, num_frames=5, edit="image-to-video")
    (out,) = model.edit(params, [RequestSpec(request_id="r", prompt="a boat", seed=1)], [(picture, None)],
                        lambda _i, _t: True)
    assert tuple(out.shape) == (5, 3, 64, 64)
