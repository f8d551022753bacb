"""Tasks made from an input image beside the edits: image-to-video and instruction edits, on a real daemon.

``tiny-video`` (an LTX text-to-video pipeline) also animates an image, through LTXImageToVideoPipeline
built on its weights; ``kontext`` is the tiny FLUX of tests/fluxkit.py saved as a FluxKontextPipeline
folder, loaded as a user's Kontext checkpoint is (its class in model_index.json decides the task).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, wait_job
from fluxkit import build_flux
from test_edits import blocky, openai_edit, png_bytes


@pytest.fixture(scope="module")
def tasks_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("image-tasks")
    kontext = build_flux(tmp / "kontext")
    index = json.loads((kontext / "model_index.json").read_text())
    (kontext / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    args = ["--model", "tiny-video", "--model", f"kontext={kontext}", "--workers", "1", "--job-timeout", "120"]
    with shared_daemon(tmp, args, model_cache) as d:
        yield d


async def job(s: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with s.post("/v1/jobs", json=body) as r:
        return r.status, await r.json()


async def output_bytes(s: aiohttp.ClientSession, body: dict[str, Any]) -> bytes:
    status, made = await job(s, body)
    assert status == 202, made
    done = await wait_job(s, made["id"], timeout=120)
    assert done["status"] == "succeeded", done
    async with s.get(done["outputs"][0]["url"]) as r:
        assert r.status == 200
        return await r.read()


def b64(seed: int) -> str:
    return base64.b64encode(png_bytes(blocky(seed, 64))).decode()


async def test_each_model_lists_the_image_task_it_does(tasks_daemon: Daemon) -> None:
    async with http(tasks_daemon.socket) as s, s.get("/v1/models") as r:
        listed = {m["id"]: m for m in (await r.json())["data"]}
    assert (listed["tiny-video"]["task"], listed["tiny-video"]["edits"]) == ("text-to-video", ["image-to-video"])
    assert (listed["kontext"]["task"], listed["kontext"]["edits"]) == ("instruction-edit", ["instruction-edit"])


async def test_a_video_model_animates_the_image_it_is_sent(tasks_daemon: Daemon) -> None:
    base = {"model": "tiny-video", "prompt": "a boat", "width": 64, "height": 64, "steps": 2, "num_frames": 9,
            "seed": 5, "output_format": "npy"}
    async with http(tasks_daemon.socket) as s:
        plain = await output_bytes(s, base)
        first = await output_bytes(s, {**base, "image": b64(1)})
        again = await output_bytes(s, {**base, "image": b64(1)})
        other = await output_bytes(s, {**base, "image": b64(2)})
        status, refused = await job(s, {**base, "image": b64(1), "strength": 0.5})
    frames = np.load(io.BytesIO(first))
    assert frames.shape[0] == 9, frames.shape  # a video, with the frames asked for
    assert first == again and first != other and first != plain  # the image is what changed it
    assert status == 400 and refused["error"]["field"] == "strength", refused


async def test_an_instruction_edit_takes_an_image_and_no_mask(tasks_daemon: Daemon) -> None:
    base = {"model": "kontext", "prompt": "make it red", "width": 64, "height": 64, "steps": 2, "seed": 3,
            "output_format": "npy"}
    async with http(tasks_daemon.socket) as s:
        one, two = await output_bytes(s, {**base, "image": b64(1)}), await output_bytes(s, {**base, "image": b64(2)})
        assert one != two
        status, no_image = await job(s, base)
        assert status == 400 and no_image["error"]["field"] == "image", no_image
        status, masked = await job(s, {**base, "image": b64(1), "mask": b64(2)})
        assert status == 400 and masked["error"]["field"] == "model" and "inpainting" in masked["error"]["message"]
    # the official openai client's images.edit, unmodified: no mask, one image in, one out
    answer = openai_edit(tasks_daemon.socket, png_bytes(blocky(1, 64)), model="kontext", num_inference_steps=2)
    assert len(answer.data) == 1 and answer.data[0].b64_json
