"""The pressure watch (daemon/residency/pressure.py) against a fake NVML: which device it reads, the moves
it starts when other programs take memory, jobs held while short, and a dispatch once memory is back.
The real thing, a second process allocating on the GPU, is in test_gpu_residency.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from diffusiond.daemon.residency import pressure
from diffusiond.daemon.residency.decisions import Fits, Move, Wait
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.pressure import PressureWatch, nvml_id
from diffusiond.daemon.residency.working import Shape

G = 1024**3
S = Shape(64, 64)


def test_cuda_devices_map_to_nvml_through_cuda_visible_devices() -> None:
    assert nvml_id("cuda:1", {}) == 1
    assert nvml_id("cuda", {}) == 0
    assert nvml_id("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,3"}) == 3
    assert nvml_id("cuda:0", {"CUDA_VISIBLE_DEVICES": " GPU-8f2c, 1"}) == "GPU-8f2c"
    with pytest.raises(ValueError, match="shows 1 device"):
        nvml_id("cuda:1", {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match="not a CUDA device"):
        nvml_id("cpu", {})


class Fake:
    """A fake NVML (free bytes per NVML index) and a fake keeper (records moves, does them at once)."""

    def __init__(self, r: Residency) -> None:
        self.r = r
        self.free: dict[int | str, int] = {}
        self.moves: list[Move] = []
        self.dispatches = 0

    def read(self, ident: int | str) -> int:
        return self.free[ident]

    def move(self, moves: tuple[Move, ...]) -> None:
        for mv in moves:
            self.moves.append(mv)
            self.r.unloading(mv)
            self.r.unloaded(mv)

    def dispatch(self) -> None:
        self.dispatches += 1


def _room() -> tuple[Residency, Fake, PressureWatch]:
    r = Residency({"cuda:0": 1 << 62, "cuda:1": 1 << 62}, 64 * G)
    for name, device, t in (("a", "cuda:0", 1.0), ("b", "cuda:0", 2.0), ("c", "cuda:1", 3.0)):
        r.add(name, device, 4 * G)
        r.loading_started(name)
        r.loaded(name, t)
        r.measured(name, S, G)
    f = Fake(r)
    watch = PressureWatch(r, ["cuda:0", "cuda:0", "cuda:1"], G, move=f.move, on_change=f.dispatch, read=f.read,
                          env={"CUDA_VISIBLE_DEVICES": "1,0"})
    return r, f, watch


def test_other_programs_taking_memory_send_idle_models_away_least_recent_first() -> None:
    r, f, watch = _room()
    assert watch.devices == {"cuda:0": 1, "cuda:1": 0}
    f.free = {1: 40 * G, 0: 40 * G}
    watch.poll()
    assert f.moves == [] and f.dispatches == 0
    f.free[1] = G // 2  # cuda:0 (NVML 1) is short by half a GiB: its least recently used idle model leaves
    decisions = watch.poll()
    assert [(m.model, m.src, m.dst) for m in f.moves] == [("a", "device", "host")]
    assert "other programs need the memory" in f.moves[0].reason
    assert [d.device for d in decisions] == ["cuda:0", "cuda:1"] and not any(d.waiting for d in decisions)
    assert r.tier("c") == "device", "the other GPU is not touched"


def test_while_memory_is_short_new_jobs_wait_and_go_on_when_it_is_back() -> None:
    r, f, watch = _room()
    r.queue("b")  # b has work: it never leaves
    watch.reserve_bytes = 6 * G  # a's 4 GiB leaving are not enough
    f.free = {1: 0, 0: 40 * G}
    watch.poll()
    assert [m.model for m in f.moves] == ["a"]
    assert f.dispatches == 1, "the engine is told: jobs now wait"
    plan = r.plan("a", S)
    assert isinstance(plan, Wait) and plan.stage == "waiting_for_memory" and "other programs" in plan.reason
    watch.poll()
    assert f.dispatches == 1, "nothing changed, no dispatch"
    f.free[1] = 30 * G
    watch.poll()
    assert f.dispatches == 2, "memory is back: the waiting jobs are dispatched"
    assert isinstance(r.plan("a", S), Fits)


def test_memory_freed_without_a_wait_also_dispatches() -> None:
    """A job may wait on headroom (its model needs more than is free beyond the reserve) without any
    deficit: when free memory grows, the engine dispatches again."""
    _r, f, watch = _room()
    f.free = {1: 5 * G, 0: 40 * G}
    watch.poll()
    assert f.dispatches == 0
    f.free[1] = 20 * G
    watch.poll()
    assert f.dispatches == 1


def test_a_device_nvml_cannot_read_is_logged_once_and_the_others_are_watched(caplog: pytest.LogCaptureFixture) -> None:
    _r, _f, watch = _room()

    def read(ident: int | str) -> int:
        if ident == 1:
            raise RuntimeError("GPU is lost")
        return 40 * G

    watch.read = read
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert [d.device for d in watch.poll()] == ["cuda:1"]
    assert sum("GPU is lost" in rec.getMessage() for rec in caplog.records) == 1


async def test_without_nvml_the_watch_says_so_once_and_does_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    def missing(name: str) -> object:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(pressure.importlib, "import_module", missing)
    _r, f, watch = _room()
    watch.read = None
    with caplog.at_level(logging.INFO):
        await asyncio.wait_for(watch.run(interval_s=0.01), 1)  # returns: nothing to watch with
    assert any("NVML is missing" in rec.getMessage() and "diffusiond[gpu]" in rec.getMessage()
               for rec in caplog.records)
    assert f.moves == []


def test_reserve_memory_defaults_to_a_gib_and_takes_a_size_not_a_fraction() -> None:
    from diffusiond.daemon.config import ConfigError, DaemonConfig, ModelConfig

    models = (ModelConfig(name="tiny", spec="tiny"),)
    assert DaemonConfig(models=models).validate().reserve_memory_bytes == G
    assert DaemonConfig(models=models, reserve_memory="2GiB").validate().reserve_memory_bytes == 2 * G
    with pytest.raises(ConfigError, match="reserve_memory"):
        DaemonConfig(models=models, reserve_memory="0.5").validate()


def test_pressure_and_oom_evictions_have_their_own_metric_labels() -> None:
    from diffusiond.daemon.residency.decisions import reason_label

    assert reason_label("other programs need the memory: 0 B free on cuda:0, reserve 1.0 GiB") == "pressure"
    assert reason_label("a ran out of memory at 64x64, batch 1") == "oom"
