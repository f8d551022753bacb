"""A worker's compute and copy threads each make the worker's CUDA device their current one (torch keeps it per
thread: worker/startup.bind_thread). Where that fails (a device fallen off the bus, reset), the worker must fail
with the reason instead of losing a thread silently: a dead copy thread left every output copy waiting, a dead
compute thread a worker never ready. CPU devices bind nothing, so the threads are told they are on
CUDA and the binding is made to fail as a lost device's would."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from workerkit import bare_compute

from diffusiond.ipc.arena import Arena
from diffusiond.ipc.messages import Fatal
from diffusiond.worker import compute as compute_mod
from diffusiond.worker import copier as copier_mod
from diffusiond.worker.compute import ComputeThread
from diffusiond.worker.copier import Copier
from diffusiond.worker.state import SharedState

CPU = torch.device("cpu")


def _lost(device: Any) -> None:
    raise RuntimeError("CUDA error: unspecified launch failure")


def test_a_copy_thread_that_cannot_use_its_device_fails_the_start_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    copier = Copier(Arena(1 << 20), SharedState(), lambda *a, **k: None, device=CPU, slot_timeout_s=1.0)
    copier.cuda = True
    monkeypatch.setattr(copier_mod, "bind_thread", _lost)
    with pytest.raises(RuntimeError, match="the copy thread could not use cpu: CUDA error: unspecified launch"):
        copier.start()
    assert not copier.thread.is_alive()


def test_a_compute_thread_that_cannot_use_its_device_says_so_and_exits_the_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[Any] = []
    exits: list[int] = []
    compute: ComputeThread = bare_compute(posted, exits)  # type: ignore[assignment]
    compute.on_ready = lambda: posted.append("ready")
    compute.cuda = True
    monkeypatch.setattr(compute_mod, "bind_thread", _lost)
    compute.start()
    compute.thread.join(10)
    assert not compute.thread.is_alive() and exits == [1] and "ready" not in posted
    fatal = [p for p in posted if isinstance(p, Fatal)]
    assert len(fatal) == 1 and "the compute thread could not use cpu: RuntimeError: CUDA error" in fatal[0].message


def test_the_load_threads_make_the_workers_device_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's load runs on the worker loop's executor threads (``asyncio.to_thread``); each binds the worker's
    device as it starts, as the compute and copy threads do, so a cuda:1 worker's load makes nothing on cuda:0.
    torch.cuda.set_device is recorded, not called: this box has no second GPU."""
    import threading

    from diffusiond.worker import startup

    bound: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: bound.append((threading.get_ident(), index)))
    pool = startup.device_executor(torch.device("cuda", 1))
    try:
        ran = {pool.submit(threading.get_ident).result() for _ in range(4)}
    finally:
        pool.shutdown()
    assert ran and ran <= {thread for thread, _ in bound} and {index for _, index in bound} == {1}


def test_a_load_thread_that_cannot_use_its_device_fails_its_work_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusiond.worker import startup

    monkeypatch.setattr(startup, "bind_thread", _lost)
    pool = startup.device_executor(torch.device("cuda", 1))
    try:
        with pytest.raises(RuntimeError, match="a load thread could not use cuda:1: RuntimeError: CUDA error: "
                                               "unspecified launch failure"):
            pool.submit(lambda: None).result()
    finally:
        pool.shutdown()
