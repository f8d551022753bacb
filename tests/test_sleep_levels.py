"""Sleep and wake through residency: what a sleep frees is what residency's books say, at the level in force.

Two layers. The engine with fake workers on a fake GPU (``cuda:0``), where level 1 has a host tier to go
to: every model leaves for host memory and comes back at wake, level 2 stops every worker (also one
residency parked in host memory, and one that comes up during the sleep), a job queued meanwhile runs
after the wake, and one that passes its deadline asleep says so. Then a real daemon on CPU: level 1
frees nothing there (a CPU's memory is the host's) and says so; level 2 stops the worker processes, the
models show on disk, the sleep is counted in the evictions metric, a retired worker's arena stays
readable for the output it holds and is counted until that output goes; the wake loads the models again,
also one unloaded by hand before the sleep, and the job queued while asleep runs.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from daemonkit import Daemon, get, health, http, shared_daemon, submit, until, wait_job
from enginekit import CAPS, FakeWorker, Harness, hold_starts
from enginekit import until as until_true

from diffusiond.commands.admin import asleep_line
from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import Job, JobRequest
from diffusiond.daemon.errors import NoWorker
from diffusiond.ipc.messages import Ready, Sleep
from diffusiond.protocol import JobStatus, WorkerState

G = 1 << 30


# ---- the engine, fake workers on a fake GPU -------------------------------------------------------------

@pytest.fixture
async def gpu(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    """Models a and b, 1 GiB each, on cuda:0 with room for both; host memory unbounded."""
    async def start(self: FakeWorker, timeout: float) -> Ready:
        await asyncio.sleep(0)
        self.state = WorkerState.READY
        return Ready(self.config.model_name, "cuda:0", 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "ab"),
                device_memory="8GiB", max_batch=1)
    await h.engine.start()
    yield h
    await h.close()


def live(h: Harness, model: str) -> list[FakeWorker]:
    return [w for w in h.spawned if w.config.model_name == model and w.state != WorkerState.DEAD]


def residency(h: Harness) -> dict[str, str]:
    return {name: s.residency for name, s in h.engine.keeper.snapshot().items()}


def evictions(h: Harness, model: str) -> float | None:
    return h.engine.metrics.registry.get_sample_value("diffusiond_model_evictions_total",
                                                      {"model": model, "reason": "sleep"})


def job(h: Harness, model: str) -> Job:
    return h.engine.submit(JobRequest(model=model, prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0,
                                      output_format="png", seed=1))


async def test_level_1_sends_every_model_to_host_memory_and_wake_brings_them_back(gpu: Harness) -> None:
    h = gpu
    answer = await h.engine.sleep(1)
    assert answer["level"] == 1 and {n: m["residency"] for n, m in answer["models"].items()} == {"a": "host",
                                                                                                "b": "host"}
    assert residency(h) == {"a": "host", "b": "host"}
    assert all(s.device_bytes == 0 and s.host_bytes == G for s in h.engine.keeper.snapshot().values())
    assert evictions(h, "a") == evictions(h, "b") == 1
    assert [w.state for m in "ab" for w in live(h, m)] == [WorkerState.SLEEPING] * 2
    waiting = job(h, "a")
    await h.settle()
    assert waiting.status == JobStatus.QUEUED and not live(h, "a")[0].executed
    await h.engine.wake()
    await h.settle()
    assert residency(h) == {"a": "device", "b": "device"}
    assert len(live(h, "a")[0].executed) == 1, "the job queued while asleep runs after the wake"
    assert h.engine.pool.sleep_level == 0 and not h.engine.paused


async def test_level_2_stops_every_worker_also_asleep_and_parked_ones_and_keeps_the_deeper_level(
        gpu: Harness) -> None:
    h = gpu
    await h.engine.unload_model("b")  # residency parks b in host memory: its worker sleeps, its process stays
    assert residency(h)["b"] == "host" and live(h, "b")[0].state == WorkerState.SLEEPING
    await h.engine.sleep(1)
    answer = await h.engine.sleep(2)
    assert answer["level"] == 2 and all(m == {"residency": "disk", "device": "cuda:0", "workers": 0}
                                        for m in answer["models"].values()), answer
    assert not live(h, "a") and not live(h, "b"), "no worker is left holding memory"
    assert residency(h) == {"a": "disk", "b": "disk"}
    assert (await h.engine.sleep(1))["level"] == 2, "a lighter sleep does not undo a deeper one"
    await h.engine.wake()
    assert residency(h) == {"a": "device", "b": "device"}, "wake preloads again, b too"
    assert [w.state for m in "ab" for w in live(h, m)] == [WorkerState.READY] * 2


async def test_a_worker_that_comes_up_during_a_level_2_sleep_is_stopped_not_slept(
        gpu: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    h = gpu
    release = hold_starts(monkeypatch)
    live(h, "a")[0].die()  # its replacement starts and takes its time
    await until_true(lambda: h.engine.pool.models["a"].replacing == 1 and len(h.spawned) == 3, 2)
    replacement = h.spawned[-1]
    await h.engine.sleep(2)
    release.set()
    await until_true(lambda: h.engine.pool.models["a"].replacing == 0, 2)
    assert replacement.state == WorkerState.DEAD and not any(isinstance(c, Sleep) for c in replacement.commands)
    assert not live(h, "a") and h.engine.pool.models["a"].retired
    await h.engine.wake()
    assert residency(h)["a"] == "device" and len(live(h, "a")) == 1


async def test_no_worker_starts_at_level_2_a_never_seen_model_is_a_503_that_says_to_wake() -> None:
    h = Harness(preload=("none",))
    await h.engine.start()
    try:
        await h.engine.sleep(2)
        with pytest.raises(NoWorker, match=r"sleeps at level 2.*wake it first"):
            await h.engine.described("m")
        assert not h.spawned, "no worker process was started to learn it"
        await h.engine.wake()  # a daemon that preloads nothing loads nothing at wake
        assert not h.spawned
        await h.engine.described("m")  # awake: its first load is the request's, as always
        assert [w.state for w in h.spawned] == [WorkerState.READY]
    finally:
        await h.close()





async def test_a_job_that_passes_its_deadline_asleep_says_the_daemon_sleeps_and_how_to_wake_it() -> None:
    h = Harness(job_timeout_s=0.2)
    await h.engine.start()
    try:
        await h.engine.sleep(1)
        waiting = h.submit()
        await h.settle(waiting)
        assert waiting.status == JobStatus.FAILED and waiting.error is not None
        message = waiting.error["message"]
        assert "deadline of 0.2s while queued" in message and "asleep, sleep level 1" in message, message
        assert "diffusiond wake" in message and "/v1/admin/wake" in message
    finally:
        await h.close()


def test_the_cli_says_what_the_sleep_freed_and_not_what_it_did_not() -> None:
    cpu = {"level": 1, "took_ms": 3, "models": {"tiny": {"residency": "device", "device": "cpu", "workers": 1}}}
    line = asleep_line(cpu, 1)
    assert "freed:" not in line and "nothing freed for tiny" in line and "--level 2" in line, line
    gpu = {"level": 1, "models": {"a": {"residency": "host", "device": "cuda:0"},
                                  "b": {"residency": "disk", "device": "cuda:0"}}}
    line = asleep_line(gpu, 1)
    assert "device memory freed: a in host memory" in line and "b on disk, no worker left" in line, line
    assert "level 2 was in force already" in asleep_line({**gpu, "level": 2}, 1)


# ---- a real daemon on CPU ---------------------------------------------------------------------------------

ENV = {"OMP_NUM_THREADS": "1"}
NPY = {"model": "a", "prompt": "kept", "width": 64, "height": 64, "steps": 1, "output_format": "npy"}


@pytest.fixture(scope="module")
def cpu_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("sleep")
    args = ["--model", "a=synthetic:compute_ms=20", "--model", "b=synthetic:compute_ms=20", "--arena-mb", "8",
            "--no-persist", "--job-timeout", "120"]
    with shared_daemon(tmp, args, model_cache, ENV) as d:
        yield d


async def models(s: Any) -> dict[str, str]:
    _, body = await get(s, "/v1/models")
    return {m["id"]: m["residency"] for m in body["data"]}


async def metric(s: Any, name: str) -> str:
    async with s.get("/metrics") as r:
        return "\n".join(line for line in (await r.text()).splitlines() if line.startswith(name))


async def test_sleep_levels_on_cpu_through_residency(cpu_daemon: Daemon) -> None:
    d = cpu_daemon
    before = set(d.worker_pids())
    assert len(before) == 2
    async with http(d.socket) as s:
        kept = await wait_job(s, (await submit(s, NPY))["id"])  # its output stays in a's arena, unfetched
        async with s.post("/v1/models/b/unload") as r:  # b leaves by hand: the wake must load it again
            assert r.status == 200, await r.text()
        assert await models(s) == {"a": "device", "b": "disk"}
        a_only = set(d.worker_pids())
        assert len(a_only) == 1 and a_only < before
        try:
            async with s.post("/v1/admin/sleep?level=1") as r:
                answer = await r.json()
            assert answer["level"] == 1 and answer["models"]["a"]["residency"] == "device", answer
            assert set(d.worker_pids()) == a_only, "level 1 on a CPU stops nothing"
            h = await health(s)
            assert (h["sleeping"], h["sleep_level"]) == (True, 1)
            assert [w["state"] for w in h["workers"]] == ["sleeping"], "paused in place: nothing to free on a CPU"

            async with s.post("/v1/admin/sleep", json={"level": 2}) as r:
                answer = await r.json()
            assert answer["level"] == 2 and answer["models"]["a"] == {"residency": "disk", "device": "cpu",
                                                                      "workers": 0}, answer
            assert not set(d.worker_pids()) & before, "every worker process has exited"
            assert await models(s) == {"a": "disk", "b": "disk"}
            h = await health(s)
            assert (h["sleeping"], h["sleep_level"], h["workers"]) == (True, 2, [])
            assert 'model="a",reason="sleep"} 1.0' in await metric(s, "diffusiond_model_evictions_total")
            # a's arena stays mapped for the output it holds, and is counted
            assert h["departed_arena_bytes"] == 8 << 20, h
            assert await metric(s, "diffusiond_departed_arena_bytes") == "diffusiond_departed_arena_bytes 8.388608e+06"
            async with s.post("/v1/admin/sleep") as r:
                assert (await r.json())["level"] == 2, "the level in force"
            waiting = await submit(s, {**NPY, "prompt": "asleep", "output_format": "png"})
            async with s.get(kept["outputs"][0]["url"]) as r:  # readable from the stopped worker's arena
                assert r.status == 200 and np.load(io.BytesIO(await r.read())).shape == (64, 64, 3)

            async def unmapped() -> bool:
                return (await health(s))["departed_arena_bytes"] == 0

            await until(unmapped, 10, "the stopped worker's arena to be unmapped with its last output")
            await asyncio.sleep(0.5)
            _, still = await get(s, f"/v1/jobs/{waiting['id']}")
            assert still["status"] == "queued", still
        finally:
            async with s.post("/v1/admin/wake") as r:
                assert r.status == 200, await r.text()
        assert (await wait_job(s, waiting["id"], timeout=120))["status"] == "succeeded"
        assert await models(s) == {"a": "device", "b": "device"}, "wake preloads again, b too"
        h = await health(s)
    assert (h["sleeping"], h["sleep_level"]) == (False, 0)
    assert {w["state"] for w in h["workers"]} == {"ready"} and len(h["workers"]) == 2
