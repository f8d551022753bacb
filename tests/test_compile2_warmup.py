"""The warm-up runs each shape once where no CUDA graph is recorded, twice where one is (issue 31): the
second run only exists for CUDA-graph trees, which record a shape's graph on its second run, and on a model
without them it added a whole forward per shape to the start (``--warmup WxH:all`` has several)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diffusiond.ipc import messages as m
from diffusiond.pipelines.compile import CompiledPipeline
from diffusiond.pipelines.registry import load_pipeline
from diffusiond.worker.warmup import warm_up


@pytest.fixture(autouse=True)
def _cache(model_cache: Path) -> None:
    """tiny is built once for the session."""


def forwards(pipe: Any, shapes: list[m.WarmupShape]) -> list[int]:
    """The batch sizes of the forwards the worker's warm-up runs on ``pipe``."""
    seen: list[int] = []
    inner_run = pipe.inner.run

    def counted(params: m.BatchParams, requests: Any, *rest: Any) -> Any:
        seen.append(len(requests))
        return inner_run(params, requests, *rest)

    pipe.inner.run = counted
    warm_up(pipe, shapes, cuda=False)
    return seen


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_without_cuda_graphs_each_warmup_shape_runs_once(mode: str) -> None:
    pipe = CompiledPipeline(load_pipeline("tiny", device="cpu", dtype="float32"), mode, {"compile_backend": "eager"})
    assert forwards(pipe, [m.WarmupShape(64, 64, 2), m.WarmupShape(64, 64, 1)]) == [1, 2]  # smallest first


def test_the_cuda_graph_modes_on_a_gpu_warm_up_twice() -> None:
    pipe = CompiledPipeline(load_pipeline("tiny", device="cpu", dtype="float32"), "reduce-overhead")
    for mode, device, runs in [("reduce-overhead", "cuda", 2), ("max-autotune", "cuda", 2),
                               ("max-autotune-no-cudagraphs", "cuda", 1), ("default", "cuda", 1),
                               ("reduce-overhead", "cpu", 1)]:
        pipe.mode, pipe.device = mode, torch.device(device)
        assert pipe.warmup_runs == runs, (mode, device)
