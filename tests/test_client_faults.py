"""What the client raises when the daemon's answer is wrong or nobody answers: always the documented
ClientError tree (docs/api.md, "Python client"), with a message that fits what happened. A fake daemon
(aiohttp on a Unix socket) gives the broken answers a real one does not."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from diffusiond import AsyncClient, Client, DaemonError, DaemonUnreachable

FULL = io.BytesIO()
np.save(FULL, np.zeros((2, 1000), np.float32))
NPY = FULL.getvalue()


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, bytes]]]:
    """A daemon whose job ``j`` has an npy output with a sound track and a trajectory; the test sets the
    bytes served for every npy URL in the returned dict (``body``)."""
    served = {"body": NPY}
    job = {"id": "j", "status": "succeeded", "outputs": [{
        "index": 0, "content_type": "application/x-npy",
        "audio": {"sample_rate": 16000, "url": "/v1/jobs/j/outputs/0/trajectory/audio"},
        "trajectory": {"latents": {"url": "/v1/jobs/j/outputs/0/trajectory/latents", "dtype": "float32"}}}]}

    async def get_job(_: web.Request) -> web.Response:
        return web.json_response(job)

    async def npy(_: web.Request) -> web.Response:  # a complete HTTP body, whatever its npy content
        return web.Response(body=served["body"], content_type="application/x-npy")

    async def health(_: web.Request) -> web.Response:  # a 503 whose error is not the daemon's object
        return web.json_response({"status": "down", "error": "not an object"}, status=503)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/jobs/j", get_job)
    app.router.add_get("/v1/jobs/j/outputs/0", npy)
    app.router.add_get("/v1/jobs/j/outputs/0/trajectory/{name}", npy)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = str(tmp_path / "fake.sock")
    await web.UnixSite(runner, sock).start()
    try:
        yield sock, served
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("body", [NPY[:500], NPY[:60], NPY[:5], b"\x93NUMPY\x01\x00\x10\x00{'descr': <f4'}\n"],
                         ids=["short-data", "short-header", "short-magic", "bad-header"])
async def test_a_broken_npy_body_is_a_bad_response_on_every_path(
        fake: tuple[str, dict[str, bytes]], body: bytes) -> None:
    sock, served = fake
    served["body"] = body
    async with AsyncClient(sock, zero_copy=False) as c:
        calls = {"array": lambda: c.array("j", 0), "audio": lambda: c.audio("j", 0),
                 "trajectory": lambda: c.trajectory("j", 0)}
        for name, call in calls.items():
            with pytest.raises(DaemonError) as info:  # not asyncio's IncompleteReadError, not numpy's ValueError
                await call()
            # the daemon did answer: no advice to start one
            assert info.value.code == "bad_response" and "array output" in str(info.value), (name, info.value)
            assert not isinstance(info.value, DaemonUnreachable) and "serve" not in str(info.value), name


async def test_a_whole_npy_body_still_reads(fake: tuple[str, dict[str, bytes]]) -> None:
    sock, _ = fake
    async with AsyncClient(sock, zero_copy=False) as c:
        assert (await c.array("j", 0)).shape == (2, 1000)
        waveform, rate = await c.audio("j", 0)
        assert waveform.shape == (2, 1000) and rate == 16000


def test_a_live_update_with_no_daemon_names_the_daemons_socket(tmp_path: Path) -> None:
    sock = str(tmp_path / "none.sock")
    with Client(sock) as c:
        for update in (lambda: c.update_lora("ink", {"a.lora_A.weight": np.zeros((2, 2), np.float32)}),
                       lambda: c.update_weights("tiny", "unet", {"w": np.zeros((2,), np.float32)})):
            with pytest.raises(DaemonUnreachable) as info:
                update()
            # a daemon started as told must be the one the client looks for, at sock, not sock.out
            assert info.value.socket_path == sock
            assert f"--socket {sock}`" in str(info.value) and f"{sock}.out" in info.value.reason, str(info.value)


async def test_a_health_503_not_in_the_daemons_shape_is_still_a_daemon_error(
        fake: tuple[str, dict[str, bytes]]) -> None:
    """An ``error`` that was not an object raised a raw AttributeError out of ``health()``."""
    sock, _ = fake
    async with AsyncClient(sock, zero_copy=False) as c:
        with pytest.raises(DaemonError) as err:
            await c.health()
    assert err.value.status == 503 and "not an object" in str(err.value)


async def test_generate_cut_off_by_a_dead_daemon_names_the_job_that_will_resume(daemon_factory: Any,
                                                                               tmp_path: Path) -> None:
    """The error had no job id; the job ran again when the daemon restarted, and a caller who
    submitted again ran it twice. It names the job now, to wait on or cancel."""
    from daemonkit import get, http, sigkill, until

    d = daemon_factory("--model", "synthetic:compute_ms=20000", "--state-dir", str(tmp_path / "state"))
    async with AsyncClient(str(d.socket)) as c:
        cut = asyncio.ensure_future(c.generate("a lighthouse", output="bytes"))
        async with http(d.socket) as s:
            async def running() -> str | None:
                listed = (await get(s, "/v1/jobs?limit=5"))[1]["data"]
                return next((j["id"] for j in listed if j["status"] == "running"), None)

            job_id = await until(running, 60, "the job to run")
        sigkill(d)
        with pytest.raises(DaemonUnreachable) as info:
            await asyncio.wait_for(cut, 60)
    assert info.value.job_id == job_id
    assert job_id in str(info.value) and "rather than submit it again" in str(info.value)
