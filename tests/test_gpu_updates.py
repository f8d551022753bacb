"""GPU tests of live weight updates (issue 29), run on the GPU machine through the device tool (skipped without CUDA).

A whole component's update is read from the client's memfds into two pinned buffers in turn, by several threads,
and copied from there to the parameters (``worker/update_copy.py``): the copies are asynchronous DMA, so what
matters is that every value lands (pieces of a tensor in two buffers, several tensors in one, the buffers used
again by the next update) and that a refused update changes nothing.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from diffusiond.client.weights import pack
from diffusiond.ipc.messages import UpdateWeights
from diffusiond.worker import update_copy
from diffusiond.worker.weights import apply_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]


def component() -> torch.nn.Module:
    """Large enough (about 190 MB in bf16) that the worker stages its update, with tensors
    that do not divide the staging buffer (pieces of one tensor in two buffers, several tensors in one)."""
    layers = [torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 9001), torch.nn.Linear(9001, 3)]
    return torch.nn.Sequential(*layers).to("cuda", torch.bfloat16)


def update(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str:
    fds, tensors = pack(state)
    msg = UpdateWeights("m", "unet", tensors, version=1)
    pipeline = SimpleNamespace(pipe=SimpleNamespace(components={"unet": model}))
    try:
        return apply_weights(pipeline, msg, fds)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("staged", [True, False])
def test_gpu_a_whole_component_update_lands_exactly_staged_or_not(staged: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_copy, "STAGED", staged)
    model = component()
    state = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    state["0.bias"] = state["0.bias"].float()  # another dtype: copied converting, beside the staged bytes
    for _ in range(2):  # the second through the staging buffers the first left behind
        state = {k: v.clone().uniform_() if v.is_floating_point() else v for k, v in state.items()}
        assert update(model, state) == ""
        for key, value in model.state_dict().items():
            assert torch.equal(value.cpu(), state[key].to(value.dtype)), key


def test_gpu_a_refused_update_leaves_every_parameter_as_it_was() -> None:
    model = component()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    state["2.bias"] = torch.zeros(7, dtype=torch.bfloat16)  # the last tensor misfits: nothing may be copied
    assert "2.bias" in update(model, state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key



def test_gpu_host_tensors_copied_onto_the_device_land_exactly() -> None:
    """A live LoRA's tensors (``update_copy.copy_tensors``): many small ones, one of 74 MB, and one of another
    dtype (converted as it is copied)."""
    shapes = [(64, 3072)] * 40 + [(9001, 4096), (5, 7)]
    dsts = [torch.zeros(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    srcs = [torch.randn(s).to(torch.bfloat16) for s in shapes[:-1]] + [torch.randn(shapes[-1])]
    update_copy.copy_tensors(list(zip(dsts, srcs, strict=True)))
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst.cpu(), src.to(torch.bfloat16))
