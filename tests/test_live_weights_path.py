"""The bytes of a whole-component update (issue 29): ``bench_live.py weights`` on SDXL's UNet printed nothing in
200 s. The client's check for NaN and infinity wrote a mask as large as each tensor (12 s of a CPU's time for a
UNet), and the worker copied the whole update out of the memfd before copying it again into the parameters. Now
each tensor is checked chunk by chunk, and the worker reads from the memfd straight into the parameters; these tests
hold what that must keep: every non-finite value is still caught, the values applied are the ones sent, in each
dtype, and the memfd is sealed, so what a worker started later reads again is what was sent.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import diffusiond.client.weights as client_weights
from diffusiond.client.weights import pack
from diffusiond.ipc.messages import Ack, UpdateWeights
from diffusiond.pipelines.errors import HalfApplied
from diffusiond.worker import update_copy
from diffusiond.worker.adapters import LiveAdapters
from diffusiond.worker.weights import apply_weights, read_tensors

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 4097, -1])
def test_a_non_finite_value_anywhere_is_refused_before_anything_is_sent(dtype: torch.dtype, bad: float,
                                                                        where: int) -> None:
    t = torch.randn(3, 4096, dtype=dtype).view(-1)
    t[where] = bad
    with pytest.raises(ValueError, match=r"tensor 'unet.w' holds NaN or infinite values"):
        pack({"unet.ok": torch.ones(2, dtype=dtype), "unet.w": t.view(3, 4096)})


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_written_in_chunks_by_threads_arrive_whole_and_the_first_bad_one_is_named(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pack`` checks and writes chunks on a few threads (a 4.8 GB UNet took seconds on one): with chunks of 4 KiB,
    every tensor spans several, and they still arrive in order, each where its header says."""
    monkeypatch.setattr(client_weights, "_CHUNK", 4096)
    monkeypatch.setattr(client_weights, "_PART", 8192)
    monkeypatch.setattr(client_weights.os, "cpu_count", lambda: 4)
    state = {f"unet.w{i}": torch.randn(7, 1000 + i, dtype=dtype) for i in range(5)}
    fds, tensors = pack(state)
    assert len(fds) == 4 and {t.part for t in tensors} == {0, 1, 2, 3}
    got = read_tensors(UpdateWeights("m", "unet", tensors, 1), fds)
    assert all(torch.equal(got[name], value) for name, value in state.items())
    state["unet.w3"].view(-1)[-1] = float("nan")  # in its last chunk
    state["unet.w4"].view(-1)[0] = float("inf")
    with pytest.raises(ValueError, match=r"tensor 'unet.w3' holds NaN"):
        pack(state)


def test_an_empty_tensor_is_finite() -> None:
    (fd,), tensors = pack({"w": torch.empty(0, 4, dtype=torch.bfloat16)})
    os.close(fd)
    assert tensors[0].shape == [0, 4]


class _Pipe:
    """What ``apply_weights`` reads of a pipeline: its diffusers ``pipe`` and that one's torch components."""

    def __init__(self, unet: torch.nn.Module) -> None:
        self.pipe = self
        self.components = {"unet": unet}


@pytest.mark.parametrize("sent", DTYPES)
def test_an_update_is_applied_with_the_values_sent_and_its_memfd_cannot_change_after(sent: torch.dtype) -> None:
    """The parameters are on the CPU (read into in place) and one of them is strided (read, then copied)."""
    unet = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8, bias=False))
    unet[1].weight = torch.nn.Parameter(torch.zeros(32, 8).t())  # not contiguous
    state = {"0.weight": torch.randn(32, 64, dtype=sent), "0.bias": torch.randn(32, dtype=sent),
             "1.weight": torch.randn(8, 32, dtype=sent)}
    (fd,), tensors = pack(state)
    msg = UpdateWeights("m", "unet", tensors, 1)
    try:
        assert apply_weights(_Pipe(unet), msg, [fd]) == ""
        for name, value in state.items():
            assert torch.equal(unet.state_dict()[name], value.float()), name
        with pytest.raises(PermissionError):  # sealed: a later worker's read (replay) gets what was sent
            os.pwrite(fd, b"\xff" * 64, tensors[0].offset)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        assert {k: v.dtype for k, v in read_tensors(msg, [os.dup(fd)]).items()} == dict.fromkeys(state, sent)
    finally:
        os.close(fd)


def test_a_misfit_anywhere_leaves_every_parameter_as_it_was() -> None:
    unet = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8, bias=False))
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    state = {"0.weight": torch.randn(32, 64), "0.bias": torch.randn(32), "1.weight": torch.randn(8, 33)}
    fds, tensors = pack(state)
    try:
        why = apply_weights(_Pipe(unet), UpdateWeights("m", "unet", tensors, 1), fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert "1.weight" in why
    assert all(torch.equal(unet.state_dict()[k], v) for k, v in before.items())


def _failing_read(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """``update_copy``'s reads fail from the ``after``-th on (counted from 0)."""
    real, calls = update_copy._read_into, [0]

    def read(*args: object) -> None:
        calls[0] += 1
        if calls[0] > after:
            raise OSError(5, "Input/output error")
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(update_copy, "_read_into", read)


def test_a_copy_that_fails_once_writing_began_is_half_applied_and_the_worker_says_it_restarts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the first byte was written is not a refusal (a refusal means nothing changed):
    the worker answers why, then raises so that its compute thread exits and the pool replaces it."""
    unet = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8, bias=False))
    state = {"0.weight": torch.randn(32, 64), "0.bias": torch.randn(32), "1.weight": torch.randn(8, 32)}
    fds, tensors = pack(state)
    _failing_read(monkeypatch, after=1)
    posted: list[Ack] = []
    live = LiveAdapters(_Pipe(unet), None, posted.append)  # type: ignore[arg-type]
    with pytest.raises(HalfApplied, match="Input/output error"):
        live.update(UpdateWeights("m", "unet", tensors, 1), fds)
    assert [a.ok for a in posted] == [False] and "the worker restarts" in posted[0].message
    assert posted[0].restarts  # the engine keeps the update for the replacement
    assert live.weight_versions == {}
    with pytest.raises(OSError):
        os.fstat(fds[0])  # closed all the same


def test_a_conversion_that_fails_before_any_write_is_a_refusal_that_changed_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Values to convert (another dtype) are read before anything is written, so their failure refuses cleanly."""
    unet = torch.nn.Sequential(torch.nn.Linear(64, 32))
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    fds, tensors = pack({"0.weight": torch.randn(32, 64, dtype=torch.float16), "0.bias": torch.randn(32)})
    _failing_read(monkeypatch, after=0)
    posted: list[Ack] = []
    LiveAdapters(_Pipe(unet), None, posted.append).update(  # type: ignore[arg-type]
        UpdateWeights("m", "unet", tensors, 1), fds)
    assert [a.ok for a in posted] == [False] and "Input/output error" in posted[0].message
    assert all(torch.equal(unet.state_dict()[k], v) for k, v in before.items())


def test_a_live_lora_keeps_its_old_values_when_their_copy_fails() -> None:
    """Kept values are what a reload loads: they change only once the loaded copy took the new ones."""
    from diffusiond.pipelines.loras import Adapters

    class _Loaded(Adapters):
        def __init__(self) -> None:  # only what update_live reads
            self.states = {"a": {"k": torch.zeros(2)}}
            self.loaded = {"a": None}  # type: ignore[assignment]
            self.versions = {"a": 1}
            self.pipe = SimpleNamespace(components={})

        @staticmethod
        def _parameter(components: Any, key: str, adapter: str) -> torch.Tensor:
            return torch.zeros(2)

    def failing(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise HalfApplied("RuntimeError: injected")

    adapters = _Loaded()
    with pytest.raises(HalfApplied):
        adapters.update_live("a", {"k": torch.ones(2)}, 2, failing)
    assert torch.equal(adapters.states["a"]["k"], torch.zeros(2)) and adapters.versions["a"] == 1


def test_a_part_the_worker_cannot_read_is_a_refusal_that_changed_nothing() -> None:
    """A sealed memfd reopened write-only fails at its first read, before a byte is written: a
    plain refusal, not ``HalfApplied`` (which makes the worker exit and every queued job fail)."""
    unet = torch.nn.Sequential(torch.nn.Linear(64, 32))
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    (fd,), tensors = pack({"0.weight": torch.randn(32, 64), "0.bias": torch.randn(32)})
    write_only = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
    os.close(fd)
    posted: list[Ack] = []
    LiveAdapters(_Pipe(unet), None, posted.append).update(  # type: ignore[arg-type]
        UpdateWeights("m", "unet", tensors, 1), [write_only])
    assert [(a.ok, a.restarts) for a in posted] == [(False, False)] and "Bad file descriptor" in posted[0].message
    assert all(torch.equal(unet.state_dict()[k], v) for k, v in before.items())


def test_staging_buffers_are_two_or_none(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """When the second buffer cannot be page-locked, the first is not kept (``_staged`` alternates
    between two: one alone failed every large update half-way, for the worker's life), and the next update tries
    again."""
    import contextlib

    real, pins = torch.empty, [0]

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.pop("pin_memory", False):
            pins[0] += 1
            if pins[0] == 2:
                raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real(*args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(update_copy, "_buffers", [])
    dst = torch.zeros(4)
    assert not update_copy._worth_staging([(dst, None)], 1 << 30, 0)
    assert update_copy._buffers == []
    assert "buffer 2 of 2 (64 MiB) could not be page-locked" in caplog.text
    assert update_copy._worth_staging([(dst, None)], 1 << 30, 0)  # tried again: both this time
    assert len(update_copy._buffers) == 2
