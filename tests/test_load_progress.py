"""A job that waits for its model's load shows how far the load is (issue 27): ``loading.bytes_loaded``, from
the worker's LOAD_PROGRESS after each component it reads, in the job's view and in each ``status`` event.

One daemon on the embedded ``tiny`` model (a diffusers folder on disk, loaded through ``from_pretrained`` as any
other), started with nothing loaded; the test fault ``load_delay_ms`` holds each load after its first component,
so the stream shows a load part done.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, get, http, shared_daemon, sse, submit, wait_job

JOB = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 1, "seed": 7}


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    args = ["--model", "tiny", "--no-persist", "--preload", "none", "--job-timeout", "120",
            "--test-fault", "load_delay_ms=1500"]
    with shared_daemon(tmp_path_factory.mktemp("loadprog"), args, model_cache) as d:
        yield d


async def loading_events(s: aiohttp.ClientSession) -> list[dict[str, Any]]:
    """The ``loading`` entries of a new job's status events while it waits for its model's load."""
    job = await submit(s, JOB)
    assert job["stage"] == "loading", job
    events = await sse(s, job["id"])
    assert events[-1][0] == "done", events
    end = await wait_job(s, job["id"])
    assert end["status"] == "succeeded" and end["loading"] is None, end
    return [e["loading"] for name, e in events if name == "status" and e["stage"] == "loading"]


def test_a_load_reports_the_bytes_read_so_far_up_to_the_models_size(cold: Daemon) -> None:
    async def go() -> None:
        async with http(cold.socket) as s:
            # never seen: its admission waits for a first load, which learns its defaults and size
            first = await wait_job(s, (await submit(s, JOB))["id"])
            assert first["status"] == "succeeded", first
            _, models = await get(s, "/v1/models")
            size = next(m for m in models["data"] if m["id"] == "tiny")["device_bytes"]
            assert size > 0, models

            # off its device (to disk: its worker stops), then loaded again by the next job, which waits for it
            async with s.post("/v1/models/tiny/unload") as r:
                assert r.status == 200, await r.text()
            loading = await loading_events(s)
            assert loading and all(e == {"model": "tiny", "bytes_loaded": e["bytes_loaded"], "bytes_total": size}
                                   for e in loading), loading
            # null until the worker's first report; then part of the model, growing, ending at its size
            reported = [e["bytes_loaded"] for e in loading]
            figures = reported[next((i for i, n in enumerate(reported) if n is not None), len(reported)):]
            assert figures and None not in figures and figures == sorted(figures), loading
            assert 0 < figures[0] < size and figures[-1] == size, (figures, size)

    asyncio.run(go())



# an offloaded model: a CPU daemon cannot offload, so the worker's figures are read in process --
def test_an_offloaded_loads_total_is_what_its_reports_reach_not_its_device_share(model_cache: Path) -> None:
    """Under ``offload=model|group|sequential`` a model keeps one component, group or layer on its device and reads
    every component: the total was its device share, which the reports passed after the first component, so the
    view read 100% for most of the load. The total is now what the reports add up to."""
    from types import SimpleNamespace

    import diffusiond.pipelines.offload as offload
    from diffusiond.daemon.residency.load_reports import LoadReports
    from diffusiond.ipc.messages import Capabilities
    from diffusiond.pipelines import load_pipeline
    from diffusiond.pipelines.load_progress import reporting
    from diffusiond.protocol import WorkerState

    reports: list[int] = []
    with reporting(reports.append):
        pipe = load_pipeline("tiny")
    inner = pipe._pipe  # type: ignore[attr-defined]
    assert len(reports) > 1, reports

    def seen(caps: Capabilities) -> tuple[list[int | None], int | None]:
        """What the engine shows after each of the worker's reports, and its total (keeper's ``load_bytes``)."""
        model: Any = SimpleNamespace(name="tiny", known=True, capabilities=caps,
                                     workers=[SimpleNamespace(id=1, state=WorkerState.STARTING)])
        loads, shown = LoadReports(), []
        for n in reports:
            loads.record(model, 1, n)
            shown.append(loads.so_far(model, loads.total(model)))
        return shown, loads.total(model)

    for mode in ("model", "group", "sequential"):
        device = offload.device_bytes(inner, mode)
        assert device < reports[-1], (mode, device, reports)
        shown, total = seen(Capabilities(offload=mode, weight_bytes=device, host_bytes=offload.host_bytes(inner, mode)))
        assert shown == reports and total == reports[-1], (mode, shown, total)
    shown, total = seen(Capabilities(weight_bytes=reports[-1]))  # resident: its weights, all on the device
    assert shown == reports and total == reports[-1], (shown, total)
    # stream keeps its resident blocks on the device and out of its host share: the two together cover the read
    _, total = seen(Capabilities(offload="stream", weight_bytes=3, host_bytes=reports[-1] - 2))
    assert total is not None and total > reports[-1]


def test_generate_in_a_pipe_says_its_job_waits_for_the_load(cold: Daemon, tmp_path: Path) -> None:
    """``diffusiond generate`` off a terminal printed nothing until step 1, however long the load took."""
    from test_daemon_cli import cli

    async def unloaded() -> None:
        async with http(cold.socket) as s:
            assert (await wait_job(s, (await submit(s, JOB))["id"]))["status"] == "succeeded"  # known, then off
            async with s.post("/v1/models/tiny/unload") as r:
                assert r.status == 200, await r.text()

    asyncio.run(unloaded())
    r = cli("generate", "a fox", "--socket", str(cold.socket), "--size", "64x64", "--steps", "1",
            "-o", str(tmp_path / "fox.png"))
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    loading = next(i for i, line in enumerate(lines) if re.fullmatch(r"job j_\w+ loading", line))
    step = next(i for i, line in enumerate(lines) if re.fullmatch(r"job j_\w+ step 1/1 \(100 %\)", line))
    assert loading < step, r.stderr

