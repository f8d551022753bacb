"""Working memory measured on a model's runs and remembered in the state dir (issue 27).

From the bottom up: the worker's meter on a CPU (a real allocation, really counted), the
measurements' entries as the state dir keeps them, the store across a reopen, the engine in
process (a fake worker's report reaches residency, the state dir, and a restarted engine's plans),
then a real daemon on CPU whose restart shows, in ``GET /v1/models``, what its first run measured.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from daemonkit import Daemon, get, http, submit, wait_job
from enginekit import Harness

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.residency.working import Measurements, Shape
from diffusiond.daemon.state.store import SqliteStore

MIB = 1 << 20


# the worker's meter ----------------------------------------------------------------------------
def test_the_cpu_meter_counts_a_forwards_transient_allocation_and_its_outputs() -> None:
    import torch

    from diffusiond.worker.memory import PeakMeter

    meter = PeakMeter(torch.device("cpu"))
    if not meter.available:
        pytest.skip("no /proc/self/clear_refs or no glibc malloc_trim here: the meter reports nothing")
    assert meter.stop([]) is None, "a meter never started reports nothing"
    meter.start()
    scratch = torch.ones(64 * MIB // 4)  # 64 MiB the forward needs for a while, then frees
    del scratch
    out = torch.zeros(4 * MIB // 4)  # 4 MiB it hands on
    got = meter.stop([out])
    assert got is not None and 60 * MIB <= got <= 100 * MIB, got
    # a second run of nothing much measures nothing much: pages already resident are not counted again
    meter.start()
    small = meter.stop([])
    assert small is not None and small < 16 * MIB, small


@pytest.mark.gpu
def test_the_cuda_meter_counts_the_allocators_peak_above_what_was_held_before() -> None:
    import torch

    from diffusiond.worker.memory import PeakMeter

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine)")
    device = torch.device("cuda:0")
    held = torch.empty(256 * MIB, dtype=torch.uint8, device=device)  # the weights, say: not counted
    meter = PeakMeter(device)
    assert meter.available
    meter.start()
    scratch = torch.empty(512 * MIB, dtype=torch.uint8, device=device)
    del scratch
    out = torch.empty(32 * MIB, dtype=torch.uint8, device=device)
    got = meter.stop([out])
    assert got is not None and 512 * MIB <= got <= 520 * MIB, got / MIB  # the outputs are in the peak already
    assert PeakMeter(device, offloaded=True).available is False, "an offloaded model's peak mixes in weights"
    del held, out


# what the state dir keeps ----------------------------------------------------------------------
def test_an_entry_round_trips_and_a_bad_one_adds_nothing() -> None:
    m = Measurements()
    m.record("a", 1000, Shape(64, 64), 5 * MIB)
    m.record("a", 1000, Shape(128, 128, 2), 40 * MIB)
    entry = m.entry("a")
    assert entry == {"weight_bytes": 1000, "peaks": {"128x128x2x1": 40 * MIB, "64x64x1x1": 5 * MIB}}
    back = Measurements()
    back.load("a", json.loads(json.dumps(entry)))
    assert back.peaks("a", 1000) == m.peaks("a", 1000)
    assert back.estimate("a", 1000, Shape(64, 64)).measured
    assert m.entry("nobody") is None
    for bad in ({"weight_bytes": -1, "peaks": {}}, {"weight_bytes": 1, "peaks": {"64x64x1x1": 1, "big": 2}},
                {"weight_bytes": 1, "peaks": {"64x64x1x1": "many"}}, ["not", "an", "object"]):
        fresh = Measurements()
        with pytest.raises(ValueError, match="model 'b'"):
            fresh.load("b", bad)
        assert fresh.entry("b") is None, f"{bad} added something"


async def test_the_store_keeps_each_models_working_memory_across_a_reopen(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    await store.open()
    assert await store.working_memory() == {}
    first = {"weight_bytes": 7, "peaks": {"64x64x1x1": 3}}
    store.remember_working("tiny=tiny", first)
    store.remember_working("tiny=tiny", {**first, "peaks": {"64x64x1x1": 5}})  # the newest replaces it
    store.remember_working("other=synthetic", first)
    await store.close()
    con = sqlite3.connect(tmp_path / "jobs.db")
    con.execute("INSERT INTO working (name, peaks) VALUES ('broken=x', '{not json')")
    con.commit()
    con.close()
    again = SqliteStore(tmp_path)
    await again.open()
    got = await again.working_memory()
    await again.close()
    assert got == {"tiny=tiny": {**first, "peaks": {"64x64x1x1": 5}}, "other=synthetic": first}


# the engine, in process --------------------------------------------------------------------------
async def run_one(h: Harness, working_bytes: int | None, **fields: Any) -> None:
    job = h.submit(**fields)
    for _ in range(50):
        if h.worker.executed and h.worker.executed[-1].requests[0].request_id.startswith(job.id):
            break
        await asyncio.sleep(0.01)
    batch = h.worker.executed[-1]
    h.worker.compute_done(batch, working_bytes)
    for k in range(len(batch.requests)):
        h.worker.output(batch, k)
    await h.settle(job)


async def test_a_measured_peak_reaches_residency_the_state_dir_and_a_restarted_engine(tmp_path: Path) -> None:
    h = Harness(store=SqliteStore(tmp_path))
    await h.engine.start()
    keeper = h.engine.keeper
    model = h.engine.model("m")
    assert not keeper.policy.estimate("m", Shape(64, 64)).measured
    await run_one(h, 12 * MIB)
    assert keeper.policy.measurements.keyed("m", model.capabilities.weight_bytes) == {"64x64x1x1": 12 * MIB}
    est = keeper.policy.estimate("m", Shape(64, 64))
    assert est.measured and est.nbytes == 12 * MIB
    await run_one(h, 3 * MIB)  # a smaller peak of the same shape: the larger one stands
    await run_one(h, None)  # not measured (a retry, a compile): nothing changes
    assert keeper.policy.measurements.keyed("m", model.capabilities.weight_bytes) == {"64x64x1x1": 12 * MIB}
    assert keeper.policy.measured("m", Shape(64, 64), 2 * MIB) is None, "an unchanged entry is not written again"
    await h.close()

    restarted = Harness(store=SqliteStore(tmp_path))
    await restarted.engine.start()
    est = restarted.engine.keeper.policy.estimate("m", Shape(64, 64))
    assert est.measured and est.nbytes == 12 * MIB, est
    weights = restarted.engine.model("m").capabilities.weight_bytes
    assert restarted.engine.keeper.policy.measurements.keyed("m", weights) == {"64x64x1x1": 12 * MIB}
    await restarted.close()

    # the same name serving another spec is another model: it does not inherit the measurement
    other = Harness(store=SqliteStore(tmp_path), models=(ModelConfig(name="m", spec="another"),))
    await other.engine.start()
    assert not other.engine.keeper.policy.estimate("m", Shape(64, 64)).measured
    await other.close()


# a real daemon on CPU ----------------------------------------------------------------------------
async def test_a_restarted_daemon_shows_the_working_memory_its_first_run_measured(
        daemon_factory: Any, tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ("--model", "tiny", "--state-dir", str(state), "--max-batch", "1")
    first: Daemon = daemon_factory(*args, env={"OMP_NUM_THREADS": "1"})
    async with http(first.socket) as s:
        _, body = await get(s, "/v1/models")
        assert body["data"][0]["working_memory"] == {}, "nothing has run yet"
        job = await submit(s, {"model": "tiny", "prompt": "a lighthouse", "width": 64, "height": 64,
                               "steps": 2, "seed": 1})
        assert (await wait_job(s, job["id"]))["status"] == "succeeded"
        _, body = await get(s, "/v1/models")
        measured = body["data"][0]["working_memory"]
    if not measured:
        pytest.skip("this system gives the worker no honest CPU peak (worker/memory.py): nothing to remember")
    assert set(measured) == {"64x64x1x1"} and 0 < measured["64x64x1x1"] < 1 << 30, measured
    first.stop()

    second: Daemon = daemon_factory(*args, env={"OMP_NUM_THREADS": "1"})
    async with http(second.socket) as s:
        _, body = await get(s, "/v1/models")
    assert body["data"][0]["working_memory"] == measured, "the restart forgot what the first run measured"
