"""Turns (``--max-model-wait``) on every device a model uses (issue 27): a model with a worker on two devices is
in the way of a model waiting for either, not only for its first. The rule (``turns.py``), then the engine
with fake workers on two fake GPUs (a model that yields goes to host memory, as on a real one).
"""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness
from test_residency_turns import B, G, st, submit

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.residency.turns import Standing, Turns
from diffusiond.ipc.messages import Ready
from diffusiond.protocol import JobStatus, WorkerState


def on(name: str, *devices: str, **kw: object) -> Standing:
    return dataclasses.replace(st(name, device=devices[0], **kw), devices=devices)  # type: ignore[arg-type]


@pytest.mark.parametrize(("a", "b", "device"), [
    (on("a", "cuda:0", "cuda:1", running=True, oldest=0.0), st("b", "host", device="cuda:1", oldest=0.0, blocked=True),
     "cuda:1"),
    (st("a", device="cuda:1", running=True, oldest=0.0), on("b", "cuda:0", "cuda:1", tier="host", oldest=0.0,
                                                            blocked=True), "cuda:1"),
])
def test_a_model_on_several_devices_takes_turns_on_each(a: Standing, b: Standing, device: str) -> None:
    begun, _ = Turns(B).review([a, b], now=B + 1)
    assert [(h.model, h.for_model, h.device) for h in begun] == [("a", "b", device)]
    assert f"has waited 31.0 s for {device}" in begun[0].reason


def test_models_on_devices_they_do_not_share_take_no_turns() -> None:
    a = on("a", "cuda:0", "cuda:1", running=True, oldest=0.0)
    assert Turns(B).review([a, st("b", "host", device="cuda:2", oldest=0.0, blocked=True)], now=10 * B) == ([], [])


def test_a_model_in_the_way_only_on_a_device_the_waiting_model_has_room_on_is_not_held() -> None:
    """Model w (on cuda:0 and cuda:1) is short of memory on cuda:1 only, where c runs; b, on cuda:0
    alone, has waited least, but sending it away frees nothing w lacks: c is held, for cuda:1."""
    w = dataclasses.replace(on("w", "cuda:0", "cuda:1", tier="host", oldest=0.0, blocked=True), short=("cuda:1",))
    b = st("b", device="cuda:0", running=True)
    c = st("c", device="cuda:1", running=True, oldest=0.0)
    begun, _ = Turns(B).review([w, b, c], now=B + 1)
    assert [(h.model, h.for_model, h.device) for h in begun] == [("c", "w", "cuda:1")]
    begun, _ = Turns(B).review([dataclasses.replace(w, short=()), b, c], now=B + 1)  # short anywhere: b may be
    assert [(h.model, h.device) for h in begun] == [("b", "cuda:0")]


async def test_a_model_on_two_gpus_yields_the_one_a_waiting_models_job_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``a`` (4 GiB, a worker on cuda:0 and on cuda:1) keeps a steady stream; ``b`` (4 GiB, on cuda:1) waits for
    cuda:1, whose 6 GiB budget holds one of them. Turns went by a model's first device only, so b waited for as
    long as a's stream lasted."""
    async def start(self: FakeWorker, timeout: float) -> Ready:
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=4 * G))

    monkeypatch.setattr(FakeWorker, "start", start)
    h = Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0", "cuda:1")),
                        ModelConfig(name="b", spec="fake", devices=("cuda:1",))),
                device_memory="6GiB", host_memory="64GiB", max_batch=1, max_model_wait="0.2s")
    await h.engine.start()
    try:
        a_jobs = [submit(h, "a") for _ in range(4)]
        b_job = submit(h, "b")
        finished: set[int] = set()
        for _ in range(300):  # each finished batch of a brings a new job of a: a stream that never runs dry
            if b_job.terminal:
                break
            for w in [w for w in h.spawned if w.state == WorkerState.READY]:
                for batch in [x for x in w.executed if id(x) not in finished]:
                    finished.add(id(batch))
                    w.finish(batch)
                    if w.config.model_name == "a":
                        a_jobs.append(submit(h, "a"))
            await h.settle()
            await asyncio.sleep(0.02)
        assert b_job.status == JobStatus.SUCCEEDED, f"b's job is {b_job.stage_label} behind a's stream"
        assert h.engine.metrics.registry.get_sample_value(
            "diffusiond_model_evictions_total", {"model": "a", "reason": "max_model_wait"}) == 1
    finally:
        await h.close()


def test_a_plan_that_waits_for_memory_names_the_devices_short_of_it() -> None:
    """What the keeper gives the turns as ``Standing.short``: w (4 GiB a worker, on both devices) has room on
    cuda:0 (b, running, holds 4 of 10 GiB) and lacks it on cuda:1 (c, running, holds 8)."""
    from diffusiond.daemon.residency.decisions import Wait
    from diffusiond.daemon.residency.policy import Residency
    from diffusiond.daemon.residency.working import Shape

    r = Residency({"cuda:0": 10 * G, "cuda:1": 10 * G}, 64 * G)
    r.add("w", ("cuda:0", "cuda:1"), 4 * G)
    for name, device, size in (("b", "cuda:0", 4 * G), ("c", "cuda:1", 8 * G)):
        r.add(name, device, size)
        r.loading_started(name)
        r.loaded(name, 0.0)
        r.measured(name, Shape(64, 64), 0)
        r.queue(name)
        r.start(name, Shape(64, 64), 0.0)
    plan = r.plan("w", None)
    assert isinstance(plan, Wait) and plan.short == ("cuda:1",), plan
