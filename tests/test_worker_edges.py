"""A worker answering one thing and doing another: a sleep whose copies did not drain in
time moved the model anyway while it answered "not ok" (the engine went on sending batches to a sleeping model,
each failing); a preview larger than the whole arena failed its job instead of being skipped; and after an
out-of-memory split, cancelling the half that ran did not stop it. Real worker processes for the first two
(``workerkit``), the compute thread in process for the third.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from workerkit import Driver, Result, config

from diffusiond.ipc import messages as m
from diffusiond.ipc.arena import Arena
from diffusiond.pipelines.base import Interrupted
from diffusiond.worker.compute import ComputeThread
from diffusiond.worker.copier import Copier
from diffusiond.worker.faults import Faults, forward_fault
from diffusiond.worker.state import SharedState

SMALL = m.BatchParams(width=32, height=32, steps=1, guidance=1.0)


async def test_a_sleep_whose_copies_do_not_drain_moves_nothing_and_the_model_serves_on() -> None:
    async with Driver(config("synthetic:compute_ms=1", fault="copy_delay_ms=1500", drain_timeout_s=0.2)) as d:
        _, first = d.submit(SMALL, [1])  # computed before the SLEEP (one queue), its copy held 1.5 s
        ack = await d.handle.command(m.Sleep(), timeout=30)
        assert not ack.ok and "did not drain within 0.2s" in ack.message
        await d.wait(first)
        (after,) = await d.run(SMALL, [2])
        assert after.array is not None, after.ended  # before: "model synthetic is asleep; wake it before running"


async def test_a_preview_larger_than_the_arena_is_skipped_and_the_job_gets_its_output() -> None:
    params = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)
    async with Driver(config("tiny", arena_bytes=4096)) as d:  # 64x64x3 is 12 KiB: outputs go to memfds
        d.results["r"], d.batch_of["r"] = Result("r"), 900
        d.handle.execute(m.Execute(900, params, [m.RequestSpec(request_id="r", prompt="a red fox", seed=1,
                                                               preview_every=1, preview_max_side=64)]))
        (r,) = await d.wait(["r"])
        assert r.array is not None and r.desc is not None and r.desc.dedicated, r.ended


class _Counting:
    """Counts the steps each forward runs; cancels ``b`` as its half (after an out-of-memory split) starts."""

    name, device = "counting", torch.device("cpu")
    capabilities = SimpleNamespace(offload="none", task="text-to-image")

    def __init__(self, state: SharedState) -> None:
        self.state, self.steps = state, {}

    def run(self, params: m.BatchParams, requests: list[m.RequestSpec], on_step: Any, sink: Any = None) -> list[Any]:
        key = tuple(r.request_id for r in requests)
        for k in range(1, params.steps + 1):
            if key == ("b",) and k == 1:
                self.state.cancel(["b"])
            self.steps[key] = k
            if not on_step(k, params.steps):
                raise Interrupted(k, params.steps)
        return [torch.rand(3, params.height, params.width) for _ in requests]


def test_cancelling_the_half_that_runs_after_an_out_of_memory_split_stops_it() -> None:
    state, posted = SharedState(), []
    state.admit(["a", "b"])
    pipe = _Counting(state)

    def post(msg: Any, *args: Any, **kw: Any) -> None:
        posted.append(msg)

    copier = Copier(Arena(4 << 20), state, post, device=torch.device("cpu"), slot_timeout_s=1.0)
    compute = ComputeThread(pipe, copier, state, post, sync_output=True, progress_interval_s=0.0, drain_timeout_s=1.0,
                            on_exit=lambda code: None, before_forward=forward_fault(Faults(oom=1), cuda=False))
    compute._execute(m.Execute(1, m.BatchParams(width=16, height=16, steps=50, guidance=1.0),
                               [m.RequestSpec(request_id=r, prompt="x", seed=i) for i, r in enumerate("ab")]), [])
    assert pipe.steps == {("a",): 50, ("b",): 1}, pipe.steps
    ended = {msg.request_id: msg.status for msg in posted if isinstance(msg, m.RequestEnded)}
    assert ended == {"b": "cancelled"} and any(isinstance(msg, m.OutputReady) and msg.request_id == "a"
                                               for msg in posted)
