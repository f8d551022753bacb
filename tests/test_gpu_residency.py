"""GPU tests of residency's moves (skipped without CUDA; run on the H200 through the device tool).

A model that leaves its device must really give the memory back, and one that comes back must make
the same pictures: the moves go through page-locked host buffers (``pipelines/hostcopy.py``), so a
wrong swap of a parameter's storage would show as different bytes or memory still held.
"""

from __future__ import annotations

import pytest
import torch

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import weight_bytes
from diffusiond.pipelines.registry import load_pipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]

PARAMS = BatchParams(width=64, height=64, steps=3, guidance=5.0)


def _run(pipe: object) -> torch.Tensor:
    out = pipe.run(PARAMS, [RequestSpec(request_id="r", prompt="a lighthouse", seed=3)], lambda *a: True)  # type: ignore[attr-defined]
    return out[0].float().cpu()


def test_gpu_leaving_frees_the_device_and_coming_back_makes_the_same_pictures(model_cache: object) -> None:
    pipe = load_pipeline("tiny", device="cuda:0", dtype="float16")
    before = _run(pipe)
    nbytes = weight_bytes(pipe)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(3):  # the pinned buffers are made once and reused
        pipe.sleep()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert held - torch.cuda.memory_allocated() >= 0.9 * nbytes, "the weights left the device"
        pipe.wake()  # type: ignore[attr-defined]
        assert torch.equal(_run(pipe), before)
    host = [p for c in pipe._pipe.components.values() if isinstance(c, torch.nn.Module)  # type: ignore[attr-defined]
            for p in c.parameters()]
    assert all(p.device.type == "cuda" for p in host)
    pipe.sleep()  # type: ignore[attr-defined]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in host), "away, the weights wait in pinned memory"
    pipe.wake()  # type: ignore[attr-defined]
