"""The page-locked host copy a model keeps once it has been parked in host memory (issue 27).

A worker on a GPU gives its model's weights one pinned host block the first time they leave the device and keeps
it for the model's life (``pipelines/hostcopy.py``), so a model woken from host memory still holds that much host
memory on its device. Residency counted 0 host bytes for it, and real host memory could pass ``--host-memory``.
Here: the room's books (``residencykit``), then the engine with fake workers that keep what they slept into.
"""

from __future__ import annotations

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness
from residencykit import Engine, G, room, tier
from test_review_engine import job, until

import diffusiond.daemon.edge.views as views
from diffusiond.daemon.config import ModelConfig
from diffusiond.ipc.messages import Ready
from diffusiond.protocol import WorkerState


def test_a_model_woken_from_host_memory_counts_the_copy_it_keeps_there() -> None:
    e = Engine(room(host=9 * G), keeps=True)  # host memory holds two
    for name in "abca":  # a: device -> host -> device, keeping its copy
        e.run(name)
    assert (tier(e.r, "a"), tier(e.r, "b"), tier(e.r, "c")) == ("device", "disk", "host")
    snap = {s.name: s for s in e.r.snapshot()}
    assert snap["a"].host_bytes == 4 * G and snap["a"].device_bytes == 4 * G
    assert e.r.host_used() == 8 * G  # before: 4 GiB (c's), a's kept copy uncounted
    e.run("b")  # a goes back into its own copy: no more host memory than it holds already
    assert tier(e.r, "a") == "host" and e.r.host_used() == 8 * G


def test_a_models_kept_copy_is_gone_once_its_workers_stop() -> None:
    e = Engine(room(host=20 * G), keeps=True)
    e.run("a")
    e.run("b")
    e.run("a")
    assert e.r.host_used() == 4 * G + 4 * G  # b parked, a's copy kept
    e.r.worker_died(["a"], "killed")
    assert e.r.host_used() == 4 * G
    e.run("a")  # from disk: new workers, no copy yet
    assert e.r.host_used() == 4 * G and {s.name: s.host_bytes for s in e.r.snapshot()}["a"] == 0
    with pytest.raises(ValueError, match="kept host bytes -1 is negative"):
        e.r.keeps("a", -1)


@pytest.fixture
def weighs_a_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake workers of 1 GiB that keep their host copy after a sleep, as a real worker on a GPU does."""
    async def start(self: FakeWorker, timeout: float) -> Ready:
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)
    monkeypatch.setattr(FakeWorker, "pins", G)


async def test_the_engine_counts_a_woken_models_kept_copy_in_models_and_metrics(weighs_a_gib: None) -> None:
    h = Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0",)),), device_memory="8GiB",
                host_memory="4GiB", max_batch=1)
    await h.engine.start()
    try:
        assert h.engine.keeper.snapshot()["a"].host_bytes == 0, "never parked: no copy"
        await h.engine.unload_model("a")
        assert h.engine.keeper.snapshot()["a"].host_bytes == G
        waiting = job(h, "a")
        await until(lambda: bool(h.spawned[-1].executed))
        h.spawned[-1].finish(h.spawned[-1].executed[-1])
        await until(lambda: waiting.terminal)
        status = h.engine.keeper.snapshot()["a"]
        assert (status.residency, status.host_bytes) == ("device", G), status
        assert views.model(h.engine, h.engine.pool.models["a"])["host_bytes"] == G  # GET /v1/models, ps
        h.engine.metrics.bind(lambda: views.health(h.engine), residency=lambda: h.engine.keeper.snapshot().values())
        metrics = h.engine.metrics.render().decode()
        assert 'diffusiond_model_bytes{device="cuda:0",model="a",tier="host"} 1.073741824e+09' in metrics
    finally:
        await h.close()
