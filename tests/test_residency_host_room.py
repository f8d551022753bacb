"""``--host-memory`` while an offloaded model loads.

- a first load (a model never seen, ``Keeper.learn``) of a model that keeps weights in host memory while on its
  device: its share was not known before (its files' headers give the device's), and once its READY said it, nothing
  made room: a model parked in host memory stayed beside it, past the budget, for good;
- a load from disk that made room in host memory began while the model dropped for it was still leaving (its worker
  not yet stopped), both held then: it waits for the drop, as a copy into host memory does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness, until
from residencykit import G, S

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.residency.decisions import WAITING_FOR_MEMORY, Evict, Fits, Move, Wait
from diffusiond.daemon.residency.policy import Residency
from diffusiond.ipc.messages import Ready
from diffusiond.protocol import WorkerState


def _o_offloaded(b_starts: asyncio.Event | None = None) -> Callable[[FakeWorker, float], Awaitable[Ready]]:
    """Workers that start at once (b's once ``b_starts`` is set) with 1 GiB of weights each; o keeps 2 GiB in host
    memory while on its device (offloaded)."""
    async def start(self: FakeWorker, timeout: float) -> Ready:
        if b_starts is not None and self.config.model_name == "b":
            await b_starts.wait()
        await asyncio.sleep(0)
        self.state = WorkerState.READY
        host = 2 * G if self.config.model_name == "o" else 0
        return Ready(self.config.model_name, self.config.device, 1.0,
                     msgspec.structs.replace(CAPS, weight_bytes=G, host_bytes=host))

    return start


async def test_a_first_load_that_keeps_weights_in_host_memory_drops_what_it_has_no_room_beside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """x (1 GiB) waits in host memory; o, never seen, keeps 2 GiB there while on its device (offloaded): with 2.5 GiB
    of host budget, x goes to disk once o's first load says so."""
    monkeypatch.setattr(FakeWorker, "start", _o_offloaded())
    h = Harness(models=(ModelConfig(name="x", spec="fake", devices=("cuda:0",)),
                        ModelConfig(name="o", spec="fake", devices=("cuda:0",), preload=False)),
                device_memory="8GiB", host_memory="2560MiB", max_batch=1)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        await h.engine.unload_model("x")
        assert keeper.snapshot()["x"].residency == "host" and not keeper.known("o")
        await h.engine.described("o")  # a request for it: its first load, which it waits for
        assert keeper.snapshot()["o"].residency == "device" and keeper.snapshot()["o"].host_bytes == 2 * G
        await until(lambda: keeper.snapshot()["x"].residency == "disk")
        assert keeper.policy.host_used() == 2 * G <= keeper.policy.host_budget
        x = next(w for w in h.spawned if w.config.model_name == "x")
        assert x.state == WorkerState.DEAD, "x's worker, which held its weights in host memory, stopped"
    finally:
        await h.close()


def test_a_load_from_disk_waits_for_the_drop_that_makes_its_room_in_host_memory() -> None:
    r = Residency({"cuda:0": 16 * G}, 3 * G)
    r.add("h", "cuda:0", 2 * G)
    r.add("o", "cuda:0", G, host_bytes=2 * G)  # offloaded: 2 GiB in host memory while on its device
    r.loading_started("h")
    r.loaded("h", 0.0)
    park = Move("h", "device", "host", "keep_alive expired")
    r.unloading(park)
    r.unloaded(park)
    first = r.plan("o", S)
    assert isinstance(first, Evict) and [(m.model, m.dst) for m in first.moves] == [("h", "disk")], first
    r.unloading(first.moves[0])  # the drop is under way: h's worker still holds its 2 GiB
    meanwhile = r.plan("o", S)
    assert isinstance(meanwhile, Wait) and meanwhile.stage == WAITING_FOR_MEMORY, meanwhile
    assert "host memory" in meanwhile.reason and "o" in meanwhile.reason
    r.unloaded(first.moves[0])
    assert r.plan("o", S) == Fits("o", "disk", r.plan("o", S).reason)


async def test_the_preload_drops_an_idle_model_from_host_memory_for_what_an_offloaded_model_keeps_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The start preloads a, b and o (o known from a last run: 1 GiB on its device, 2 GiB in host memory while
    there); a is sent to host memory while b loads (by hand here; a keep-alive that ends during a long preload does
    the same). o's load drops a to disk for its room, as any load from disk does, rather than stay on disk."""
    b_starts = asyncio.Event()
    monkeypatch.setattr(FakeWorker, "start", _o_offloaded(b_starts))
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "abo"),
                device_memory="8GiB", host_memory="2560MiB", max_batch=1)
    o = h.engine.pool.models["o"]
    o.known, o.capabilities = True, msgspec.structs.replace(CAPS, weight_bytes=G, host_bytes=2 * G)  # remembered
    await h.engine.open()
    preload = asyncio.ensure_future(h.engine.preload())
    try:
        keeper = h.engine.keeper
        await until(lambda: keeper.known("a") and keeper.policy.tier("a") == "device" and "b" in keeper.moving)
        await h.engine.unload_model("a")
        assert keeper.snapshot()["a"].residency == "host"
        b_starts.set()
        await asyncio.wait_for(preload, 5)
        status = keeper.snapshot()
        assert status["o"].residency == "device", status["o"].reason
        assert status["a"].residency == "disk" and keeper.policy.host_used() == 2 * G
    finally:
        b_starts.set()
        await h.close()
