"""Live LoRA updates (``Client.update_lora``) end to end: one real daemon on ``tiny``, one worker.

The weights come from the session's LoRA files (conftest ``lora_files``: ``dots`` is UNet-only),
loaded here as a state dict and sent through the memfd path; "equal" compares raw ``npy`` bytes
against the same weights registered from a file, so it means bit for bit.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import io
import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, health, http, submit, until, wait_job, when_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusiond.client import AsyncClient, Client, DaemonError
from diffusiond.client.weights import pack
from diffusiond.ipc.channel import recv_with_fds
from diffusiond.ipc.frames import FrameDecoder, FrameEncoder
from diffusiond.ipc.messages import Updated, UpdateLora, UpdateRefused, UpdateWeights, WeightTensor
from diffusiond.ipc.updates import SEALS
from diffusiond.protocol import output_socket_path

SIZE = 64
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy"}


@pytest.fixture
async def sock(live_daemon: Daemon) -> Path:
    return await when_idle(live_daemon)


async def run(s: Any, name: str) -> tuple[bytes, dict[str, Any]]:
    job = await wait_job(s, (await submit(s, {**FAST, "loras": [{"name": name, "weight": 1.0}]}))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        return await r.read(), job


async def test_update_lora_serves_the_new_weights_as_a_file_would(sock: Path, dots_state: dict[str, Any],
                                                                  tmp_path: Path, live_daemon: Daemon) -> None:
    import torch
    from safetensors.torch import save_file

    with Client(str(sock)) as c:
        v1 = await asyncio.to_thread(c.update_lora, "trainer", dots_state)  # torch tensors, sync client
    async with http(sock) as s:
        live1, job1 = await run(s, "trainer")
        filed, _ = await run(s, "dots")
        assert live1 == filed  # the same weights, from a memfd or from a file
        assert job1["lora_versions"] == {"trainer": v1}
        # the worker's share of the update's latency, named (issue 29's target is on the call's whole time)
        assert re.search(rf"update_lora trainer version {v1}: read \d+ ms, checked and applied \d+ ms "
                         rf"\({len(dots_state)} tensors, \d+ MB\)", live_daemon.log()), live_daemon.log()[-2000:]

        doubled = {k: (v * 2).numpy() for k, v in dots_state.items()}  # numpy arrays, async client
        v2 = await AsyncClient(str(sock)).update_lora("trainer", doubled)
        assert v2 > v1
        folder = tmp_path / "doubled"
        folder.mkdir()
        save_file({k: torch.from_numpy(v) for k, v in doubled.items()},
                  str(folder / "pytorch_lora_weights.safetensors"))
        async with s.post("/v1/loras", json={"name": "doubled", "path": str(folder)}) as r:
            assert r.status in (200, 201), await r.text()
        live2, job2 = await run(s, "trainer")
        filed2, _ = await run(s, "doubled")
        assert live2 == filed2 and live2 != live1  # the new weights, not the old
        assert job2["lora_versions"] == {"trainer": v2}
        async with s.get("/v1/loras") as r:
            entry = next(e for e in (await r.json())["data"] if e["name"] == "trainer")
        assert entry["version"] == v2 and entry["layout"] == "live"


async def test_a_job_running_before_an_update_and_one_after_record_different_versions(
        sock: Path, dots_state: dict[str, Any]) -> None:
    async with AsyncClient(str(sock)) as c, http(sock) as s:
        before = await c.update_lora("ordered", dots_state)
        ordered = [{"name": "ordered", "weight": 1.0}]
        first = await submit(s, {**FAST, "output_format": "png", "steps": 8, "loras": ordered})

        async def started() -> bool:
            async with s.get(f"/v1/jobs/{first['id']}") as r:
                return (await r.json())["status"] != "queued"

        await until(started, 60, "the first job to reach its worker")
        after = await c.update_lora("ordered", {k: v * 3 for k, v in dots_state.items()})
        second = await submit(s, {**FAST, "output_format": "png", "loras": ordered})
        done1, done2 = await wait_job(s, first["id"]), await wait_job(s, second["id"])
        async with s.get(done2["outputs"][0]["url"]) as r:
            png = await r.read()
    assert after == before + 1
    assert done1["lora_versions"] == {"ordered": before} and done2["lora_versions"] == {"ordered": after}
    from PIL import Image

    assert Image.open(io.BytesIO(png)).info["lora_versions"] == f"ordered:{after}"  # the file says it too


async def test_refusals_name_the_first_bad_tensor(sock: Path, dots_state: dict[str, Any]) -> None:
    key = next(k for k in sorted(dots_state) if ".lora_A." in k)
    good = {k: v.numpy() for k, v in dots_state.items()}
    async with AsyncClient(str(sock)) as c:
        version = await c.update_lora("strict", good)
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("strict", {**good, "unet.no_such_block.to_q.lora_A.weight": good[key]}, "unet.no_such_block"),
            ("strict", {key: np.zeros((good[key].shape[0], good[key].shape[1] + 1), np.float32)}, key),
            ("strict", {"unet.x.weight": good[key]}, "unet.x.weight"),
            ("fresh", {"unet.no_such_block.to_q.lora_A.weight": good[key],
                       "unet.no_such_block.to_q.lora_B.weight": good[key]}, "no_such_block"),
            ("fresh", {key: np.zeros((4, 3), np.float32)}, key),
            ("dots", good, "registered from a file"),
            ("bad name!", good, "bad name!"),
        ]
        for name, state, named in cases:
            with pytest.raises(DaemonError) as err:
                await c.update_lora(name, state)
            assert err.value.status == 400 and named in err.value.message, (name, err.value)
        assert await c.update_lora("strict", good) > version  # refusals left it serviceable
        models = await c._json("GET", "/v1/loras")
    assert "fresh" not in {e["name"] for e in models["data"]}  # a refused new adapter is not registered


async def replace_worker(s: Any) -> None:
    """SIGKILL the one worker and wait for its replacement, which the engine's kept updates reach first."""
    (old,) = [x["pid"] for x in (await health(s))["workers"]]
    os.kill(old, signal.SIGKILL)

    async def replaced() -> bool:
        workers = (await health(s))["workers"]
        return [x["state"] for x in workers] == ["ready"] and workers[0]["pid"] not in (old, None)

    await until(replaced, 120, "the killed worker's replacement to be ready")


def memfd(name: str, size: int, *, sealed: bool = True) -> int:
    """A memfd of ``size`` zero bytes, sealed as ``Client`` seals an update's parts (``ipc/updates.SEALS``)."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def raw_update(sock: Path, msg: UpdateLora | UpdateWeights, fds: list[int], *, cut: int | None = None,
               answer: bool = True) -> object:
    """Send an update frame with ``fds`` by hand (optionally cut short, or without waiting for the answer)."""
    frame = FrameEncoder().encode(msg, len(fds))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(output_socket_path(str(sock)))
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        s.sendmsg([frame[:cut] if cut is not None else frame], anc)
        if not answer:
            return None
        decoder = FrameDecoder()
        while True:
            data, got = recv_with_fds(s)
            for extra in got:
                os.close(extra)
            assert data, "the daemon hung up instead of answering"
            frames = decoder.feed(data)
            if frames:
                return frames[0][3]


async def test_a_client_dying_mid_update_leaves_the_daemon_serving(sock: Path, dots_state: dict[str, Any]) -> None:
    async with AsyncClient(str(sock)) as c, http(sock) as s:
        v = await c.update_lora("dying", dots_state)
        (fd,), tensors = pack({k: v * 5 for k, v in dots_state.items()})
        try:
            # half a frame, then gone: nothing is applied
            await asyncio.to_thread(raw_update, sock, UpdateLora("dying", tensors), [fd], cut=20, answer=False)
            # the whole frame, then gone before the answer: the update still completes, whole
            await asyncio.to_thread(raw_update, sock, UpdateLora("dying", tensors), [fd], answer=False)
        finally:
            os.close(fd)
        latest = await c.update_lora("dying", dots_state)
        assert latest == v + 2
        _, job = await run(s, "dying")
        assert job["lora_versions"] == {"dying": latest}


_NAMES = st.sampled_from(["unet.a.lora_A.weight", "unet.down_blocks.0.attentions.0.proj_in.lora_A.weight", "",
                          "x", "unet..lora_B.weight", "text_encoder.q.lora_B.weight", "\x00", "é" * 300])


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "40")) // 4 or 1, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["fz", "", "dots", "a" * 65, "ok.name"]),
       tensors=st.lists(st.builds(WeightTensor, _NAMES,
                                  st.sampled_from(["float32", "bfloat16", "int8", "", "float64", "complex"]),
                                  st.lists(st.integers(-2, 1 << 33), max_size=5),
                                  st.integers(-10, 1 << 40),
                                  st.sampled_from([0, 1, -1, 7, 1 << 40])), max_size=4),
       with_fd=st.booleans(), sealed=st.booleans(), access=st.sampled_from([None, os.O_WRONLY, os.O_PATH]),
       component=st.none() | st.tuples(st.sampled_from(["tiny", "", "nope"]),
                                        st.sampled_from(["unet", "vae2", "", "a b", "x" * 100])))
def test_fuzz_update_headers_get_an_answer_never_a_hangup(live_daemon: Daemon, name: str,
                                                          tensors: list[WeightTensor], with_fd: bool,
                                                          sealed: bool, access: int | None,
                                                          component: tuple[str, str] | None) -> None:
    """UPDATE_LORA and UPDATE_WEIGHTS headers of every shape: each gets its answer (a refusal in the
    HTTP API's statuses), never a dropped connection; none of these names can change tiny."""
    sock = live_daemon.socket
    msg = UpdateLora(name, tensors) if component is None else UpdateWeights(*component, tensors)
    fd = memfd("fuzz", 4096, sealed=sealed) if with_fd else None
    if fd is not None and access is not None:  # the memfd reopened write-only or as a path
        made, fd = fd, os.open(f"/proc/self/fd/{fd}", access)
        os.close(made)
    try:
        answer = raw_update(sock, msg, [] if fd is None else [fd])
    finally:
        if fd is not None:
            os.close(fd)
    assert isinstance(answer, UpdateRefused | Updated), answer
    if isinstance(answer, UpdateRefused):
        assert answer.status in (400, 404, 503) and answer.message, answer


async def test_update_weights_replaces_a_components_parameters_in_place(sock: Path) -> None:
    from safetensors import safe_open

    from diffusiond.pipelines.tiny import ensure_tiny

    with safe_open(str(ensure_tiny() / "unet" / "diffusion_pytorch_model.safetensors"), "np") as f:
        original = f.get_tensor("conv_out.weight")

    async def base(s: Any) -> bytes:
        job = await wait_job(s, (await submit(s, FAST))["id"])
        async with s.get(job["outputs"][0]["url"]) as r:
            return await r.read()

    async with AsyncClient(str(sock)) as c, http(sock) as s:
        before = await base(s)
        v1 = await c.update_weights("tiny", "unet", {"conv_out.weight": np.zeros_like(original)})
        zeroed = await base(s)
        with Client(str(sock)) as sync:
            v2 = await asyncio.to_thread(sync.update_weights, "tiny", "unet", {"conv_out.weight": original})
        restored = await base(s)
        cases: list[tuple[str, str, dict[str, Any], int, str]] = [
            ("tiny", "unet", {"conv_out.nope": original}, 400, "conv_out.nope"),
            ("tiny", "unet", {"conv_out.weight": original[:1]}, 400, "conv_out.weight"),
            ("tiny", "vae2", {"conv_out.weight": original}, 400, "vae2"),
            ("nope", "unet", {"conv_out.weight": original}, 404, "nope"),
        ]
        for model, component, state, status, named in cases:
            with pytest.raises(DaemonError) as err:
                await c.update_weights(model, component, state)
            assert err.value.status == status and named in err.value.message, err.value
        assert await base(s) == before  # refusals changed nothing
    assert zeroed != before and restored == before and v2 == v1 + 1


async def test_a_replacement_worker_gets_the_live_adapter_and_weights_before_its_first_job(
        live_daemon: Daemon, sock: Path, dots_state: dict[str, Any]) -> None:
    """The engine keeps each update's memfd: a worker started after them (here the replacement of one
    killed with SIGKILL) gets them again before it takes a job, and ends at the same versions."""
    from safetensors import safe_open

    from diffusiond.pipelines.tiny import ensure_tiny

    with safe_open(str(ensure_tiny() / "unet" / "diffusion_pytorch_model.safetensors"), "np") as f:
        original = f.get_tensor("conv_out.weight")
    async with AsyncClient(str(sock)) as c, http(sock) as s:
        await c.update_lora("survivor", dots_state)
        v = await c.update_lora("survivor", {k: v * 2 for k, v in dots_state.items()})  # the second one counts
        try:
            await c.update_weights("tiny", "unet", {"conv_out.weight": original * 0.5})
            w = await c.update_weights("tiny", "unet", {"conv_out.weight": original * 0.25})
            before, job = await run(s, "survivor")
            assert job["lora_versions"] == {"survivor": v} and job["weight_versions"] == {"unet": w}
            await replace_worker(s)
            after, job2 = await run(s, "survivor")
            assert job2["lora_versions"] == {"survivor": v} and job2["weight_versions"] == {"unet": w}
            assert after == before  # the updated adapter and component, not the files' weights
        finally:
            await c.update_weights("tiny", "unet", {"conv_out.weight": original})  # as the module found it
