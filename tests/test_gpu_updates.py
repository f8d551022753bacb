"""GPU tests of live weight updates (issue 29), run on the GPU machine through the device tool (skipped without CUDA).

A whole component's update is copied from the client's memfd into the parameters through a pinned mapping
(``worker/update_copy.py``): the copies are asynchronous DMA, so what matters is that every value lands, that the
mapping is unpinned only after the copies, and that a refused update changes nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffusiond.client.weights import pack
from diffusiond.ipc import cuda_host
from diffusiond.ipc.messages import UpdateWeights
from diffusiond.worker import update_copy
from diffusiond.worker.weights import apply_weights, mapped_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]


def component() -> torch.nn.Module:
    """Large enough (about 190 MB in bf16) that the worker pins its update's mapping or stages it, with tensors
    that do not divide the staging buffer (pieces of one tensor in two buffers, several tensors in one)."""
    layers = [torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 9001), torch.nn.Linear(9001, 3)]
    return torch.nn.Sequential(*layers).to("cuda", torch.bfloat16)


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


@pytest.mark.parametrize("mode", ["pinned", "staged", "pageable"])
def test_gpu_a_whole_component_update_lands_exactly_each_way_it_can_be_copied(mode: str,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_copy, "MODE", mode)
    model = component()
    state = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    state["0.bias"] = state["0.bias"].float()  # another dtype: copied converting, beside the staged bytes
    why, marks = update(model, state)
    assert why == ""
    assert ("pinned" in marks) == (mode == "pinned"), marks
    for key, value in model.state_dict().items():
        assert torch.equal(value.cpu(), state[key].to(value.dtype)), key


def test_gpu_a_refused_update_leaves_every_parameter_as_it_was() -> None:
    model = component()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    state["2.bias"] = torch.zeros(7, dtype=torch.bfloat16)  # the last tensor misfits: nothing may be copied
    why, _ = update(model, state)
    assert "2.bias" in why
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key

