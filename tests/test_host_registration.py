"""Pinned host memory a model's copy registered with CUDA is unregistered when the copy goes with its model.

CUDA keeps a registration after the memory under it is freed: the next block the allocator put at those
addresses then failed to register ("part or all of the requested memory range is already mapped", CUDA error
712), which failed the second model loaded with a host copy or ``offload=stream`` in one process (the GPU tests
of test_gpu_residency.py, run together, on an H100, 2026-12-07). The registration calls are recorded here in
place of CUDA's, so the rule is checked on a CPU box.
"""

from __future__ import annotations

import gc

import pytest
import torch

from diffusiond.ipc import cuda_host
from diffusiond.pipelines.hostcopy import HostCopy, tensors_of


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    live: dict[int, int] = {}

    def register(address: int, nbytes: int) -> bool:
        assert all(address + nbytes <= a or a + n <= address for a, n in live.items()), "already mapped (712)"
        live[address] = nbytes
        return True

    monkeypatch.setattr(cuda_host, "register", register)
    monkeypatch.setattr(cuda_host, "unregister", lambda address, nbytes: live.pop(address, None))
    return live


def test_a_host_copy_dropped_with_its_model_unregisters_its_blocks(registry: dict[int, int]) -> None:
    for _ in range(3):  # a model loaded, dropped, and another loaded in the same process
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        copy = HostCopy([model], torch.device("cuda"))
        copy._carve([t for _, _, t, _ in tensors_of([model])])  # what leave() does before its copies
        assert len(registry) == 1 and copy.nbytes > 0
        del copy, model
        gc.collect()
        assert registry == {}


def test_a_released_host_copy_unregisters_once(registry: dict[int, int]) -> None:
    model = torch.nn.Linear(32, 32)
    copy = HostCopy([model], torch.device("cuda"))
    copy._carve([t for _, _, t, _ in tensors_of([model])])
    assert copy.release() > 0 and registry == {}
    copy._carve([t for _, _, t, _ in tensors_of([model])])  # the next leave() makes a block again
    assert len(registry) == 1
    del copy
    gc.collect()
    assert registry == {}
