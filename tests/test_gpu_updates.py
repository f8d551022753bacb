"""GPU tests of live weight updates (issue 29), run on the GPU machine through the device tool (skipped without CUDA).

A whole component's update is copied from the client's memfd into the parameters through a pinned mapping
(``worker/weights.py``): the copies are asynchronous DMA, so what matters is that every value lands, that the
mapping is unpinned only after the copies, and that a refused update changes nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffusiond.client.weights import pack
from diffusiond.ipc import cuda_host
from diffusiond.ipc.messages import UpdateWeights
from diffusiond.worker.weights import apply_weights, mapped_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]


def component() -> torch.nn.Module:
    """Large enough (about 150 MB in bf16) that the worker pins its update's mapping."""
    return torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(4))).to("cuda", torch.bfloat16)


def update(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[str, list[str]]:
    fd, tensors = pack(state)
    msg = UpdateWeights("m", "unet", tensors, version=1)
    pipeline = SimpleNamespace(pipe=SimpleNamespace(components={"unet": model}))
    marks: list[str] = []
    with mapped_tensors(msg, fd, marks.append) as views:
        why = apply_weights(pipeline, msg, views, marks.append)
        pinned = set(cuda_host._REGISTERED)
    assert not pinned & cuda_host._REGISTERED, "the mapping stayed pinned after the update"
    return why, marks


def test_gpu_a_whole_component_update_lands_exactly_through_the_pinned_mapping() -> None:
    model = component()
    state = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    why, marks = update(model, state)
    assert why == ""
    assert "pinned" in marks, marks  # the DMA path, not the pageable one
    for key, value in model.state_dict().items():
        assert torch.equal(value.cpu(), state[key]), key


def test_gpu_a_refused_update_leaves_every_parameter_as_it_was() -> None:
    model = component()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    state["3.bias"] = torch.zeros(7, dtype=torch.bfloat16)  # the last tensor misfits: nothing may be copied
    why, _ = update(model, state)
    assert "3.bias" in why
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key

