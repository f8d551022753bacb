"""Failures the out-of-memory paths of the compute thread answered with the wrong words or for the wrong jobs:
a half of a batch retried after running out of memory that then fails another way failed the whole batch, the
half that had its outputs too; and a LoRA that did not fit the device's memory as a batch loaded it ended its
jobs ``generation_failed`` with torch's allocator paragraph, where the job reads ``out_of_memory`` and what
would help. The compute thread in process, on a stand-in model, out of memory injected as the tests of
worker/faults.py inject it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffusiond.ipc import messages as m
from diffusiond.ipc.arena import Arena
from diffusiond.protocol import ErrorCode
from diffusiond.worker.compute import ComputeThread
from diffusiond.worker.copier import Copier
from diffusiond.worker.faults import Faults, forward_fault
from diffusiond.worker.state import SharedState

PARAMS = m.BatchParams(width=16, height=16, steps=2, guidance=1.0)


class _Failing:
    """A model on which the requests in ``bad`` fail with a ValueError of their own (not out of memory)."""

    name, device = "failing", torch.device("cpu")
    capabilities = SimpleNamespace(offload="none", task="text-to-image")

    def __init__(self, bad: set[str]) -> None:
        self.bad = bad

    def run(self, params: m.BatchParams, requests: list[m.RequestSpec], on_step: Any, sink: Any = None) -> list[Any]:
        hit = sorted(self.bad & {r.request_id for r in requests})
        if hit:
            raise ValueError(f"the scheduler refused request {hit[0]}")
        return [torch.rand(3, params.height, params.width) for _ in requests]


def _compute(pipe: Any, posted: list[Any], *, oom: int = 0) -> ComputeThread:
    state = SharedState()
    state.admit(["a", "b", "c"])

    def post(msg: Any, *args: Any, **kw: Any) -> None:
        posted.append(msg)

    copier = Copier(Arena(4 << 20), state, post, device=torch.device("cpu"), slot_timeout_s=1.0)
    return ComputeThread(pipe, copier, state, post, sync_output=True, progress_interval_s=0.0, drain_timeout_s=1.0,
                         on_exit=lambda code: None,
                         before_forward=forward_fault(Faults(oom=oom), cuda=False) if oom else None)


def _batch(*ids: str, loras: tuple[m.LoraRef, ...] = ()) -> m.Execute:
    params = m.BatchParams(width=16, height=16, steps=2, guidance=1.0, loras=loras)
    return m.Execute(1, params, [m.RequestSpec(request_id=r, prompt="x", seed=i) for i, r in enumerate(ids)])


@pytest.mark.parametrize("bad", ["b", "a"])
def test_a_retried_half_that_fails_otherwise_fails_alone_and_the_other_half_keeps_its_outputs(bad: str) -> None:
    posted: list[Any] = []
    compute = _compute(_Failing({bad}), posted, oom=1)  # the whole batch runs out of memory: retried in halves
    compute._execute(_batch("a", "b"), [])
    ended = {msg.request_id: msg for msg in posted if isinstance(msg, m.RequestEnded)}
    ready = {msg.request_id for msg in posted if isinstance(msg, m.OutputReady)}
    good = "a" if bad == "b" else "b"
    assert ready == {good}, (ready, ended)  # before: none, the good half's outputs thrown away
    assert set(ended) == {bad}
    assert ended[bad].status == "failed" and f"the scheduler refused request {bad}" in ended[bad].message
    assert ended[bad].code != ErrorCode.OUT_OF_MEMORY  # its own error, not the retry's


class _Adapters:
    """Adapters whose loading runs out of memory, as a LoRA too large for what the device has left does."""

    def __init__(self) -> None:
        self.versions: dict[str, int] = {}
        self.loaded: dict[str, None] = {}

    def activate(self, loras: Any) -> None:
        raise MemoryError("injected out of memory loading LoRA weights")


def test_a_lora_that_runs_out_of_memory_as_it_loads_fails_its_jobs_out_of_memory_naming_it() -> None:
    posted: list[Any] = []
    compute = _compute(_Failing(set()), posted)
    compute.adapters.adapters = _Adapters()  # type: ignore[assignment]
    compute._execute(_batch("a", "b", loras=(m.LoraRef(name="big-style", weight=0.8),)), [])
    ended = {msg.request_id: msg for msg in posted if isinstance(msg, m.RequestEnded)}
    assert set(ended) == {"a", "b"}
    for msg in ended.values():
        assert msg.status == "failed"
        assert msg.code == ErrorCode.OUT_OF_MEMORY, msg  # before: "" (generation_failed)
        assert "LoRA 'big-style'" in msg.message and "out of memory" in msg.message
        assert "--max-loras" in msg.message, msg.message  # what would help
