"""Upscalers and the hires pass, end to end: a real daemon on ``tiny`` with ESRGAN upscalers built in code.

``esr`` (.safetensors) and ``esr-pth`` (.pth) are ESRGAN models of scale 2 with random weights
(upscalekit.py), read by spandrel from the files, as a downloaded checkpoint is; ``esr-tiled`` is
``esr``'s file served in tiles of 32 input pixels (the others' 512 hold a whole 64x64 picture). ``plain`` is a
synthetic model, which has no image-to-image pipeline. Outputs are compared as raw ``npy`` arrays.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, get, http, shared_daemon, sse, submit, wait_job
from upscalekit import build_upscaler, require_spandrel

require_spandrel()

SIZE = 64
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("upscalers")
    return {"esr": build_upscaler(root / "esr.safetensors", seed=1),
            "esr-pth": build_upscaler(root / "esr-pth.pth", seed=2)}


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, files: dict[str, Path]) -> Iterator[Path]:
    args = ["--model", "tiny", "--model", "plain=synthetic:compute_ms=5", "--workers", "1", "--job-timeout", "300",
            *(a for name, path in files.items() for a in ("--upscaler", f"{name}={path}")),
            "--upscaler", f"esr-tiled={files['esr']},tile=32,overlap=8"]
    d: Daemon
    with shared_daemon(tmp_path_factory.mktemp("upscale-daemon"), args, model_cache) as d:
        yield d.socket


async def run(s: aiohttp.ClientSession, **extra: Any) -> tuple[np.ndarray, dict[str, Any]]:
    job = await wait_job(s, (await submit(s, {**FAST, **extra}))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return np.load(io.BytesIO(await r.read())), job


async def refused(s: aiohttp.ClientSession, **extra: Any) -> tuple[int, dict[str, Any]]:
    async with s.post("/v1/jobs", json={**FAST, **extra}) as r:
        return r.status, (await r.json())["error"]


def bicubic(picture: np.ndarray, side: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(picture).resize((side, side), Image.Resampling.BICUBIC))


async def test_upscale_doubles_the_output_and_is_not_a_plain_resize(sock: Path) -> None:
    async with http(sock) as s:
        plain, _ = await run(s)
        big, job = await run(s, upscale={"name": "esr"})
        other, _ = await run(s, upscale={"name": "esr-pth"})
        resized, _ = await run(s, upscale={"name": "esr", "scale": 3})
    assert plain.shape == (SIZE, SIZE, 3) and big.shape == (2 * SIZE, 2 * SIZE, 3)
    assert resized.shape == (3 * SIZE, 3 * SIZE, 3)  # the model's x2, then resized to the asked x3
    assert np.abs(big.astype(int) - bicubic(plain, 2 * SIZE).astype(int)).mean() > 5, "the upscaler only resized"
    assert not np.array_equal(big, other), "two upscalers gave the same picture"
    assert job["request"]["upscale"] == {"name": "esr", "scale": 2.0, "width": 2 * SIZE, "height": 2 * SIZE}
    assert job["request"]["width"] == SIZE  # what was asked stays as asked


async def test_upscalers_endpoint_lists_each_with_its_scale_and_architecture(sock: Path) -> None:
    async with http(sock) as s:
        status, body = await get(s, "/v1/upscalers")
    assert status == 200
    entries = {e["name"]: e for e in body["data"]}
    assert set(entries) == {"esr", "esr-pth", "esr-tiled"}
    assert (entries["esr"]["scale"], entries["esr"]["architecture"]) == (2, "ESRGAN")
    assert (entries["esr"]["tile"], entries["esr"]["overlap"]) == (512, 32)  # the defaults
    assert (entries["esr-tiled"]["tile"], entries["esr-tiled"]["overlap"]) == (32, 8)


async def test_a_picture_larger_than_the_tile_is_upscaled_in_tiles_to_the_right_size(sock: Path) -> None:
    """64x64 in tiles of 32 (3 x 3 of them, sharing 8 pixels): twice the size, and within a few
    levels of the same picture upscaled whole (the unit tests in test_upscale_tiles.py bound it)."""
    async with http(sock) as s:
        whole, _ = await run(s, upscale={"name": "esr"})
        tiled, job = await run(s, upscale={"name": "esr-tiled"})
        hires, _ = await run(s, hires={"scale": 2, "strength": 0.5, "steps": 2, "upscaler": "esr-tiled"})
    assert tiled.shape == whole.shape == hires.shape == (2 * SIZE, 2 * SIZE, 3)
    diff = np.abs(tiled.astype(int) - whole.astype(int))
    assert not np.array_equal(tiled, whole), "esr-tiled ran whole"  # measured: 7% of the values differ
    assert diff.max() <= 4 and diff.mean() < 0.5, (diff.max(), diff.mean())  # measured: 2, 0.07
    assert job["status"] == "succeeded" and job["request"]["upscale"]["width"] == 2 * SIZE


async def test_hires_makes_a_larger_picture_that_differs_from_the_plain_one(sock: Path) -> None:
    async with http(sock) as s:
        plain, _ = await run(s)
        hires, job = await run(s, hires={"scale": 2, "strength": 0.5, "steps": 2})
        with_model, _ = await run(s, hires={"scale": 2, "strength": 0.5, "steps": 2, "upscaler": "esr"})
    assert hires.shape == with_model.shape == (2 * SIZE, 2 * SIZE, 3)
    assert np.abs(hires.astype(int) - bicubic(plain, 2 * SIZE).astype(int)).mean() > 1, "the second pass did nothing"
    assert not np.array_equal(hires, with_model), "the hires upscaler changed nothing"
    assert job["request"]["hires"] == {"width": 2 * SIZE, "height": 2 * SIZE, "strength": 0.5, "steps": 2,
                                       "schedule": 4, "upscaler": None}


async def test_a_hires_job_reports_progress_and_previews_over_both_passes(sock: Path) -> None:
    async with http(sock) as s:
        job = await submit(s, {**FAST, "hires": {"scale": 1.5, "strength": 0.5, "steps": 3}, "preview": {"every": 1}})
        assert job["progress"]["total"] == 5  # 2 steps, then 3 more at 96x96
        events = await sse(s, job["id"])
        done = await wait_job(s, job["id"])
    steps = [e for name, e in events if name == "progress"]
    assert steps and {e["total"] for e in steps} == {5}, steps
    assert steps[-1]["step"] == 5 and done["progress"] == {"step": 5, "total": 5}
    previews = {(e["step"], e["total"]) for name, e in events if name == "preview"}
    assert (1, 5) in previews and (4, 5) in previews, previews  # one of each pass (none at a pass's last step)


async def test_different_upscales_are_not_batched_together(sock: Path) -> None:
    """Sent at once to one worker: each output has the size and pixels of its own request alone."""
    import asyncio

    asks: list[dict[str, Any]] = [{}, {"upscale": {"name": "esr"}}, {"upscale": {"name": "esr-pth"}},
                                  {"upscale": {"name": "esr", "scale": 3}}]
    async with http(sock) as s:
        solo = [(await run(s, **a))[0] for a in asks]
        together = await asyncio.gather(*(run(s, **a) for a in asks))
    for alone, (both, _) in zip(solo, together, strict=True):
        assert np.array_equal(alone, both)


@pytest.mark.parametrize(("extra", "field", "words"), [
    ({"upscale": {"name": "nope"}}, "upscale.name", "known: esr, esr-pth, esr-tiled"),
    ({"upscale": {"name": "esr", "scale": 0.5}}, "upscale.scale", "from 1"),
    ({"upscale": {"name": "esr", "size": 2}}, "upscale", "unknown field"),
    ({"hires": {"scale": 1.0}}, "hires.scale", "above 1"),
    ({"hires": {"strength": 0}}, "hires.strength", "above 0"),
    ({"hires": {"steps": 0}}, "hires.steps", "from 1"),
    ({"hires": {"upscaler": "nope"}}, "hires.upscaler", "not served"),
    ({"hires": {"scale": 3}, "width": 2048, "height": 2048}, "hires.scale", "largest side"),
    ({"hires": {}, "model": "plain"}, "hires", "image-to-image"),
    ({"upscale": {"name": "esr", "scale": 8}, "width": 2048, "height": 256, "output_format": "webp"}, "upscale.scale",
     "webp holds at most 16383"),
])
async def test_bad_upscale_and_hires_are_400s_naming_the_field(sock: Path, extra: dict[str, Any], field: str,
                                                                words: str) -> None:
    async with http(sock) as s:
        status, error = await refused(s, **extra)
    assert (status, error.get("field")) == (400, field), error
    assert words in error["message"]


def test_cli_and_client_spell_upscale_and_hires_as_the_api_does() -> None:
    import argparse

    from diffusiond.client.params import job_body
    from diffusiond.commands.upscale import hires_arg, upscale_arg

    assert upscale_arg("esr") == {"name": "esr"} and upscale_arg("esr:3") == {"name": "esr", "scale": 3.0}
    assert hires_arg("2:0.4:10:esr") == {"scale": 2.0, "strength": 0.4, "steps": 10, "upscaler": "esr"}
    assert hires_arg("1.5") == {"scale": 1.5}
    for bad in ("esr:", ":2", "esr:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            upscale_arg(bad)
    for bad in ("", "2:", "2:0.5:x", "1:2:3:4:5"):
        with pytest.raises(argparse.ArgumentTypeError):
            hires_arg(bad)
    body = job_body("x", {"upscale": "esr", "hires": {"scale": 2, "steps": 4}})
    assert body["upscale"] == {"name": "esr"} and body["hires"] == {"scale": 2, "steps": 4}


@pytest.mark.parametrize("content", [b"not a model", None])
def test_a_file_spandrel_cannot_read_or_a_missing_one_stops_the_start_naming_flag_and_path(
        tmp_path: Path, content: bytes | None) -> None:
    bad = tmp_path / "junk.pth"
    if content is not None:
        bad.write_bytes(content)
    out = subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--model", "tiny", "--socket",
                          str(tmp_path / "d.sock"), "--no-persist", "--upscaler", f"junk={bad}"],
                         capture_output=True, timeout=120)
    assert out.returncode != 0
    assert f"--upscaler junk={bad}" in out.stderr.decode(), out.stderr.decode()[-2000:]
    assert not (tmp_path / "d.sock").exists()
