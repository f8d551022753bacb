"""GGUF transformers beyond FLUX.1 served by a real daemon (issue 28): FLUX Kontext and Wan, on a CPU.

Users download ``flux1-kontext-dev-Q8_0.gguf`` (BFL's tensor names, as FLUX.1's) and serve it with
``base=`` a Kontext folder; the tiny FLUX of tests/fluxkit.py saved as a FluxKontextPipeline folder stands for
it, its transformer written as Q8_0 under diffusers' names and under BFL's. Each is checked where a user
looks: the model's entry (an instruction edit, quantized), an edit that changes the image it is sent, and
the quantization named on the job.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, get, http, shared_daemon, submit, wait_job
from fluxkit import build_flux, tiny_transformer, write_gguf, write_gguf_bfl
from PIL import Image
from test_edits import blocky
from test_image_tasks import b64

pytest.importorskip("gguf")

Q8 = "gguf-Q8_0(transformer, dequantized per layer to float32)"
KONTEXT = ("kontext", "kontext-bfl")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model's spec, by the name the daemon serves it under."""
    root = tmp_path_factory.mktemp("gguf-families")
    kontext = build_flux(root / "kontext")
    index = json.loads((kontext / "model_index.json").read_text())
    (kontext / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    write_gguf(tiny_transformer(), root / "kontext.gguf")
    write_gguf_bfl(tiny_transformer(), root / "kontext-bfl.gguf")
    return {name: Path(f"{root / name}.gguf,base={kontext}") for name in KONTEXT}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, files: dict[str, Path]) -> Iterator[Daemon]:
    args = [a for name, spec in files.items() for a in ("--model", f"{name}={spec}")]
    with shared_daemon(tmp_path_factory.mktemp("gguf-families-daemon"), [*args, "--workers", "1",
                                                                         "--job-timeout", "120"], model_cache) as d:
        yield d


async def done(s: Any, body: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The finished job and its first output's bytes."""
    job = await wait_job(s, (await submit(s, body))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return job, await r.read()


def pixels(png: bytes) -> np.ndarray:
    """An image's pixels, once its own metadata is checked to name the quantization."""
    with Image.open(io.BytesIO(png)) as img:
        assert Q8 in img.info["approximations"], img.info
        return np.asarray(img.convert("RGB"), dtype=np.int16)


def test_gguf_kontext_and_wan_list_their_task_and_quantization(daemon: Daemon) -> None:
    async def go() -> dict[str, dict[str, Any]]:
        async with http(daemon.socket) as s:
            _, models = await get(s, "/v1/models")
        return {m["id"]: m for m in models["data"]}

    listed = asyncio.run(go())
    for name in KONTEXT:
        entry = listed[name]
        assert (entry["task"], entry["edits"]) == ("instruction-edit", ["instruction-edit"]), entry
        assert entry["approximations"] == [Q8], entry


def test_a_gguf_kontext_edits_the_image_it_is_sent_under_either_naming(daemon: Daemon) -> None:
    body = {"prompt": "make it red", "image": b64(1), "width": 64, "height": 64, "steps": 2, "seed": 3}

    async def go() -> dict[str, tuple[dict[str, Any], bytes]]:
        async with http(daemon.socket) as s:
            return {name: await done(s, {**body, "model": name}) for name in KONTEXT}

    got = asyncio.run(go())
    sent = blocky(1, 64).astype(np.int16)
    edited = {name: pixels(png) for name, (_, png) in got.items()}
    for name, (job, _) in got.items():
        assert job["approximations"] == [Q8], job
        assert edited[name].shape == sent.shape and np.abs(edited[name] - sent).mean() > 4, name
    assert np.abs(edited["kontext-bfl"] - edited["kontext"]).max() <= 1  # the same weights, either naming
