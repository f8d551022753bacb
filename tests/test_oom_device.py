"""An out-of-memory retry makes room on the device that ran out, not on every device of its model: a model on
cuda:0 and cuda:1 whose worker on one of them reports ``oom_retry`` sent the idle models of both devices away, and
the one on the other device, which had nothing to do with it, loaded again for its next job. The policy with the
residency fakes, and the engine with fake workers on two fake GPUs (the worker's device goes from flights through
the keeper).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness, until
from residencykit import Engine, G, S

import diffusiond.daemon.residency.decisions as dec
from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.residency.policy import Residency
from diffusiond.ipc.messages import Progress, Ready
from diffusiond.protocol import JobStatus, WorkerState


def test_the_policy_sends_away_only_the_idle_models_on_the_device_that_ran_out() -> None:
    r = Residency({"cuda:0": 8 * G, "cuda:1": 8 * G}, 0)
    for name, devices in (("m", ("cuda:0", "cuda:1")), ("a", ("cuda:0",)), ("b", ("cuda:1",))):
        r.add(name, devices, G)
        r.measured(name, S, G)
    e = Engine(r)
    for name in "abm":
        e.run(name)
    for device, idle in (("cuda:0", "a"), ("cuda:1", "b")):
        retry = r.on_oom("m", S, 0, device=device)
        assert isinstance(retry, dec.OomRetry) and [mv.model for mv in retry.moves] == [idle], retry
    both = r.on_oom("m", S, 0)  # a device not said: any of the model's, as before
    assert isinstance(both, dec.OomRetry) and sorted(mv.model for mv in both.moves) == ["a", "b"], both


@pytest.fixture
def gib_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    async def start(self: FakeWorker, timeout: float) -> Ready:
        await asyncio.sleep(0)
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)


async def test_a_workers_oom_retry_sends_away_the_idle_model_on_its_device_only(gib_workers: None) -> None:
    models = (ModelConfig(name="m", spec="fake", devices=("cuda:0", "cuda:1")),
              ModelConfig(name="a", spec="fake", devices=("cuda:0",)),
              ModelConfig(name="b", spec="fake", devices=("cuda:1",)))
    h = Harness(models=models, device_memory="8GiB", host_memory="0", max_batch=1)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        assert {n: s.residency for n, s in keeper.snapshot().items()} == {"a": "device", "b": "device", "m": "device"}
        job = h.engine.submit(JobRequest(model="m", prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0,
                                         output_format="png", seed=1))
        await until(lambda: any(w.executed for w in h.spawned if w.config.model_name == "m"))
        worker = next(w for w in h.spawned if w.config.model_name == "m" and w.executed)
        batch = worker.executed[-1]
        worker.send(Progress(batch.batch_id, 0, batch.params.steps, oom_retry=True))
        same, other = ("a", "b") if worker.config.device == "cuda:0" else ("b", "a")
        await until(lambda: keeper.snapshot()[same].residency == "disk")
        worker.finish(batch)
        await h.settle(job)
        assert job.status == JobStatus.SUCCEEDED
        await h.settle()
        assert keeper.snapshot()[other].residency == "device", f"{other} is not on {worker.config.device}"
        assert [w.state for w in h.spawned if w.config.model_name == other] == [WorkerState.READY]
    finally:
        await h.close()
