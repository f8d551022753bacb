"""The page-locked host copy a model keeps once it has been parked in host memory (issue 27).

A worker on a GPU gives its model's weights one pinned host block the first time they leave the device and keeps
it for the model's life (``pipelines/hostcopy.py``), so a model woken from host memory still holds that much host
memory on its device. Residency counted 0 host bytes for it, and real host memory could pass ``--host-memory``.
Here: the room's books (``residencykit``), then the engine with fake workers that keep what they slept into.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness, job, until
from residencykit import Engine, G, room, tier

import diffusiond.daemon.edge.views as views
from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.residency.decisions import Release
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.workers.link import Command
from diffusiond.ipc.messages import Ack, Ready
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
    e.r.worker_died("a", "cuda:0", "killed")
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


def test_a_move_into_full_host_memory_frees_a_resident_models_kept_copy_before_dropping_a_model() -> None:
    r = room(budget=10 * G, host=9 * G, models={n: 4 * G for n in "abcd"})  # the device holds two
    e = Engine(r, keeps=True)
    for name in "abca":  # a parked once and woken (keeping its copy), b parked
        e.run(name)
    assert [tier(r, n) for n in "abcd"] == ["device", "host", "device", "disk"] and r.host_used() == 8 * G
    e.moves.clear()
    e.run("d")  # c leaves for host memory: a's kept copy is freed for it, and b stays there
    assert [(mv.model, mv.src, mv.dst) for mv in e.moves] == [("a", "device", "device"), ("c", "device", "host")]
    assert isinstance(e.moves[0], Release) and not isinstance(e.moves[1], Release)
    assert e.moves[0].reason == ("host memory is full (9.00 GiB budget) and c leaves cuda:0 for it: a, on its "
                                 "device, frees the 4.00 GiB copy of its weights it kept there")
    assert [tier(r, n) for n in "abcd"] == ["device", "host", "host", "device"] and r.host_used() == 8 * G
    assert {s.name: s.host_bytes for s in r.snapshot()}["a"] == 0


def _a_keeps_a_copy_and_b_is_parked() -> tuple[Residency, Engine]:
    """Host memory 9 GiB: a (on its device) keeps the 4 GiB copy it was woken from, b is parked there; big,
    offloaded, would keep 4 GiB there while it runs."""
    r = room(budget=10 * G, host=9 * G, models={"a": 4 * G, "b": 4 * G})
    r.add("big", "cuda:0", G, host_bytes=4 * G)
    r.measured("big", next(iter(r.measurements.peaks("a", 4 * G))), G)
    e = Engine(r, keeps=True)
    e.run("a")
    e.move(r.evict("a", "by hand").moves)  # type: ignore[union-attr]
    e.run("a")  # woken from host memory, keeping 4 GiB there
    e.run("b")
    e.move(r.evict("b", "by hand").moves)  # type: ignore[union-attr]
    return r, e


def test_an_offloaded_model_loading_from_disk_frees_kept_copies_before_dropping_models() -> None:
    r, e = _a_keeps_a_copy_and_b_is_parked()
    assert (tier(r, "a"), tier(r, "b")) == ("device", "host") and r.host_used() == 8 * G
    e.moves.clear()
    e.run("big")  # its 4 GiB host share: a's kept copy goes, b stays in host memory
    assert [(type(mv).__name__, mv.model) for mv in e.moves] == [("Release", "a")], e.moves
    assert "big, offloaded, keeps 4.00 GiB there while it runs: a, on its device, frees" in e.moves[0].reason
    assert tier(r, "b") == "host" and r.host_used() == 8 * G


def test_a_second_plan_while_a_kept_copy_is_being_freed_drops_no_other_model() -> None:
    """Any dispatch may plan again before the RELEASE's answer comes back: the copy on its way out is room about to
    be free, so b is not dropped to disk (its return would be a disk load, not a copy back) for the same need."""
    r, _ = _a_keeps_a_copy_and_b_is_parked()
    first = r.plan("big", None)
    assert [(type(mv).__name__, mv.model) for mv in first.moves] == [("Release", "a")], first  # type: ignore[union-attr]
    r.unloading(first.moves[0])  # type: ignore[union-attr]  # booked and under way, as the keeper does
    second = r.plan("big", None)
    assert not [mv for mv in getattr(second, "moves", ()) if mv.model == "b"], second
    assert tier(r, "b") == "host"


async def test_the_engine_frees_a_kept_copy_before_copying_another_model_into_host_memory(
        weighs_a_gib: None, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    command = FakeWorker.command

    async def recorded(self: FakeWorker, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        order.append(f"{self.config.model_name} {type(msg).__name__.lower()}")
        return await command(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "command", recorded)
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "abc"),
                device_memory="2560MiB", host_memory="1GiB", max_batch=1)  # the device holds two, host memory one
    await h.engine.start()
    try:
        await h.engine.unload_model("a")
        await h.engine.load_model("a")  # a keeps the 1 GiB copy it slept into: host memory is full
        status = h.engine.keeper.snapshot()
        assert (status["a"].residency, status["a"].host_bytes, status["b"].residency) == ("device", G, "device")
        order.clear()
        job(h, "c")  # b (least recently used) leaves for host memory: a frees its copy first
        await until(lambda: h.engine.keeper.snapshot()["c"].residency == "device")
        assert order[:2] == ["a release", "b sleep"], order
        status = h.engine.keeper.snapshot()
        assert (status["a"].residency, status["a"].host_bytes) == ("device", 0), status["a"]
        assert (status["b"].residency, status["b"].host_bytes) == ("host", G), status["b"]
        assert released(h, "host_memory_full") == (1, G)
    finally:
        await h.close()


def released(h: Harness, reason: str) -> tuple[int, int]:
    """``/metrics``' count and bytes of kept host copies freed for ``reason``."""
    text = h.engine.metrics.render().decode()
    count = f'diffusiond_kept_host_copies_released_total{{reason="{reason}"}} '
    nbytes = f'diffusiond_kept_host_bytes_released_total{{reason="{reason}"}} '
    found = [float(line.split()[-1]) for key in (count, nbytes) for line in text.splitlines() if line.startswith(key)]
    return (int(found[0]), int(found[1])) if len(found) == 2 else (0, 0)


async def _woken_keeping_its_copy() -> Harness:
    """One model on a GPU of 8 GiB, its metrics bound, woken from host memory: it keeps the copy it slept into."""
    h = Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0",)),), device_memory="8GiB",
                host_memory="4GiB", max_batch=1)
    h.engine.metrics.bind(lambda: views.health(h.engine), residency=lambda: h.engine.keeper.snapshot().values())
    await h.engine.start()
    await h.engine.unload_model("a")
    await h.engine.load_model("a")
    return h


async def test_a_kept_copy_shows_per_model_and_is_counted_freed_when_its_workers_stop(weighs_a_gib: None) -> None:
    """Kept bytes in ``GET /v1/models`` and their gauge; a kept copy is not released ahead of a move to disk (the
    workers' stop frees it, a RELEASE first would cost a round trip for nothing), and the books and the
    counter say it is gone then: by a level-2 sleep, and by a worker's death."""
    h = await _woken_keeping_its_copy()
    try:
        assert views.model(h.engine, h.engine.pool.models["a"])["kept_host_bytes"] == G
        assert 'diffusiond_kept_host_bytes{model="a"} 1.073741824e+09' in h.engine.metrics.render().decode()
        await h.engine.sleep(level=2)
        workers = h.spawned[:]
        assert [type(c).__name__ for w in workers for c in w.commands].count("Release") == 0
        assert all(w.state == WorkerState.DEAD for w in workers)
        status = h.engine.keeper.snapshot()["a"]
        assert (status.residency, status.host_bytes, status.kept_bytes) == ("disk", 0, 0), status
        assert released(h, "disk") == (1, G)
        await h.engine.wake()
        await h.engine.unload_model("a")
        await h.engine.load_model("a")  # from host memory again: a new copy kept
        assert h.engine.keeper.snapshot()["a"].kept_bytes == G
        h.spawned[-1].die()
        assert h.engine.keeper.snapshot()["a"].host_bytes == 0
        assert released(h, "worker_died") == (1, G)
        assert 'diffusiond_kept_host_bytes{model="a"} 0.0' in h.engine.metrics.render().decode()
    finally:
        await h.close()


def test_a_host_copy_frees_its_block_only_while_the_weights_are_on_their_device() -> None:
    """The worker's side (``HostCopy.release``). A move is CUDA's (weights on a CPU device never leave), so here
    the block a first move makes is carved by hand; ``test_gpu_residency.py`` moves a real model on a GPU."""
    import torch

    import diffusiond.pipelines.hostcopy as hostcopy

    layer = torch.nn.Linear(8, 8)
    copy = hostcopy.HostCopy([layer], torch.device("cuda:0"))
    before = hostcopy.kept()
    copy._carve([layer.weight, layer.bias])  # as its first leave does: a 512-byte aligned view each
    assert copy.nbytes == 1024 and hostcopy.kept() == before + 1024
    on_device = layer.weight.data
    layer.weight.data = copy._pinned[id(layer.weight)]  # the model away: its weight lives in the block
    assert hostcopy.release_all() == 0 and copy.nbytes == 1024, "the block is all the weights have"
    layer.weight.data = on_device  # back on its device
    assert copy.release() == 1024 and copy.nbytes == 0 and hostcopy.kept() == before


async def test_an_unload_by_hand_that_drops_another_model_for_room_stops_that_models_workers(
        weighs_a_gib: None) -> None:
    """The unload carried every move of its decision with the unloaded model: the drop of the other model out of
    host memory stopped the unloaded model's own workers, and left the other's holding its host memory."""
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "ab"),
                device_memory="2560MiB", host_memory="1GiB", max_batch=1)  # host memory holds one
    await h.engine.start()
    try:
        await h.engine.unload_model("a")
        await h.engine.unload_model("b")  # a drops to disk to make b's room in host memory
        places = {n: s.residency for n, s in h.engine.keeper.snapshot().items()}
        assert places == {"a": "disk", "b": "host"}, places
        states = {w.config.model_name: w.state for w in h.spawned}
        assert states == {"a": WorkerState.DEAD, "b": WorkerState.SLEEPING}, states
    finally:
        await h.close()


async def test_a_copy_freed_by_its_workers_death_during_a_release_is_counted_once(
        weighs_a_gib: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker dies while a RELEASE is under way; its death frees the copy (``worker_died``),
    and the release, which freed nothing, does not count it again as ``host_memory_full``."""
    h = await _woken_keeping_its_copy()
    try:
        assert h.engine.keeper.snapshot()["a"].kept_bytes == G

        async def dies(model: object) -> None:
            h.spawned[-1].die()
            raise RuntimeError("worker died")

        monkeypatch.setattr(h.engine.pool, "release_host", dies)
        await h.engine.keeper._carry((Release("a", "device", "device", "host memory full"),))
        assert released(h, "worker_died") == (1, G)
        assert released(h, "host_memory_full") == (0, 0)
    finally:
        await h.close()
