"""IP-Adapters with ControlNets and with edits, end to end: a real daemon on ``tiny``.

``style`` is ipadapterkit.py's adapter and ``edges`` controlkit.py's ControlNet, both built for
tiny. The adapter goes into the UNet that the ControlNet and edit pipelines share with the model
(``from_pipe``), so what these tests watch is that a reference acts on those pipelines too, and that
a batch without one runs as if the adapter had never been in (bit for bit: the outputs are compared
as raw float32 ``npy`` bytes). The plain jobs run first, before any adapter job, on a fresh daemon.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, fds_named, http, idle, shared_daemon, submit, until, wait_job

SIZE = 64
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy", "output_dtype": "float32"}  # float: tiny's uint8 pictures saturate


def png(seed: int, side: int = SIZE, mode: str = "RGB") -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    if mode == "L":  # a mask without alpha: white (the centre square) is repainted
        a = np.zeros((side, side), np.uint8)
        a[side // 4: 3 * side // 4, side // 4: 3 * side // 4] = 255
    else:
        a = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


CONTROL = {"control": [{"name": "edges", "image": png(11)}]}
IMG2IMG = {"image": png(12), "strength": 0.7}
INPAINT = {"image": png(12), "mask": png(0, mode="L")}
KINDS = {"control": CONTROL, "img2img": IMG2IMG, "inpaint": INPAINT, "text": {}}


def ref(scale: float = 1.0, seed: int = 1) -> dict[str, Any]:
    return {"ip_adapter": [{"name": "style", "image": png(seed, 48), "scale": scale}]}


@pytest.fixture(scope="module")
def combo_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, ip_adapter_file: Path,
                 controlnet_dir: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ip-combo-daemon")
    args = ["--model", "tiny", "--workers", "1", "--max-batch", "4", "--batch-wait-ms", "300", "--job-timeout", "300",
            "--ip-adapter", f"style={ip_adapter_file}", "--controlnet", f"edges={controlnet_dir}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d


@pytest.fixture(scope="module")
def sock(combo_daemon: Daemon) -> Path:
    return combo_daemon.socket


async def run(s: aiohttp.ClientSession, *parts: dict[str, Any]) -> bytes:
    body = dict(FAST)
    for p in parts:
        body.update(p)
    job = await wait_job(s, (await submit(s, body))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return await r.read()


async def test_a_reference_steers_control_and_edits_and_leaves_no_trace_in_plain_jobs(sock: Path) -> None:
    async with http(sock) as s:
        before = {k: await run(s, v) for k, v in KINDS.items()}  # before any adapter job
        steered: dict[str, list[bytes]] = {}
        after: dict[str, list[bytes]] = {}
        # each kind with the reference, each followed by a plain job of another kind (the adapter comes
        # out of the UNet that pipeline shares), each after a plain one (it goes back in)
        order = ["text", "control", "img2img", "inpaint", "control", "text"]
        for k, plain_next in itertools.pairwise(order):
            steered.setdefault(k, []).append(await run(s, KINDS[k], ref()))
            after.setdefault(plain_next, []).append(await run(s, KINDS[plain_next]))
        zero = {k: await run(s, KINDS[k], ref(0.0)) for k in ("control", "img2img", "inpaint")}
    assert len(set(before.values())) == 4
    for k, plain in before.items():
        assert steered[k][0] != plain, f"the reference changed nothing in {k}"
        assert len(set(steered[k])) == 1, f"{k} with the same reference gave another output the second time"
        assert all(a == plain for a in after[k]), f"a plain {k} job after an adapter job differs"
    for k, out in zero.items():  # the IP attention is added times the scale: 0 adds exact zeros
        assert out == before[k], f"{k} with the reference at scale 0 is not the plain {k} output"


async def test_control_and_edit_jobs_with_and_without_a_reference_at_once_keep_apart(sock: Path) -> None:
    """Sent in the same moment to a worker that batches for 300 ms: each output equals its solo run."""
    jobs = [(CONTROL, ref()), (CONTROL, {}), (IMG2IMG, ref()), (IMG2IMG, ref(seed=2)), (IMG2IMG, {})]
    async with http(sock) as s:
        solo = [await run(s, *j) for j in jobs]
        together = await asyncio.gather(*(run(s, *j) for j in jobs))
    assert list(together) == solo
    assert len(set(solo)) == len(jobs)


async def test_a_hires_pass_after_a_reference_runs_with_it(sock: Path) -> None:
    """The second pass runs on the image-to-image pipeline while the adapter is still in the UNet."""
    hires = {"hires": {"scale": 1.5, "strength": 0.5, "steps": 2}}
    async with http(sock) as s:
        plain = await run(s, hires)
        steered = await run(s, hires, ref())
        zero = await run(s, hires, ref(0.0))
    assert steered != plain
    assert zero == plain


def pixels(data: bytes) -> bytes:
    """A PNG's pixels: its text chunks name the adapter, so the files differ even where the pictures do not."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.tobytes()


def openai_edit(sock: Path, **extra: Any) -> bytes:
    """``client.images.edit`` of the official client (it flattens ``extra_body`` into form fields)."""
    import httpx
    import openai

    transport = httpx.HTTPTransport(uds=str(sock))
    with httpx.Client(transport=transport, timeout=120) as hc:
        client = openai.OpenAI(base_url="http://diffusiond/v1", api_key="unused", http_client=hc)
        got = client.images.edit(model="tiny", image=("in.png", base64.b64decode(IMG2IMG["image"]), "image/png"),
                                 prompt=str(FAST["prompt"]), size=f"{SIZE}x{SIZE}", response_format="b64_json",
                                 extra_body={"seed": 7, "num_inference_steps": 2, "strength": 0.7, **extra})
    assert got.data is not None and got.data[0].b64_json is not None
    return pixels(base64.b64decode(got.data[0].b64_json))


async def test_the_openai_edits_endpoint_takes_a_reference_flattened_or_as_json(sock: Path) -> None:
    plain = await asyncio.to_thread(openai_edit, sock)
    steered = await asyncio.to_thread(openai_edit, sock, **ref())
    zero = await asyncio.to_thread(openai_edit, sock, **ref(0.0))
    form = aiohttp.FormData()
    for k, v in {"model": "tiny", "prompt": FAST["prompt"], "size": f"{SIZE}x{SIZE}", "seed": "7",
                 "num_inference_steps": "2", "strength": "0.7", "ip_adapter": json.dumps(ref()["ip_adapter"])}.items():
        form.add_field(k, str(v))
    form.add_field("image", base64.b64decode(IMG2IMG["image"]), filename="in.png", content_type="image/png")
    async with http(sock) as s, s.post("/v1/images/edits", data=form) as r:
        assert r.status == 200, await r.text()
        as_json = pixels(base64.b64decode((await r.json())["data"][0]["b64_json"]))
    assert steered != plain and zero == plain
    assert as_json == steered


def test_an_edit_form_reads_ip_adapter_as_json_text_or_as_the_openai_client_flattens_it() -> None:
    from diffusiond.daemon.edge.forms import edits_form
    from diffusiond.daemon.errors import InvalidRequest

    base = [("prompt", "x"), ("model", "tiny")]
    flat = edits_form([*base, ("ip_adapter[][name]", "style"), ("ip_adapter[][image]", "aGk="),
                       ("ip_adapter[][scale]", "0.5")])["ip_adapter"]
    as_json = edits_form([*base, ("ip_adapter", '[{"name": "style", "image": "aGk=", "scale": 0.5}]')])["ip_adapter"]
    assert flat == as_json and [(e.name, e.image, e.scale) for e in flat] == [("style", "aGk=", 0.5)]
    for pairs, words in [([("ip_adapter", "{")], "not valid JSON"), ([("ip_adapter", '{"name": "x"}')], "a list"),
                         ([("ip_adapter[][weight]", "1")], "unexpected form field"),
                         ([("ip_adapter[][scale]", "big")], "Expected `float`")]:
        with pytest.raises(InvalidRequest) as err:
            edits_form([*base, *pairs])
        assert words in err.value.message and err.value.field is not None and "ip_adapter" in err.value.field


async def test_no_input_buffer_outlives_a_combined_job(sock: Path, combo_daemon: Daemon) -> None:
    """Runs last: the edit's or control's buffer is replaced by the one holding the reference too, and
    neither may stay open in the engine or the worker once the jobs are over."""
    async with http(sock) as s:
        await until(lambda: idle(s), 60, "the daemon to be idle")

    assert combo_daemon.proc is not None
    for pid in (combo_daemon.proc.pid, *combo_daemon.worker_pids()):
        assert fds_named(pid, "diffusiond-input", "diffusiond-control", "diffusiond-reference") == [], pid
