"""ControlNets with an input image (image-to-image, inpainting), end to end: a real daemon on ``tiny``
and the dedicated inpainting model ``tiny-inpaint``.

The ControlNet pipelines of an edit (``StableDiffusionControlNetImg2ImgPipeline``,
``StableDiffusionControlNetInpaintPipeline``, built with ``from_pipe`` on the loaded weights) take the
edit's image, mask and strength beside the control picture; the job's input buffer carries both. The
outputs are compared as raw float32 ``npy`` bytes, so "equal" means bit for bit.
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
from controlkit import build_controlnet, mask_png, png
from daemonkit import Daemon, fds_named, first_output, get, http, idle, shared_daemon, until

SIZE = 64
FAST = {"width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy", "output_dtype": "float32"}  # float: tiny's uint8 pictures saturate
IMG2IMG = {"image": png(12), "strength": 0.7}
INPAINT = {"image": png(12), "mask": mask_png()}
EDITS = {"tiny img2img": ("tiny", IMG2IMG), "tiny inpaint": ("tiny", INPAINT),
         "tiny-inpaint": ("tiny-inpaint", {**INPAINT, "strength": 0.8})}


def edges(seed: int = 1, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "edges", "image": png(seed), **extra}]


@pytest.fixture(scope="module")
def control_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, controlnet_dir: Path,
                   ip_adapter_file: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("control-edits")
    args = ["--model", "tiny", "--model", "tiny-inpaint", "--workers", "1", "--max-batch", "4",
            "--batch-wait-ms", "300", "--job-timeout", "300", "--controlnet", f"edges={controlnet_dir}",
            "--controlnet", f"blobs={build_controlnet(root / 'blobs', seed=2)}",
            "--ip-adapter", f"style={ip_adapter_file}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d


@pytest.fixture(scope="module")
def sock(control_daemon: Daemon) -> Path:
    return control_daemon.socket


async def run(s: aiohttp.ClientSession, model: str, edit: dict[str, Any],
              control: list[dict[str, Any]] | None = None, **extra: Any) -> bytes:
    body = {**FAST, "model": model, **edit, **extra}
    if control is not None:
        body["control"] = control
    return await first_output(s, body)


def array(npy: bytes) -> np.ndarray:
    return np.load(io.BytesIO(npy))


@pytest.mark.parametrize("kind", EDITS)
async def test_control_steers_an_edit_and_scale_zero_is_the_plain_edit_bit_for_bit(sock: Path, kind: str) -> None:
    """Scale 0 multiplies every residual by 0, and the ControlNet sibling draws the image's latents
    and the noise from the seed as the plain edit's pipeline does: the same bytes, another pipeline."""
    model, edit = EDITS[kind]
    async with http(sock) as s:
        plain = await run(s, model, edit)
        steered = await run(s, model, edit, edges())
        other = await run(s, model, edit, edges(2))
        zero = await run(s, model, edit, edges(scale=0.0))
        job = (await get(s, "/v1/jobs?limit=1"))[1]["data"][0]
    assert steered != plain, "the control changed nothing"
    assert other != steered, "another control image gave the same output"
    assert zero == plain
    assert job["request"]["task"] == ("inpainting" if "mask" in edit else "image-to-image")
    assert job["request"]["control"][0]["name"] == "edges" and job["request"]["control"][0]["scale"] == 0.0
    if "mask" in edit:  # outside the mask the output is the input's pixels, control or not
        from PIL import Image

        source = np.asarray(Image.open(io.BytesIO(__import__("base64").b64decode(edit["image"]))), np.float32) / 255
        keep = np.ones((SIZE, SIZE), bool)
        keep[SIZE // 4: 3 * SIZE // 4, SIZE // 4: 3 * SIZE // 4] = False
        out = array(steered)
        assert out.shape == (SIZE, SIZE, 3), out.shape
        assert np.array_equal(out[keep], source[keep])


async def test_two_controlnets_act_on_an_inpainting_together(sock: Path) -> None:
    async with http(sock) as s:
        one = await run(s, "tiny-inpaint", INPAINT, edges())
        both = await run(s, "tiny-inpaint", INPAINT, [*edges(), {"name": "blobs", "image": png(3), "end": 0.5}])
    assert both != one, "the second ControlNet changed nothing"


async def test_edits_with_different_controls_at_once_keep_apart(sock: Path) -> None:
    """Sent in the same moment to a worker that batches for 300 ms: each output equals its solo run
    (the batch key holds the edit's task and strength and each control's name, scale and picture)."""
    jobs = [(IMG2IMG, edges()), (IMG2IMG, edges(2)), (IMG2IMG, edges(scale=0.5)), (IMG2IMG, None),
            ({**IMG2IMG, "strength": 1.0}, edges()), (INPAINT, edges()), ({}, edges())]  # 0.7: 1 step of 2, 1.0: 2
    async with http(sock) as s:
        solo = [await run(s, "tiny", e, c) for e, c in jobs]
        together = await asyncio.gather(*(run(s, "tiny", e, c) for e, c in jobs))
    assert list(together) == solo
    assert len(set(solo)) == len(jobs)


async def test_a_reference_steers_an_edit_with_control_and_at_scale_zero_changes_nothing(sock: Path) -> None:
    """An edit's image and mask, the control picture and the IP-Adapter's reference travel in one buffer."""
    ref = {"name": "style", "image": png(5, 48)}
    async with http(sock) as s:
        for edit in (IMG2IMG, INPAINT):
            controlled = await run(s, "tiny", edit, edges())
            steered = await run(s, "tiny", edit, edges(), ip_adapter=[ref])
            zero = await run(s, "tiny", edit, edges(), ip_adapter=[{**ref, "scale": 0.0}])
            assert steered != controlled, "the reference changed nothing"
            assert zero == controlled


async def test_control_on_a_prompt_only_job_of_an_inpainting_model_is_refused_as_without_it(sock: Path) -> None:
    async with http(sock) as s, s.post("/v1/jobs", json={**FAST, "model": "tiny-inpaint", "control": edges()}) as r:
        status, error = r.status, (await r.json())["error"]
    assert (status, error["field"]) == (400, "image"), error


async def test_no_input_buffer_outlives_an_edit_with_control(sock: Path, control_daemon: Daemon) -> None:
    """Runs last: the edit's buffer is replaced by the one holding the control pictures too (and that
    one by the reference's), and none may stay open in the engine or the worker once the jobs are over."""
    async with http(sock) as s:
        await until(lambda: idle(s), 60, "the daemon to be idle")
    assert control_daemon.proc is not None
    for pid in (control_daemon.proc.pid, *control_daemon.worker_pids()):
        assert fds_named(pid, "diffusiond-input", "diffusiond-control", "diffusiond-reference") == [], pid
