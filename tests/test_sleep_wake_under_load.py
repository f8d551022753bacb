"""Sleep, wake and start under a load that fails or straddles them: the engine with fake
workers on a fake GPU (``cuda:0``), and the keeper with a fake pool for the order of keep-alive moves.

A level-2 sleep that comes while a job's load is under way lets the load end, then frees the card; the job
waits for the wake and runs after it, and the wake does not answer 503. A wake tries again a model whose
load failed before (its files may have been fixed). A level-1 sleep leaves a model residency parked in host
memory there. A start where a model on two devices fails on one stops the worker that came up on the other,
keeps the model on disk with the reason, and serves the rest. Expired keep-alives copy a model into host
memory only once the model dropped to make its room has stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness, job, until
from residencykit import G, tier
from test_odds_expiry import _Model  # a model of the fake pool: a name and a worker

import diffusiond.daemon.residency.keeper as keeper
from diffusiond.daemon.config import DaemonConfig, ModelConfig
from diffusiond.daemon.errors import EngineError, PowerFailed
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.residency.budget import resolve
from diffusiond.daemon.residency.decisions import Move
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.workers.link import WorkerStartError
from diffusiond.ipc.messages import Ready
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState

BROKEN: set[str] = set()  # models whose worker fails to start (their files are broken)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Worker starts wait for this event (set: they go at once) and fail for the models in ``BROKEN``."""
    release = asyncio.Event()
    release.set()
    BROKEN.clear()

    async def start(self: FakeWorker, timeout: float) -> Ready:
        await release.wait()
        if self.config.model_name in BROKEN:
            self.state = WorkerState.DEAD
            raise WorkerStartError("corrupt safetensors")
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)
    return release


@pytest.fixture
async def gpu(gate: asyncio.Event) -> AsyncIterator[Harness]:
    """Models a and b, 1 GiB each, on cuda:0 with room for both; host memory for neither (unload: disk)."""
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "ab"),
                device_memory="8GiB", host_memory="1MiB", max_batch=1)
    await h.engine.start()
    yield h
    await h.close()


def residency(h: Harness) -> dict[str, str]:
    return {name: s.residency for name, s in h.engine.keeper.snapshot().items()}


def live(h: Harness, model: str) -> list[FakeWorker]:
    return [w for w in h.spawned if w.config.model_name == model and w.state != WorkerState.DEAD]


async def test_a_level_2_sleep_during_a_jobs_load_lets_the_job_run_after_the_wake(
        gpu: Harness, gate: asyncio.Event) -> None:
    h = gpu
    await h.engine.unload_model("a")
    assert residency(h)["a"] == "disk"
    gate.clear()
    waiting = job(h, "a")
    await until(lambda: "a" in h.engine.keeper.moving)
    sleeping = asyncio.ensure_future(h.engine.sleep(2))
    await asyncio.sleep(0.05)
    gate.set()  # the load ends during the sleep's drain
    answer = await sleeping
    assert answer["models"]["a"] == {"residency": "disk", "device": "cuda:0", "workers": 0}
    assert not live(h, "a") and not live(h, "b"), "level 2 freed the card, the straddling load's worker too"
    assert waiting.status == JobStatus.QUEUED and not h.engine.keeper.failed, "a sleep is no load failure"
    await h.engine.wake()
    await h.settle()
    assert residency(h) == {"a": "device", "b": "device"}
    assert len(live(h, "a")[0].executed) == 1, "the job that waited through the sleep runs after the wake"


async def test_a_wake_tries_again_a_model_whose_load_failed(gpu: Harness) -> None:
    h = gpu
    BROKEN.add("b")
    await h.engine.sleep(2)
    with pytest.raises(PowerFailed, match="b: load failed: corrupt safetensors"):
        await h.engine.wake()
    BROKEN.clear()  # its files fixed
    await h.engine.sleep(1)
    await h.engine.wake()
    assert residency(h) == {"a": "device", "b": "device"} and len(live(h, "b")) == 1


async def test_a_level_1_sleep_leaves_a_model_parked_in_host_memory_there(gate: asyncio.Event) -> None:
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "ab"),
                device_memory="8GiB", max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("b")
        assert residency(h)["b"] == "host"
        answer = await h.engine.sleep(1)
        assert answer["models"]["b"]["residency"] == "host" and answer["models"]["b"]["workers"] == 1
        assert [w.state for w in live(h, "b")] == [WorkerState.SLEEPING], "its host copy is kept"
    finally:
        await h.close()


async def test_a_model_that_fails_on_one_of_its_devices_at_start_stays_on_disk_and_the_others_serve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started = FakeWorker.start

    async def start(self: FakeWorker, timeout: float) -> Ready:  # the harness's (its fail_starts), sized 1 GiB
        ready = await started(self, timeout)
        return msgspec.structs.replace(ready, capabilities=msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)
    h = Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0", "cuda:1")),
                        ModelConfig(name="b", spec="fake", devices=("cuda:0",))),
                device_memory="8GiB", fail_starts=[None, "boom on cuda:1"])
    await h.engine.start()
    try:
        status = h.engine.keeper.snapshot()
        assert status["a"].residency == "disk" and "boom on cuda:1" in status["a"].reason
        assert status["b"].residency == "device"
        assert not live(h, "a"), "the worker that came up on cuda:0 is stopped: it would hold memory for nothing"
        job(h, "b")
        await h.settle()
        assert len(live(h, "b")[0].executed) == 1
    finally:
        await h.close()


# ---- keep-alive expiries and host memory --------------------------------------------------------------

class _Pool:
    """Records each move's start; a drop out of host memory ends when the test says. (Its models are on "cpu"
    for the pool, so no pressure watch reads a GPU; the policy places them on cuda:0, where host memory counts.)"""

    def __init__(self) -> None:
        self.models = {n: _Model(n) for n in "ad"}
        self.dropped = asyncio.Event()
        self.begun: list[str] = []

    async def retire(self, model: _Model) -> None:
        self.begun.append(f"{model.name} stops")
        await self.dropped.wait()

    async def sleep_model(self, model: _Model) -> None:
        self.begun.append(f"{model.name} copies to host")


async def test_an_expiry_copies_into_host_memory_only_after_the_drop_that_makes_its_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper, "EXPIRY_CHECK_S", 0.01)
    pool = _Pool()
    k = keeper.Keeper(DaemonConfig(), pool, Metrics(), on_change=lambda: None)  # type: ignore[arg-type]
    k.policy = room = Residency({"cuda:0": 20 * G}, G)  # host memory for one of them
    for name in "da":
        room.add(name, "cuda:0", G, keep_alive_s=0)
        room.loading_started(name)
        room.loaded(name, 0.0)
    room.unloading(Move("d", "device", "host", "test"))
    room.unloaded(Move("d", "device", "host", "test"))
    pool.models["d"].workers[0].state = WorkerState.SLEEPING
    k.started()
    try:
        await until(lambda: pool.begun == ["d stops"])
        await asyncio.sleep(0.05)
        assert pool.begun == ["d stops"], "a's copy waits: host memory holds d's until d's worker has stopped"
        assert tier(room, "a") == "device" and k.moving == {"a", "d"}, "both booked at once"
        pool.dropped.set()
        await until(lambda: tier(room, "a") == "host" and tier(room, "d") == "disk")
        assert pool.begun == ["d stops", "a copies to host"]
    finally:
        k.stop()


async def test_a_job_refused_by_the_default_budget_says_it_was_read_at_start_and_what_changes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def start(self: FakeWorker, timeout: float) -> Ready:
        self.state = WorkerState.READY
        return Ready(self.config.model_name, "cpu", 1.0, msgspec.structs.replace(CAPS, weight_bytes=1 << 50))

    monkeypatch.setattr(FakeWorker, "start", start)
    default = resolve(None, None, "cpu", read=lambda device: (8 * G, 2 * G))  # no --device-memory: free less reserve
    h = Harness(models=(ModelConfig(name="huge", spec="fake", devices=("cpu",)),),
                budgets=(("cpu", default.nbytes, default.source),))
    await h.engine.start()
    try:
        with pytest.raises(EngineError) as refused:
            job(h, "huge")
        assert refused.value.code == ErrorCode.MODEL_TOO_LARGE
        assert "free on cpu at start" in refused.value.message and "read once at the daemon's start" in \
            refused.value.message and "--device-memory" in refused.value.message and "restart" in refused.value.message
    finally:
        await h.close()
