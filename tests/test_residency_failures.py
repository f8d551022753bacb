"""Residency when a model cannot load, against one real daemon on CPU: its jobs fail with the worker's
reason instead of waiting in ``loading`` while a worker is started every few seconds; the start goes
on without it; a load by hand says why; the other models keep serving; the next job tries again. And
an unload by hand of a model with work is carried out once the work is done, not dropped.

Three copies of tiny's folder: ``a`` stays sound, ``b`` runs once (so it is known, with its size) and
then has its UNet file truncated, ``c`` is truncated from the start. ``--keep-alive 1s`` sends an
idle model to disk (on a CPU device its worker stops), so each job after that is a load from the files.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, get, http, shared_daemon, submit, until, wait_job

from conftest import ROOT

JOB = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 2, "seed": 7, "output_format": "png"}


def unet_file(folder: Path) -> Path:
    return next((folder / "unet").glob("*.safetensors"))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> dict[str, Path]:
    from diffusiond.pipelines.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in "abc":
        shutil.copytree(ensure_tiny(), root / name)
        out[name] = root / name
    truncate(unet_file(out["c"]))
    return out


@pytest.fixture(scope="module")
def d(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    args = [a for name, path in models.items() for a in ("--model", f"{name}={path}")]
    # each load takes a second longer: an unload sent while one runs finds it still running
    with shared_daemon(tmp_path_factory.mktemp("d"), [*args, "--no-persist", "--keep-alive", "1s",
                                                       "--job-timeout", "300", "--test-fault", "load_delay_ms=1000"],
                       model_cache) as daemon:
        yield daemon


async def models_by_name(s: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
    status, body = await get(s, "/v1/models")
    assert status == 200, body
    return {m["id"]: m for m in body["data"]}


async def on_disk(s: aiohttp.ClientSession, name: str) -> None:
    async def gone() -> bool:
        return (await models_by_name(s))[name]["residency"] == "disk"

    await until(gone, 60, f"model {name} to leave its device after its keep-alive")


async def run(s: aiohttp.ClientSession, model: str, **extra: Any) -> dict[str, Any]:
    job = await submit(s, {**JOB, "model": model, **extra})
    return await wait_job(s, job["id"], timeout=240)


def loads(d: Daemon, name: str) -> int:
    """How many times residency started a load of ``name`` from disk (each one a worker process)."""
    return d.log_path.read_text(errors="replace").count(f"loading {name} from disk")


def test_a_model_that_cannot_load_at_start_stays_on_disk_with_the_reason_and_the_others_serve(d: Daemon) -> None:
    async def go() -> None:
        async with http(d.socket) as s:
            assert (await get(s, "/ready"))[0] == 200
            c = (await models_by_name(s))["c"]
            assert c["residency"] == "disk" and c["residency_reason"].startswith("load failed: "), c
            assert "safetensors" in c["residency_reason"].lower(), c
            assert c["state"] == "unavailable", c  # failed, not merely unloaded
            assert (await run(s, "a"))["status"] == "succeeded"

    asyncio.run(go())
    assert "ERROR" in d.log_path.read_text() and "c stays on disk: loading it at start failed" in d.log_path.read_text()


def test_a_known_model_whose_files_break_fails_its_jobs_with_the_reason_without_a_spawn_loop(
        d: Daemon, models: dict[str, Path]) -> None:
    unet = unet_file(models["b"])
    sound = unet.read_bytes()

    async def go() -> None:
        async with http(d.socket) as s:
            assert (await run(s, "b"))["status"] == "succeeded"  # b is known: its size is in the books
            await on_disk(s, "b")
            # its keep-alive sent it to disk: no worker, and nothing wrong with it
            assert (await models_by_name(s))["b"]["state"] == "unloaded"
            truncate(unet)
            before = loads(d, "b")
            jobs = [await submit(s, {**JOB, "model": "b", "seed": k}) for k in range(2)]
            for job in jobs:
                end = await wait_job(s, job["id"], timeout=240)
                assert end["status"] == "failed", end
                error = end["error"]
                assert error["code"] == "model_load_failed" and error["stage"] == "loading", error
                assert "model 'b' could not be loaded" in error["message"], error
                assert "safetensors" in error["message"].lower(), error
            b = (await models_by_name(s))["b"]
            assert b["residency"] == "disk" and b["residency_reason"].startswith("load failed: "), b
            assert b["state"] == "unavailable", b
            assert (await run(s, "a"))["status"] == "succeeded", "the other model serves meanwhile"
            assert loads(d, "b") == before + 1, "one load for the jobs that waited, and none tried again since"
            # by hand: the worker's reason, not a timeout
            async with s.post("/v1/models/b/load") as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "model_load_failed", body
                assert "safetensors" in body["error"]["message"].lower(), body
            assert loads(d, "b") == before + 2
            unet.write_bytes(sound)  # fixed: the next job tries the load again, and runs
            assert (await run(s, "b"))["status"] == "succeeded"
            assert (await models_by_name(s))["b"]["state"] in ("ready", "unloaded")  # no failure left behind
            assert loads(d, "b") == before + 3

    try:
        asyncio.run(go())
    finally:
        unet.write_bytes(sound)


def test_unload_of_a_model_with_work_is_carried_out_once_the_work_is_done(d: Daemon) -> None:
    async def go() -> None:
        async with http(d.socket) as s:
            await on_disk(s, "a")
            job = await submit(s, {**JOB, "model": "a", "keep_alive": -1})  # a would stay for ever
            cli = subprocess.run([sys.executable, "-m", "diffusiond", "unload", "a", "--socket", str(d.socket)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert cli.returncode == 0, cli.stderr
            assert "unload pending" in cli.stdout, cli.stdout
            a = (await models_by_name(s))["a"]
            assert a["unload"] == "pending" and a["residency"] in ("loading", "device"), a
            assert (await wait_job(s, job["id"], timeout=240))["status"] == "succeeded"
            await on_disk(s, "a")
            a = (await models_by_name(s))["a"]
            assert a["unload"] is None, a
            metrics = await (await s.get("/metrics")).text()
            assert 'diffusiond_model_evictions_total{model="a",reason="by_hand"} 1.0' in metrics

    asyncio.run(go())


async def test_loading_by_hand_a_model_nothing_fits_is_refused_with_what_was_tried() -> None:
    """offload=auto found no configuration within the budget: a load by hand is refused as each job is,
    instead of loading the model in a configuration none of its jobs may run in (in process: no daemon)."""
    from enginekit import Harness

    from diffusiond.daemon import errors
    from diffusiond.daemon.config import ModelConfig

    tried = "nothing fits the --device-memory budget of 1 GiB with offload=auto: none (offload=none) needs 30 GiB"
    h = Harness(models=(ModelConfig(name="m", spec="fake", nothing_fits=tried),), device_memory="1GiB")
    await h.engine.start()
    try:
        with pytest.raises(errors.ModelTooLarge) as refused:
            await h.engine.load_model("m")
        assert tried in refused.value.message and refused.value.field == "name", refused.value.body()
        assert not h.spawned, "nothing was started for it"
    finally:
        await h.close()
