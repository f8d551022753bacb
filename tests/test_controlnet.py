"""ControlNets per request, end to end: a real daemon on ``tiny`` with ControlNets built in code.

``edges`` and ``blobs`` are ControlNets made from tiny's UNet (controlkit.py), saved with
``save_pretrained`` and served with ``--controlnet NAME=PATH``; a third model (synthetic) has no
ControlNet family. Outputs are compared as raw ``npy`` bytes, so "equal" means bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controlkit import build_controlnet, png
from daemonkit import Daemon, first_output, get, http, shared_daemon

SIZE = 64
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy", "output_dtype": "float32"}  # float: tiny's uint8 pictures saturate


@pytest.fixture(scope="module")
def control_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
                   controlnet_dir: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("control-daemon")
    edges, blobs = controlnet_dir, build_controlnet(root / "blobs", seed=2)
    args = ["--model", "tiny", "--model", "plain=synthetic:compute_ms=5", "--workers", "1", "--max-batch", "4",
            "--batch-wait-ms", "400", "--job-timeout", "300",
            "--controlnet", f"edges={edges}", "--controlnet", f"blobs={blobs}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d


@pytest.fixture(scope="module")
def sock(control_daemon: Daemon) -> Path:
    return control_daemon.socket


async def run(s: aiohttp.ClientSession, control: list[dict[str, Any]] | None = None, **extra: Any) -> bytes:
    body = {**FAST, **extra}
    if control is not None:
        body["control"] = control
    return await first_output(s, body)


async def refused(s: aiohttp.ClientSession, control: Any, model: str = "tiny") -> tuple[int, dict[str, Any]]:
    async with s.post("/v1/jobs", json={**FAST, "model": model, "control": control}) as r:
        return r.status, (await r.json())["error"]


async def test_control_steers_the_output_and_scale_zero_is_the_plain_output_bit_for_bit(sock: Path) -> None:
    async with http(sock) as s:
        plain = await run(s)
        edges = await run(s, [{"name": "edges", "image": png(1)}])
        other_image = await run(s, [{"name": "edges", "image": png(2)}])
        zero = await run(s, [{"name": "edges", "image": png(1), "scale": 0.0}])
        both = await run(s, [{"name": "edges", "image": png(1)}, {"name": "blobs", "image": png(2), "end": 0.5}])
        job = (await get(s, "/v1/jobs?limit=1"))[1]["data"][0]
    assert edges != plain, "the control changed nothing"
    assert other_image != edges, "another control image gave the same output"
    assert both not in (plain, edges), "the second ControlNet changed nothing"
    assert zero == plain  # diffusers multiplies the residuals by the scale: 0 adds exact zeros
    assert job["request"]["control"] == [
        {"name": "edges", "scale": 1.0, "start": 0.0, "end": 1.0, "preprocess": "none", "mode": None},
        {"name": "blobs", "scale": 1.0, "start": 0.0, "end": 0.5, "preprocess": "none", "mode": None}]


async def test_different_controls_at_once_are_not_batched_together(sock: Path) -> None:
    """Sent in the same moment to a worker that batches for 400 ms: each output equals its solo run."""
    controls = [[{"name": "edges", "image": png(1)}], [{"name": "edges", "image": png(2)}],
                [{"name": "edges", "image": png(1), "scale": 0.5}], None]
    async with http(sock) as s:
        solo = [await run(s, c) for c in controls]
        together = await asyncio.gather(*(run(s, c) for c in controls))
    assert list(together) == solo
    assert len(set(solo)) == 4


async def test_canny_preprocess_runs_and_differs_from_the_raw_picture(sock: Path) -> None:
    pytest.importorskip("cv2")
    async with http(sock) as s:
        raw = await run(s, [{"name": "edges", "image": png(3)}])
        canny = await run(s, [{"name": "edges", "image": png(3), "preprocess": "canny"}])
    assert canny != raw


async def test_controlnets_endpoint_lists_each_with_the_models_it_fits(sock: Path) -> None:
    async with http(sock) as s:
        status, body = await get(s, "/v1/controlnets")
    assert status == 200
    entries = {e["name"]: e for e in body["data"]}
    assert set(entries) == {"edges", "blobs"}
    assert entries["edges"]["models"] == ["tiny"] and "plain" in entries["edges"]["unfit"]


@pytest.mark.parametrize(("control", "field", "words"), [
    ([{"name": "sketch", "image": "x"}], "control[0].name", "known: blobs, edges"),
    ([{"name": "edges", "image": "bm90IGFuIGltYWdl"}], "control[0].image", "not an image"),
    ([{"name": "edges", "image": "%%%"}], "control[0].image", "base64"),
    ([{"name": "edges"}], "control[0].image", "exactly one"),
    ([{"name": "edges", "image": "x", "scale": 9}], "control[0].scale", "from 0 to"),
    ([{"name": "edges", "image": "x", "start": 0.6, "end": 0.4}], "control[0].start", "below"),
    ([{"name": "edges", "image": "x", "end": 1.5}], "control[0].end", "fraction"),
    ([{"name": "edges", "image": "x", "preprocess": "depth"}], "control[0].preprocess", "canny"),
    ([{"name": "edges", "image": "x"}, {"name": "edges", "image": "x"}], "control[1].name", "twice"),
])
async def test_bad_control_entries_are_400s_naming_the_field(sock: Path, control: Any, field: str,
                                                              words: str) -> None:
    async with http(sock) as s:
        status, error = await refused(s, control)
    assert (status, error["field"]) == (400, field), error
    assert words in error["message"]


async def test_a_controlnet_of_no_fitting_family_is_a_400(sock: Path) -> None:
    async with http(sock) as s:
        status, error = await refused(s, [{"name": "edges", "image": png(1)}], model="plain")
    assert (status, error["field"]) == (400, "control[0].name") and "does not fit model 'plain'" in error["message"]


@pytest.mark.parametrize(("arg", "why"), [
    ("edges=/nonexistent/controlnet", "does not exist"),
    ("edges=relative/folder", "relative"),
    ("edges=/etc/hostname", "not a .safetensors file"),
    ("bad name=/tmp", "must be 1-64 characters"),
    ("edges", "NAME=PATH"),
])
def test_serve_refuses_a_controlnet_path_it_cannot_serve_with_one_line(arg: str, why: str) -> None:
    from diffusiond.daemon.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=why):
        build_config({}, {"controlnet": [arg]})


def test_generate_control_flag_reads_name_image_and_scale() -> None:
    from diffusiond.commands.generate import control_arg, ip_adapter_arg

    assert control_arg("edges:lines.png") == {"name": "edges", "image": "lines.png"}
    assert control_arg("edges:a:b.png:0.5") == {"name": "edges", "image": "a:b.png", "scale": 0.5}
    assert control_arg("edges:a:b.png") == {"name": "edges", "image": "a:b.png"}
    assert control_arg("union@2:depth.png:0.8") == {"name": "union", "image": "depth.png", "scale": 0.8, "mode": 2}
    for bad in ("union@:x.png", "union@depth:x.png"):
        with pytest.raises(argparse.ArgumentTypeError, match="MODE"):
            control_arg(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="mode"):
        ip_adapter_arg("style@1:ref.png")


def test_client_sends_control_images_as_base64() -> None:
    from diffusiond.client.params import job_body

    body = job_body("x", {"control": [{"name": "edges", "image": b"\x89PNG", "scale": 0.5}]})
    assert body["control"] == [{"name": "edges", "image": base64.b64encode(b"\x89PNG").decode(), "scale": 0.5}]
