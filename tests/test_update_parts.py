"""Live updates packed into several memfds, "parts" (issue 29): one real daemon on ``tiny``, one worker, the real
output socket. ``pack`` writes a large update's parts in parallel (writes to one memfd take turns in the kernel);
a test forces several parts on tiny's small tensors by making any size worth a part. What a user depends on: the
weights land exactly as one memfd would have brought them, a worker started later gets them again, a header that
points outside its parts is refused naming the tensor, and the engine holds no fd an update does not need.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, fds_named, http, submit, until, wait_job, when_idle
from test_lora_live import FAST, memfd, raw_update, replace_worker

import diffusiond.client.weights as client_weights
from diffusiond.client import AsyncClient
from diffusiond.client.weights import pack
from diffusiond.ipc.frames import MAX_FDS
from diffusiond.ipc.messages import UpdateLora, UpdateRefused, UpdateWeights, WeightTensor
from diffusiond.ipc.updates import MAX_PARTS

PARTS = 4
MEMFD = "diffusiond-lora-update"  # the name pack gives its memfds: /proc/PID/fd shows it


@pytest.fixture
async def sock(live_daemon: Daemon) -> Path:
    return await when_idle(live_daemon)


@pytest.fixture
def in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every update ``pack`` makes from here is split over ``PARTS`` memfds (one per tensor when it has fewer)."""
    monkeypatch.setattr(client_weights, "_PART", 1)
    monkeypatch.setattr(client_weights.os, "cpu_count", lambda: PARTS)


@pytest.fixture(scope="module")
def unet_state() -> dict[str, np.ndarray]:
    """Some of tiny's UNet parameters, changed: its output moves when they land."""
    from safetensors import safe_open

    from diffusiond.pipelines.tiny import ensure_tiny

    with safe_open(str(ensure_tiny() / "unet" / "diffusion_pytorch_model.safetensors"), "np") as f:
        names = [k for k in f.keys() if k.startswith(("conv_out.", "conv_in.", "up_blocks.0."))][:12]  # noqa: SIM118
        return {k: f.get_tensor(k) for k in names}


async def run(s: Any, lora: str | None = None) -> tuple[bytes, dict[str, Any]]:
    body = {**FAST, "loras": [{"name": lora, "weight": 1.0}]} if lora else FAST
    job = await wait_job(s, (await submit(s, body))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        return await r.read(), job


def changed(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v * np.float32(0.5) + np.float32(0.01) for k, v in state.items()}


def test_a_frame_brings_every_part() -> None:
    assert MAX_PARTS <= MAX_FDS and client_weights._MAX_PARTS <= MAX_PARTS



async def kept_fds(engine: int, count: int) -> None:
    """The engine holds ``count`` update memfds, once the superseded ones are closed (on a thread of their own)."""
    async def held() -> bool:
        return len(fds_named(engine, MEMFD)) == count

    await until(held, 10, f"the engine to hold {count} update memfds (it holds {len(fds_named(engine, MEMFD))})")

async def test_weights_in_parts_land_as_one_memfd_would_bring_them_and_are_replayed_into_a_new_worker(
        sock: Path, live_daemon: Daemon, unet_state: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = live_daemon.proc.pid if live_daemon.proc is not None else 0
    new = changed(unet_state)
    async with AsyncClient(str(sock)) as c, http(sock) as s:
        base, _ = await run(s)
        try:
            await c.update_weights("tiny", "unet", new)  # one memfd: what the parts must match
            one, _ = await run(s)
            await c.update_weights("tiny", "unet", unet_state)
            assert (await run(s))[0] == base
            held = len(fds_named(engine, MEMFD))  # the one memfd kept of tiny's unet, and any adapter's
            monkeypatch.setattr(client_weights, "_PART", 1)
            monkeypatch.setattr(client_weights.os, "cpu_count", lambda: PARTS)
            fds, tensors = pack(new)
            for fd in fds:
                os.close(fd)
            assert len(fds) == PARTS and {t.part for t in tensors} == set(range(PARTS))
            version = await c.update_weights("tiny", "unet", new)
            parted, job = await run(s)
            assert parted == one != base and job["weight_versions"] == {"unet": version}
            # kept for later workers: the parts of this update, and nothing else of the earlier ones (closed on
            # a thread of their own: kept.retire)
            await kept_fds(engine, held - 1 + PARTS)
            await replace_worker(s)
            again, job = await run(s)
            assert again == one and job["weight_versions"] == {"unet": version}
        finally:
            monkeypatch.undo()
            await c.update_weights("tiny", "unet", unet_state)  # as the module found it
        await kept_fds(engine, held)  # the restoring update's one memfd, kept for later workers


async def test_a_lora_in_parts_serves_as_its_file_does_before_and_after_a_new_worker(
        sock: Path, live_daemon: Daemon, dots_state: dict[str, Any], in_parts: None) -> None:
    engine = live_daemon.proc.pid if live_daemon.proc is not None else 0
    before = len(fds_named(engine, MEMFD))
    async with AsyncClient(str(sock)) as c, http(sock) as s:
        version = await c.update_lora("parted", dots_state)
        filed, _ = await run(s, "dots")
        parted, job = await run(s, "parted")
        assert parted == filed and job["lora_versions"] == {"parted": version}
        assert len(fds_named(engine, MEMFD)) == before + min(PARTS, len(dots_state))
        await replace_worker(s)
        again, job = await run(s, "parted")
        assert again == filed and job["lora_versions"] == {"parted": version}


async def test_a_tensor_outside_its_part_is_refused_naming_it_and_leaves_no_fd_behind(
        sock: Path, live_daemon: Daemon, unet_state: dict[str, np.ndarray]) -> None:
    """Part 0 is large enough for the tensor and part 1 is not: each part's own size bounds its tensors."""
    engine = live_daemon.proc.pid if live_daemon.proc is not None else 0
    big, small = memfd("parts-big", 1 << 16), memfd("parts-small", 256)
    try:
        weight = "conv_out.weight"
        before = len(fds_named(engine, "parts-"))
        for name, shape in ((weight, list(unet_state[weight].shape)), ("unet.conv_out.lora_A.weight", [4, 32])):
            size = int(np.prod(shape)) * 4
            assert 256 < size <= 1 << 16
            for part, says in [
                (2, f"tensor {name!r} lies in part 2; the update came with 2 memfd(s), parts 0 to 1"),
                (-1, f"tensor {name!r} lies in part -1;"),
                (1 << 40, f"tensor {name!r} lies in part {1 << 40};"),
                (1, f"tensor {name!r} ({size} bytes at offset 0 of part 1) does not lie inside that part's memfd "
                    "of 256 bytes"),
            ]:
                tensors = [WeightTensor(name, "float32", shape, 0, part)]
                msg = UpdateWeights("tiny", "unet", tensors) if name == weight else UpdateLora("parts", tensors)
                answer = await asyncio.to_thread(raw_update, sock, msg, [big, small])
                assert isinstance(answer, UpdateRefused), answer
                assert answer.status == 400 and answer.field == "tensors" and says in answer.message, answer
        answer = await asyncio.to_thread(raw_update, sock, UpdateWeights("tiny", "unet", [
            WeightTensor(weight, "float32", list(unet_state[weight].shape), 0)]), [])
        assert isinstance(answer, UpdateRefused) and answer.status == 400 and answer.field == "fd", answer
        assert f"an update carries 1 to {MAX_PARTS} memfds (its parts); this one came with 0" in answer.message
        assert len(fds_named(engine, "parts-")) == before  # every fd of a refused update closed
    finally:
        os.close(big)
        os.close(small)


async def test_an_unsealed_part_is_refused_saying_how_to_seal_it_and_leaves_no_fd_behind(
        sock: Path, live_daemon: Daemon, unet_state: dict[str, np.ndarray], tmp_path: Path) -> None:
    """The workers read an update after the call and a later worker reads the engine's copy again: a memfd its
    client could still write or shrink would give them other bytes than were checked, or a short read mid-copy."""
    engine = live_daemon.proc.pid if live_daemon.proc is not None else 0
    weight = "conv_out.weight"
    size = int(np.prod(unet_state[weight].shape)) * 4
    sealed, unsealed = memfd("parts-sealed", size), memfd("parts-open", size, sealed=False)
    try:
        before = len(fds_named(engine, "parts-"))
        tensors = [WeightTensor(weight, "float32", list(unet_state[weight].shape), 0, 0)]
        answer = await asyncio.to_thread(raw_update, sock, UpdateWeights("tiny", "unet", tensors), [sealed, unsealed])
        assert isinstance(answer, UpdateRefused) and answer.status == 400 and answer.field == "fd", answer
        assert "memfd 1 is not sealed against writes and shrinking" in answer.message
        assert "F_SEAL_SHRINK | F_SEAL_WRITE" in answer.message
        assert len(fds_named(engine, "parts-")) == before
        with open(tmp_path / "update.bin", "w+b") as file:  # a file cannot be sealed: said so, not "seal it"
            file.truncate(size)
            answer = await asyncio.to_thread(raw_update, sock, UpdateWeights("tiny", "unet", tensors),
                                             [file.fileno()])
        assert isinstance(answer, UpdateRefused) and answer.status == 400 and answer.field == "fd", answer
        assert "the update's fd 0 is a file, not a memfd" in answer.message, answer.message
        # a sealed memfd reopened write-only (or O_PATH) passed, and every worker failed reading it
        for flags, says in ((os.O_WRONLY, "the update's fd 1 was opened write-only, and the workers read it"),
                            (os.O_PATH, "the update's fd 1 cannot be read (opened with O_PATH)")):
            unreadable = os.open(f"/proc/self/fd/{sealed}", flags)
            try:
                answer = await asyncio.to_thread(raw_update, sock, UpdateWeights("tiny", "unet", tensors),
                                                 [sealed, unreadable])
            finally:
                os.close(unreadable)
            assert isinstance(answer, UpdateRefused) and answer.status == 400 and answer.field == "fd", answer
            assert says in answer.message and "send the memfd itself" in answer.message, answer.message
        assert len(fds_named(engine, "parts-")) == before
    finally:
        os.close(sealed)
        os.close(unsealed)
