"""A first pass that is not finite fails its request with the reason through an upscale or a hires pass too
: both make a picture of levels (an upscaled uint8 output, the hires pass's input), in which NaN
became black pixels that succeeded. Driven through the worker's compute thread, its finisher on a real ESRGAN
file (tests/upscalekit.py) and its copier, with a stand-in model whose picture for seed 0 is NaN."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffusiond.ipc import messages as m
from diffusiond.ipc.arena import Arena
from diffusiond.ipc.upscale import HiresSpec, UpscalerSetting, UpscaleSpec
from diffusiond.pipelines.upscalers import Upscalers
from diffusiond.worker.compute import ComputeThread
from diffusiond.worker.copier import Copier
from diffusiond.worker.finish import Finisher
from diffusiond.worker.state import SharedState

CPU = torch.device("cpu")


class Broken:
    """Draws each request's picture from its seed; seed 0's is NaN, as a float16 overflow leaves it."""

    name = "broken"
    device = CPU
    capabilities = SimpleNamespace(offload="none", task="text-to-image")

    def _pictures(self, params: m.BatchParams, requests: Any, nan: bool) -> list[torch.Tensor]:
        out = [torch.rand(3, params.height, params.width, generator=torch.Generator().manual_seed(r.seed))
               for r in requests]
        for r, picture in zip(requests, out, strict=True):
            if nan and r.seed == 0:
                picture[:, 1, 2] = float("nan")
        return out

    def run(self, params: m.BatchParams, requests: Any, on_step: Any, sink: Any = None) -> list[torch.Tensor]:
        return self._pictures(params, requests, nan=True)

    def edit(self, params: m.BatchParams, requests: Any, inputs: Any, on_step: Any,
             sink: Any = None) -> list[torch.Tensor]:
        return self._pictures(params, requests, nan=False)  # a redraw paints over a black input as if it were one


@pytest.mark.parametrize("finish", ["upscale", "hires"])
def test_a_first_pass_that_is_not_finite_fails_its_request_through_upscale_or_hires(
        upscaler_file: Path, finish: str) -> None:
    state, posted = SharedState(), []  # type: ignore[var-annotated]
    state.admit(["nan", "fine"])
    post = lambda msg, *_a, **_k: posted.append(msg)  # noqa: E731
    upscalers = Upscalers({"esr": UpscalerSetting(path=str(upscaler_file), tile=32, overlap=4)}, CPU)
    pipe = Broken()
    arena = Arena(4 << 20)  # closed at the end: a later test checks that no arena stays mapped in this process
    copier = Copier(arena, state, post, device=CPU, slot_timeout_s=1.0)
    finisher = Finisher(pipe, upscalers, state.all_cancelled)  # type: ignore[arg-type]
    compute = ComputeThread(pipe, copier, state, post, sync_output=True, progress_interval_s=0.0,  # type: ignore[arg-type]
                            drain_timeout_s=1.0, on_exit=lambda _code: None, finisher=finisher)
    if finish == "upscale":
        params = m.BatchParams(width=32, height=32, steps=1, guidance=5.0,
                               upscale=UpscaleSpec(name="esr", scale=2.0, width=64, height=64))
    else:
        params = m.BatchParams(width=32, height=32, steps=1, guidance=5.0,
                               hires=HiresSpec(width=64, height=64, strength=0.5, steps=1, schedule=2))
    requests = [m.RequestSpec(request_id="nan", prompt="a fox", seed=0),
                m.RequestSpec(request_id="fine", prompt="a fox", seed=1)]
    try:
        compute._execute(m.Execute(batch_id=1, params=params, requests=requests), [])
    finally:
        arena.close()
    ended = {msg.request_id: msg for msg in posted if isinstance(msg, m.RequestEnded)}
    ready = {msg.request_id: msg for msg in posted if isinstance(msg, m.OutputReady)}
    assert set(ended) == {"nan"} and set(ready) == {"fine"}, (ended, ready)
    assert ended["nan"].status == "failed" and "not finite" in ended["nan"].message, ended
    assert ready["fine"].tensor.shape == (64, 64, 3)
