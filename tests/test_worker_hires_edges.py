"""The worker's compute thread where a batch is split, cancelled or compiled beside a hires pass.

#1: a batch that runs out of memory runs again as two halves; a cancel of the second half while it upscales
used to end the whole batch ``cancelled``, the first half's finished pictures with it. Driven through the
worker's own compute thread (worker/compute.py), its out-of-memory fault (``oom=1``, worker/faults.py), its
finisher on a real ESRGAN file (tests/upscalekit.py) and its copier, with a stand-in model that draws noise.

#3: on a ``--compile``d model a ControlNet batch runs eager and says ``compiled: null``, but its hires pass ran
through the compiled edit, compiling an unannounced shape; and a plain batch whose hires size was new was not
announced as ``compiling``. torch.compile runs with the ``eager`` backend, as in tests/test_compile.py: each
graph compiled is still counted.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import torch

from diffusiond.ipc import messages as m
from diffusiond.ipc.arena import Arena
from diffusiond.ipc.upscale import HiresSpec, UpscalerSetting, UpscaleSpec
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.base import Interrupted
from diffusiond.pipelines.compile import CompiledPipeline, compilations
from diffusiond.pipelines.controlnet import ControlNets
from diffusiond.pipelines.upscalers import Upscalers
from diffusiond.worker.compute import ComputeThread
from diffusiond.worker.copier import Copier
from diffusiond.worker.faults import Faults, forward_fault
from diffusiond.worker.finish import Finisher
from diffusiond.worker.state import SharedState

CPU = torch.device("cpu")


class Noise:
    """A model that draws each request's picture from its seed, and remembers which requests each forward had."""

    name = "noise"
    device = CPU
    capabilities = SimpleNamespace(offload="none", task="text-to-image")

    def __init__(self) -> None:
        self.forwards: list[list[str]] = []

    def run(self, params: m.BatchParams, requests: list[m.RequestSpec], on_step: Any, sink: Any = None
            ) -> list[torch.Tensor]:
        self.forwards.append([r.request_id for r in requests])
        for k in range(1, params.steps + 1):
            if not on_step(k, params.steps):
                raise Interrupted(k, params.steps)
        return [torch.rand(3, params.height, params.width, generator=torch.Generator().manual_seed(r.seed))
                for r in requests]


def _compute(upscaler_file: Path, state: SharedState, posted: list[Any], cancel: list[str]) -> ComputeThread:
    """A compute thread whose first forward runs out of memory; ``cancel`` is cancelled at the first upscaler
    forward after the model ran those requests (the client's cancel arriving while their pictures upscale)."""
    pipe = Noise()
    upscalers = Upscalers({"esr": UpscalerSetting(path=str(upscaler_file), tile=32, overlap=4)}, CPU)
    model = upscalers.models["esr"]

    def upscale(x: torch.Tensor) -> torch.Tensor:
        if cancel in pipe.forwards:
            state.cancel(cancel)
        return model(x)  # type: ignore[no-any-return]

    upscalers.models["esr"] = upscale
    post = lambda msg, *_a, **_k: posted.append(msg)  # noqa: E731
    copier = Copier(Arena(4 << 20), state, post, device=CPU, slot_timeout_s=1.0)
    return ComputeThread(pipe, copier, state, post, sync_output=True, progress_interval_s=0.0,  # type: ignore[arg-type]
                         drain_timeout_s=1.0, on_exit=lambda _code: None,
                         finisher=Finisher(pipe, upscalers, state.all_cancelled),  # type: ignore[arg-type]
                         before_forward=forward_fault(Faults(oom=1), cuda=False))


def test_a_cancelled_half_of_an_out_of_memory_retry_leaves_the_other_half_its_pictures(upscaler_file: Path) -> None:
    ids = ["a", "b", "c", "d"]
    state, posted = SharedState(), []  # type: ignore[var-annotated]
    state.admit(ids)
    compute = _compute(upscaler_file, state, posted, cancel=["c", "d"])
    params = m.BatchParams(width=32, height=32, steps=2, guidance=5.0,
                           upscale=UpscaleSpec(name="esr", scale=2.0, width=64, height=64))
    batch = m.Execute(batch_id=1, params=params,
                      requests=[m.RequestSpec(request_id=r, prompt="a fox", seed=k) for k, r in enumerate(ids)])
    compute._execute(batch, [])
    assert compute.pipeline.forwards == [["a", "b"], ["c", "d"]]  # type: ignore[attr-defined]
    ended = {msg.request_id: (msg.status, msg.message) for msg in posted if isinstance(msg, m.RequestEnded)}
    ready = {msg.request_id for msg in posted if isinstance(msg, m.OutputReady)}
    assert ready == {"a", "b"}, ended
    assert set(ended) == {"c", "d"} and {s for s, _ in ended.values()} == {"cancelled"}, ended
    assert all("cancelled during compute" in why for _, why in ended.values()), ended


# 3 -------------------------------------------------------------------------------------------------------------
PLAIN = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)
HIRES = HiresSpec(width=96, height=96, strength=0.5, steps=1, schedule=2)
ONE = [m.RequestSpec(request_id="a", prompt="a red barn", seed=3)]
done = lambda _s, _t: True  # noqa: E731


def _compiled() -> CompiledPipeline:
    # dynamo's cache is per process: a test before this one may have compiled the same shapes for another tiny
    # instance, whose graphs this one would reuse. Start from none, so "compiled" and "not" both mean this test.
    torch._dynamo.reset()
    pipe = CompiledPipeline(load_pipeline("tiny", device="cpu", dtype="float32"), "default",
                            {"compile_backend": "eager"})
    with torch.inference_mode():
        pipe.run(PLAIN, ONE, done)  # the plain 64x64 shape is compiled
    return pipe


def test_a_plain_batch_whose_hires_size_is_new_is_announced_as_compiling(model_cache: Path) -> None:
    pipe = _compiled()
    hires = msgspec.structs.replace(PLAIN, hires=HIRES)
    assert not pipe.will_compile(PLAIN, 1)
    assert pipe.will_compile(hires, 1), "its first pass is a known shape, its hires pass a new one"
    before = compilations()
    with torch.inference_mode():
        Finisher(pipe, None)(hires, ONE, pipe.run(hires, ONE, done), done, None)
    assert compilations() > before, "the hires pass compiled"
    assert not pipe.will_compile(hires, 1)


def test_a_controlnet_batchs_hires_pass_on_a_compiled_model_runs_eager(model_cache: Path,
                                                                       controlnet_dir: Path) -> None:
    pipe = _compiled()
    cns = ControlNets(pipe, {"edges": str(controlnet_dir)})
    params = msgspec.structs.replace(PLAIN, hires=HIRES, controls=(m.ControlRef("edges", 1.0, 0.0, 1.0, "d"),))
    assert not pipe.will_compile(params, 1)
    control = [[np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)]]
    before = compilations()
    with torch.inference_mode():
        (out,) = Finisher(pipe, None)(params, ONE, cns.run(params, ONE, control, done), done, None)
    assert out.shape[-2:] == (96, 96)
    assert compilations() == before, "a ControlNet batch's hires pass compiled a graph"
    assert pipe.will_compile(msgspec.structs.replace(PLAIN, hires=HIRES), 1), "its size is still new to the graphs"
