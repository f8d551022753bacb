"""Load on demand against real daemons: what the start loads (``--preload``, TOML ``preload``), and a
model that starts on disk, with no worker, loaded by its first job through the stage ``loading``.

Every daemon here runs the embedded ``tiny`` model on CPU, so a model on disk is one with no worker
process at all: ``Daemon.worker_pids`` counts them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from daemonkit import Daemon, get, http, sse, submit, until, wait_job

from conftest import ROOT

JOB = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 2, "seed": 7}


async def models_by_name(s: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
    status, body = await get(s, "/v1/models")
    assert status == 200, body
    return {m["id"]: m for m in body["data"]}


def test_preload_none_is_ready_with_nothing_loaded_and_the_first_job_loads_the_model(
        daemon_factory: Any, tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    first: Daemon = daemon_factory("--model", "tiny", "--state-dir", state)
    first.stop()  # tiny ran here once: its defaults and size are in the state dir
    d: Daemon = daemon_factory("--model", "tiny", "--state-dir", state, "--preload", "none")
    assert d.worker_pids() == [], "a daemon that preloads nothing starts no worker"

    async def go() -> None:
        async with http(d.socket) as s:
            # admitting, with nothing loaded and nothing to preload
            assert await get(s, "/ready") == (200, {"ready": True, "preload": {"state": "done", "models": []}})
            status, health = await get(s, "/health")
            assert status == 200 and health["workers"] == [] and health["status"] == "ok", health
            tiny = (await models_by_name(s))["tiny"]
            # not loaded is no fault: "unloaded", its job loads it, not "unavailable"
            assert tiny["residency"] == "disk" and tiny["device_bytes"] == 0 and tiny["state"] == "unloaded", tiny
            job = await submit(s, JOB)
            # admission started its load: the job waits in "loading", for the weights the state dir remembers
            assert job["status"] == "queued" and job["stage"] == "loading", job
            total = job["loading"]["bytes_total"]
            assert total > 0 and job["loading"] == {"model": "tiny", "bytes_loaded": None, "bytes_total": total}
            events = await sse(s, job["id"])
            assert events[-1][0] == "done", events
            loading = [e for name, e in events if name == "status" and e["stage"] == "loading"]
            assert loading and all(e["loading"]["bytes_total"] == total for e in loading), events
            end = await wait_job(s, job["id"])
            assert end["status"] == "succeeded" and end["loading"] is None, end
            tiny = (await models_by_name(s))["tiny"]
            assert tiny["residency"] == "device" and tiny["device_bytes"] == total and tiny["state"] == "ready", tiny
        assert len(d.worker_pids()) == 1

    asyncio.run(go())


def test_a_model_never_seen_is_loaded_by_its_first_request_and_completed_with_its_own_defaults(
        daemon_factory: Any) -> None:
    d: Daemon = daemon_factory("--model", "tiny", "--no-persist", "--preload", "none")
    assert d.worker_pids() == []

    async def go() -> None:
        async with http(d.socket) as s:
            assert (await get(s, "/ready"))[0] == 200
            assert (await models_by_name(s))["tiny"]["residency"] == "disk"
            # no size nor steps given: tiny's own defaults (128x128, 4 steps), not the generic 512x512 and 25,
            # which a request checked before the model loaded would have been completed with
            job = await submit(s, {"prompt": "a lighthouse", "seed": 3})
            r = job["request"]
            assert (r["width"], r["height"], r["steps"]) == (128, 128, 4), r
            end = await wait_job(s, job["id"])
            assert end["status"] == "succeeded", end
            assert (await models_by_name(s))["tiny"]["residency"] == "device"

    asyncio.run(go())


def test_preload_one_of_two_loads_it_and_the_other_waits_on_disk_for_its_job(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory("--model", "a=tiny", "--model", "b=tiny", "--no-persist", "--preload", "a")
    assert len(d.worker_pids()) == 1, "only a's worker"

    async def go() -> None:
        async with http(d.socket) as s:
            models = await models_by_name(s)
            assert models["a"]["residency"] == "device" and models["b"]["residency"] == "disk", models
            assert models["a"]["state"] == "ready" and models["b"]["state"] == "unloaded", models
            async with s.post("/v1/models/b/unload") as r:  # never loaded: nothing to send away
                body = await r.json()
                assert r.status == 200 and body["residency"] == "disk" and body["state"] == "unloaded", body
            end = await wait_job(s, (await submit(s, {**JOB, "model": "b"}))["id"])
            assert end["status"] == "succeeded", end
            models = await models_by_name(s)
            assert models["a"]["residency"] == "device" and models["b"]["residency"] == "device", models
            assert models["b"]["state"] == "ready", models
            async with s.post("/v1/models/a/unload") as r:  # sent away by hand: not loaded, still no fault
                body = await r.json()
                assert r.status == 200 and body["residency"] == "disk" and body["state"] == "unloaded", body
        assert len(d.worker_pids()) == 1
        # what `diffusiond models` prints, the word a user reads
        cli = subprocess.run([sys.executable, "-m", "diffusiond", "models", "--socket", str(d.socket)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        rows = {line.split()[0]: line.split() for line in cli.stdout.splitlines()[1:] if line.strip()}
        assert "unloaded" in rows["a"] and "ready" in rows["b"], cli.stdout
        assert "unavailable" not in cli.stdout, cli.stdout

    asyncio.run(go())


def test_a_table_with_preload_false_stays_on_disk(daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nname = "a"\nspec = "tiny"\npreload = false\n'
                      '[[models]]\nname = "b"\nspec = "tiny"\n')
    d: Daemon = daemon_factory("--config", str(config), "--no-persist")
    assert len(d.worker_pids()) == 1

    async def go() -> None:
        async with http(d.socket) as s:
            models = await models_by_name(s)
            assert models["a"]["residency"] == "disk" and models["b"]["residency"] == "device", models
            async with s.post("/v1/models/a/load") as r:  # by hand: its first load, never seen before
                body = await r.json()
                assert r.status == 200 and body["residency"] == "device" and body["device_bytes"] > 0, body
        assert len(d.worker_pids()) == 2

    asyncio.run(go())


def test_a_preload_name_that_is_not_a_model_stops_the_start_naming_the_models(tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    r = subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--no-persist",
                        "--model", "a=tiny", "--model", "b=tiny", "--preload", "a,nope"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--preload nope: no such model (models: a, b; or all, or none)" in r.stderr, r.stderr
    assert not sock.exists(), "refused before anything started"


def test_a_first_load_that_fails_is_a_503_naming_the_model_and_the_daemon_goes_on(daemon_factory: Any) -> None:
    # the fault fails every worker's start: a daemon that preloaded would not start at all
    d: Daemon = daemon_factory("--model", "tiny", "--no-persist", "--preload", "none", "--test-fault", "fail_start")

    async def go() -> None:
        async with http(d.socket) as s:
            for _ in range(2):  # each request tries the load again
                async with s.post("/v1/jobs", json=JOB) as r:
                    body = await r.json()
                    assert r.status == 503, body
                err = body["error"]
                assert err["code"] == "model_load_failed" and "'tiny' could not be loaded" in err["message"], err
                assert "injected start-up failure" in err["message"], err
            assert (await get(s, "/ready"))[0] == 200
            tiny = (await models_by_name(s))["tiny"]
            # its load failed: "unavailable", with the reason, not "unloaded" as if the next job would run
            assert tiny["residency"] == "disk" and tiny["state"] == "unavailable", tiny
            assert "injected start-up failure" in tiny["residency_reason"], tiny

            async def no_worker_left() -> bool:  # a worker whose start failed exits by itself (exit 1)
                return d.worker_pids() == []

            await until(no_worker_left, 30, "the failed workers to exit")

    asyncio.run(go())


def test_a_model_waiting_its_turn_in_the_preload_is_unloaded_not_unavailable(daemon_factory: Any) -> None:
    """The start loads a, then b: until b's turn it has no worker, and its job would load it; GET /v1/models must
    not call it ``unavailable`` meanwhile, as it did. Each load is slowed so that b waits."""
    d: Daemon = daemon_factory("--model", "a=tiny", "--model", "b=tiny", "--no-persist", "--preload", "a,b",
                               "--test-fault", "load_delay_ms=3000", start=False)
    d.start(loaded=False)

    async def go() -> list[dict[str, str]]:
        seen = []
        async with http(d.socket) as s:
            while True:
                _, ready = await get(s, "/ready")
                seen.append({name: m["state"] for name, m in (await models_by_name(s)).items()})
                if ready["preload"]["state"] == "done":
                    return seen
                await asyncio.sleep(0.2)

    seen = asyncio.run(go())
    assert not any("unavailable" in states.values() for states in seen), seen
    assert any(states["b"] == "unloaded" and states["a"] != "ready" for states in seen), seen
    assert seen[-1] == {"a": "ready", "b": "ready"}, seen
