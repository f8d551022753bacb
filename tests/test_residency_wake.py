"""Moves between host memory and the device, against the engine with fake workers on a fake GPU
(``cuda:0``): a job waiting for its model's wake from host memory shows how far it is (issue 27's
``loading.bytes_loaded``, 0 then all of it: the wake is one copy and one wait, with nothing to report between);
a job's evictions copy a model into host memory only once the drop that makes its room there has ended;
a level-1 sleep that comes during a wake from host memory which outlasts the drain sends that model back too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness, job, until  # a job for a model; a check that comes true soon
from residencykit import G

from diffusiond.commands.admin import asleep_line
from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.workers.link import Command
from diffusiond.ipc.messages import Ack, Ready, Sleep, Wake
from diffusiond.protocol import Event, WorkerState


@pytest.fixture
def wakes(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Workers load 1 GiB each; a WAKE (host -> device) ends once this event is set."""
    release = asyncio.Event()
    command = FakeWorker.command

    async def start(self: FakeWorker, timeout: float) -> Ready:
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    async def slow_wake(self: FakeWorker, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        if isinstance(msg, Wake):
            await release.wait()
        return await command(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "start", start)
    monkeypatch.setattr(FakeWorker, "command", slow_wake)
    return release


async def test_a_job_waiting_for_a_wake_from_host_memory_sees_0_then_all_of_its_bytes(wakes: asyncio.Event) -> None:
    h = Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0",)),), device_memory="8GiB", max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("a")
        assert h.engine.keeper.snapshot()["a"].residency == "host"
        seen: list[tuple[str, int | None, int | None]] = []
        waiting = job(h, "a")
        waiting.listeners.add(lambda event, j: seen.append((j.stage_label, j.bytes_loaded, j.load_bytes))
                              if event == Event.STATUS else None)
        await until(lambda: waiting.bytes_loaded == 0)
        assert (waiting.stage_label, waiting.load_bytes) == ("loading", G), "the wake has begun: 0 of its bytes"
        wakes.set()
        await until(lambda: bool(h.spawned[-1].executed))
        assert ("loading", 0, G) in seen and ("loading", G, G) in seen, seen
        assert seen.index(("loading", 0, G)) < seen.index(("loading", G, G)), seen
        assert h.engine.keeper.loads.so_far(h.engine.pool.models["a"], G) is None, "forgotten once it has ended"
    finally:
        await h.close()


async def test_a_jobs_evictions_copy_into_host_memory_only_after_the_drop_that_makes_its_room(
        wakes: asyncio.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27: the drop (d's worker stops) and the copy (a's worker sleeps) of one plan ran side by side, so
    host memory briefly held both d's and a's weights, past ``--host-memory``."""
    dropped, order = asyncio.Event(), []
    stop = FakeWorker.stop

    async def slow_stop(self: FakeWorker, timeout: float) -> None:
        order.append(f"{self.config.model_name} stops")
        if self.config.model_name == "d":
            await dropped.wait()
        await stop(self, timeout)

    monkeypatch.setattr(FakeWorker, "stop", slow_stop)
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "dabc"),
                device_memory="2560MiB", host_memory="1GiB", max_batch=1)  # the device holds two, host memory one
    await h.engine.start()
    try:
        await h.engine.unload_model("d")
        await h.engine.load_model("b")
        places = {n: s.residency for n, s in h.engine.keeper.snapshot().items()}
        assert places == {"a": "device", "b": "device", "c": "disk", "d": "host"}, places
        order.clear()
        job(h, "c")  # a (least recently used) leaves for host memory, where d (older still) makes it room
        await until(lambda: "d stops" in order)
        await asyncio.sleep(0.05)
        a = next(w for w in h.spawned if w.config.model_name == "a")
        assert order == ["d stops"] and not any(isinstance(c, Sleep) for c in a.commands), \
            "a's copy waits: host memory holds d's weights until d's worker has stopped"
        dropped.set()
        await until(lambda: h.engine.keeper.snapshot()["c"].residency == "device")
        assert h.engine.keeper.snapshot()["a"].residency == "host"
    finally:
        dropped.set()
        await h.close()


async def test_a_level_1_sleep_racing_a_wake_past_the_drain_sends_that_model_back_to_host_memory(
        wakes: asyncio.Event) -> None:
    """Issue 27: the wake ended after the drain's deadline, and its worker stayed awake on the device."""
    h = Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0",)),), device_memory="8GiB",
                drain_grace_s=0.1, max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("a")
        waiting = job(h, "a")
        await until(lambda: waiting.bytes_loaded == 0)  # its wake from host memory is under way
        sleeping = asyncio.ensure_future(h.engine.sleep(1))
        await asyncio.sleep(0.3)  # past the drain's deadline
        assert not sleeping.done(), "the sleep waits for the wake under way"
        wakes.set()
        answer = await sleeping
        assert answer["models"]["a"]["residency"] == "host" and answer["stayed"] == {}, answer
        assert [w.state for w in h.spawned if w.state != WorkerState.DEAD] == [WorkerState.SLEEPING]
        assert not waiting.terminal, "its job waits for the wake"
        await h.engine.wake()
        await until(lambda: bool(h.spawned[-1].executed))
    finally:
        await h.close()


def test_the_cli_says_why_a_model_stayed_on_its_device() -> None:
    answer = {"level": 1, "models": {"a": {"residency": "device", "device": "cuda:0", "workers": 1}},
              "stayed": {"a": "1 output(s) still running when the drain ended (--drain-grace-s)"}}
    line = asleep_line(answer, 1)
    assert "a still on its device (1 output(s) still running when the drain ended" in line, line
