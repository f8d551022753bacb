"""Live updates kept for a model with no worker (issue 29), refused by that model when it starts: the
trainer's call returned long ago, so what it sees is the model's entry and its queued jobs' errors.

One real daemon, ``--preload none``: tiny runs once (a model never seen is loaded before its first
job is admitted, so a job for it cannot be queued unchecked), goes to disk, then takes an adapter and a
component update that do not fit it and a job naming that adapter, queued until tiny starts again. Its
workers report no parameter table (test fault ``no_param_table``): with one, both would be refused at once
(tests/test_param_tables.py), as they are for any model that ran before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, submit, wait_job

from diffusiond.client import AsyncClient

SMALL = {"model": "tiny", "width": 64, "height": 64, "steps": 1, "prompt": "a lighthouse", "seed": 1,
         "output_format": "npy"}


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    args = ["--model", "tiny", "--preload", "none", "--workers", "1", "--no-persist", "--job-timeout", "300",
            "--test-fault", "no_param_table"]
    with shared_daemon(tmp_path_factory.mktemp("refusals"), args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d


async def tiny_entry(s: aiohttp.ClientSession) -> dict[str, Any]:
    async with s.get("/v1/models") as r:
        return next(m for m in (await r.json())["data"] if m["id"] == "tiny")


async def to_disk(s: aiohttp.ClientSession) -> None:
    """Unload tiny by hand and wait until it is on disk (no worker runs)."""
    async with s.post("/v1/models/tiny/unload") as r:
        assert r.status == 200, await r.text()
    for _ in range(600):
        if (await tiny_entry(s))["residency"] == "disk":
            break
        await asyncio.sleep(0.1)
    assert (await tiny_entry(s))["residency"] == "disk"


async def test_updates_refused_at_the_models_start_show_and_fail_the_jobs_queued_for_them(
        cold: Daemon) -> None:
    from safetensors import safe_open

    from diffusiond.pipelines.tiny import ensure_tiny

    with safe_open(str(ensure_tiny() / "unet" / "diffusion_pytorch_model.safetensors"), "np") as f:
        conv_out = f.get_tensor("conv_out.weight")
    # what the files' headers cannot judge (tests/test_kept_updates.py has what they can): a LoRA on a norm
    # (a 1-D weight: the header does not say the class) and a name the text encoder's file lacks (tied
    # weights are saved once)
    misfit = {"unet.conv_norm_out.lora_A.weight": np.ones((2, 32), np.float32),
              "unet.conv_norm_out.lora_B.weight": np.ones((32, 2), np.float32)}
    async with AsyncClient(str(cold.socket)) as c, http(cold.socket) as s:
        # never loaded, nothing remembered: its defaults are not known yet, rather than generic ones
        assert (await tiny_entry(s))["defaults"] is None
        first = await wait_job(s, (await submit(s, SMALL))["id"], 300)
        assert first["status"] == "succeeded", first
        assert (await tiny_entry(s))["defaults"]["steps"] == 4  # tiny's own, once it has loaded
        await to_disk(s)

        # no worker to check them: both are kept on trust, and their calls answer with a version
        assert await c.update_lora("trainer", misfit) == 1
        assert await c.update_weights("tiny", "text_encoder", {"nope.weight": conv_out}) == 1
        named = await submit(s, {**SMALL, "loras": [{"name": "trainer", "weight": 1.0}]})
        plain = await submit(s, SMALL)

        # tiny's start refuses both: the queued job naming the adapter fails as admission would refuse it
        job = await wait_job(s, named["id"], 300)
        assert job["status"] == "failed" and job["error"]["code"] == "invalid_request", job
        message = job["error"]["message"]
        assert "LoRA 'trainer' does not fit model 'tiny'" in message and "takes no LoRA" in message, message
        ran = await wait_job(s, plain["id"], 300)
        assert ran["status"] == "succeeded" and ran["weight_versions"] is None, ran  # the files' unet
        entry = await tiny_entry(s)
        why = entry["weight_errors"]["text_encoder"]
        assert list(entry["weight_errors"]) == ["text_encoder"], entry
        assert why == ("update version 1 was refused when the model started, and dropped: tensor 'nope.weight': "
                       "text_encoder of model tiny has no parameter of that name; in force instead: the files' "
                       "values"), why
        lora = next(e for e in (await c._json("GET", "/v1/loras"))["data"] if e["name"] == "trainer")
        assert lora["models"] == [] and "takes no LoRA" in lora["unfit"]["tiny"], lora

        # an update sent after the refusal, accepted: the refusal is over
        text_encoder = ensure_tiny() / "text_encoder" / "model.safetensors"
        with safe_open(str(text_encoder), "np") as f:
            name = next(iter(f.keys()))
            value = f.get_tensor(name)
        assert await c.update_weights("tiny", "text_encoder", {name: value}) == 2
        assert (await tiny_entry(s))["weight_errors"] == {}
