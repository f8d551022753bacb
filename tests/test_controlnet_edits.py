"""ControlNets with an input image (image-to-image, inpainting), end to end: a real daemon on ``tiny``
and the dedicated inpainting model ``tiny-inpaint``.

The ControlNet pipelines of an edit (``StableDiffusionControlNetImg2ImgPipeline``,
``StableDiffusionControlNetInpaintPipeline``, built with ``from_pipe`` on the loaded weights) take the
edit's image, mask and strength beside the control picture; the job's input buffer carries both. The
outputs are compared as raw float32 ``npy`` bytes, so "equal" means bit for bit.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
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


def openai_edit(sock: Path, **extra: Any) -> bytes:
    """``client.images.edit`` of the official client, which flattens ``extra_body`` into form fields
    (``control[][name]``, ``control[][image]``, ...): the output's raw uint8 ``npy`` bytes."""
    import httpx
    import openai

    transport = httpx.HTTPTransport(uds=str(sock))
    with httpx.Client(transport=transport, timeout=120) as hc:
        client = openai.OpenAI(base_url="http://diffusiond/v1", api_key="unused", http_client=hc)
        got = client.images.edit(model="tiny", image=("in.png", base64.b64decode(IMG2IMG["image"]), "image/png"),
                                 prompt=str(FAST["prompt"]), size=f"{SIZE}x{SIZE}", response_format="b64_json",
                                 extra_body={"seed": 7, "num_inference_steps": 2, "strength": 0.7,
                                             "output_format": "npy", **extra})
    assert got.data is not None and got.data[0].b64_json is not None
    return base64.b64decode(got.data[0].b64_json)


async def form_edit(s: aiohttp.ClientSession, **fields: Any) -> tuple[int, Any]:
    """A multipart ``/v1/images/edits`` of IMG2IMG with ``fields`` as text (JSON text where not a string)."""
    form = aiohttp.FormData()
    for k, v in {"model": "tiny", "prompt": FAST["prompt"], "size": f"{SIZE}x{SIZE}", "seed": "7",
                 "num_inference_steps": "2", "strength": "0.7", "output_format": "npy", **fields}.items():
        form.add_field(k, v if isinstance(v, str) else json.dumps(v))
    form.add_field("image", base64.b64decode(IMG2IMG["image"]), filename="in.png", content_type="image/png")
    async with s.post("/v1/images/edits", data=form) as r:
        return r.status, await r.json()


async def test_the_edits_form_takes_control_as_json_text_or_as_the_openai_client_flattens_it(sock: Path) -> None:
    """The same edit and control on /v1/jobs and on OpenAI's form, in both of the form's spellings: the
    same pixels; at scale 0 the plain edit's. (The client's flattening keeps no entry boundaries, so
    each entry gives every key.)"""
    control = [{"name": "edges", "image": png(1), "scale": 1.0, "end": 0.5},
               {"name": "blobs", "image": png(3), "scale": 0.5, "end": 1.0}]
    uint8 = {k: v for k, v in FAST.items() if k != "output_dtype"}
    async with http(sock) as s:
        jobs = await first_output(s, {**uint8, "model": "tiny", **IMG2IMG, "control": control})
        status, answer = await form_edit(s, control=control)
        zero_status, zero = await form_edit(s, control=[{"name": "edges", "image": png(1), "scale": 0}])
        plain = await first_output(s, {**uint8, "model": "tiny", **IMG2IMG})
        bad_status, bad = await form_edit(s, control=[{"name": "sketch", "image": png(1)}])
    flat = await asyncio.to_thread(openai_edit, sock, control=control)
    assert status == 200, answer
    assert jobs != plain, "the control changed nothing"
    assert base64.b64decode(answer["data"][0]["b64_json"]) == jobs
    assert flat == jobs
    assert (zero_status, base64.b64decode(zero["data"][0]["b64_json"])) == (200, plain)
    assert (bad_status, bad["error"]["field"]) == (400, "control[0].name") and "known: blobs, edges" in \
        bad["error"]["message"]


def test_an_edit_form_reads_control_as_json_text_or_flattened_and_refuses_entries_it_cannot_tell_apart() -> None:
    from diffusiond.daemon.edge.forms import edits_form
    from diffusiond.daemon.errors import InvalidRequest

    base = [("prompt", "x"), ("model", "tiny")]
    flat = edits_form([*base, ("control[][name]", "u"), ("control[][name]", "edges"), ("control[][image]", "aGk="),
                       ("control[][image]", "aGk="), ("control[][mode]", "2"), ("control[][mode]", "depth")])["control"]
    as_json = edits_form([*base, ("control", '[{"name": "u", "image": "aGk=", "mode": 2}, '
                                             '{"name": "edges", "image": "aGk=", "mode": "depth"}]')])["control"]
    assert [(e.name, e.mode) for e in flat] == [("u", "2"), ("edges", "depth")]
    assert [(e.name, e.mode) for e in as_json] == [("u", 2), ("edges", "depth")]
    for pairs, words in [([("control", "[1]")], "a list"), ([("control[][weight]", "1")], "unexpected form field"),
                         ([("control[][name]", "a"), ("control[][name]", "b"), ("control[][scale]", "1")],
                          "2 name, 1 scale"),
                         ([("ip_adapter[][name]", "a"), ("ip_adapter[][image]", "x"), ("ip_adapter[][name]", "b")],
                          "2 name, 1 image"),
                         ([("control", "[]"), ("control[][name]", "a"), ("control[][scale]", "big")],
                          "Expected `float`")]:
        with pytest.raises(InvalidRequest) as err:
            edits_form([*base, *pairs])
        assert words in err.value.message and err.value.field is not None, err.value.message


async def test_no_input_buffer_outlives_an_edit_with_control(sock: Path, control_daemon: Daemon) -> None:
    """Runs last: the edit's buffer is replaced by the one holding the control pictures too (and that
    one by the reference's), and none may stay open in the engine or the worker once the jobs are over."""
    async with http(sock) as s:
        await until(lambda: idle(s), 60, "the daemon to be idle")
    assert control_daemon.proc is not None
    for pid in (control_daemon.proc.pid, *control_daemon.worker_pids()):
        assert fds_named(pid, "diffusiond-input", "diffusiond-control", "diffusiond-reference") == [], pid
