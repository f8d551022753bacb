"""The replica's parts that need no Ray cluster: the daemon it starts ends every job it cannot
finish with a reason when Serve stops it, and the event stream it relays passes
lines of any length with their ids bound."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from daemonkit import Daemon, get, http, submit, until

from diffusiond.ray.replica import own_state_dir, relay_sse

BODY = {"model": "tiny", "width": 64, "height": 64, "steps": 2, "output_format": "png"}


async def test_a_replica_without_a_shared_state_dir_ends_its_unfinished_jobs_with_a_reason_at_stop(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """The replica's daemon, started with the arguments the replica gives it when no shared state
    dir is set, is stopped as Serve stops a replica (SIGTERM): its queued and running jobs end
    ``failed shutting_down`` and their event streams carry the error, instead of staying queued in
    a store that the replica then deletes."""
    private = tmp_path / "replica"
    private.mkdir()
    args = own_state_dir(["--model", "tiny", "--max-batch", "1", "--job-timeout", "300", "--test-fault",
                          "copy_delay_ms=3000", "--drain-grace-s", "0.5"], private, "r1")
    d = daemon_factory(*args, env={"OMP_NUM_THREADS": "1"})
    async with http(d.socket) as s:
        jobs = [await submit(s, {**BODY, "prompt": f"harbour {i}", "seed": i}) for i in range(3)]

        async def follow(job_id: str) -> str:
            async with s.get(f"/v1/jobs/{job_id}/events") as r:
                chunks = []
                with contextlib.suppress(aiohttp.ClientError):
                    async for chunk in r.content.iter_any():
                        chunks.append(chunk)
                return b"".join(chunks).decode()

        async def started() -> bool:
            return (await get(s, f"/v1/jobs/{jobs[0]['id']}"))[1]["status"] == "running"

        await until(started, 60, "the first job to start")
        streams = [asyncio.ensure_future(follow(j["id"])) for j in jobs]
        await asyncio.sleep(0.3)
        d.signal(signal.SIGTERM)
        assert await asyncio.to_thread(d.wait, 60) == 0, d.log()
        texts = await asyncio.wait_for(asyncio.gather(*streams), 30)
    for text in texts:
        assert "event: error" in text and "shutting_down" in text, text
    assert "stays in the state dir" not in d.log()
    assert not any((private / "state").glob("*.db*")), "no job store in the private dir, which the replica deletes"


async def _serve(tmp_path: Path, lines: list[bytes]) -> tuple[web.AppRunner, str]:
    """A stand-in daemon whose /events sends ``lines`` in small pieces, as a socket would."""

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        data = b"".join(lines)
        for i in range(0, len(data), 60_000):
            await resp.write(data[i:i + 60_000])
        return resp

    app = web.Application()
    app.router.add_get("/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = str(tmp_path / "stand-in.sock")
    await web.UnixSite(runner, sock).start()
    return runner, sock


async def test_an_event_stream_with_a_preview_over_512_kib_reaches_its_terminal_event_with_ids_bound(
        tmp_path: Path) -> None:
    """A preview at max_side 1024 is a PNG of megabytes in base64 on one ``data:`` line; aiohttp's
    line reader refuses lines over 512 KiB, which cut the stream before ``done``."""
    image = base64.b64encode(os.urandom(3 << 20)).decode()  # ~4 MiB: a 1024² PNG of noise is about this
    lines = [b"event: status\n", b'data: {"job_id": "j_00ab", "status": "running"}\n', b"\n",
             b"event: preview\n", json.dumps({"job_id": "j_00ab", "image": image}).encode() + b"\n", b"\n",
             b"event: done\n", b'data: {"id": "j_00ab", "url": "/v1/jobs/j_00ab/outputs/0"}\n', b"\n"]
    runner, sock = await _serve(tmp_path, [lines[0], lines[1], lines[2], lines[3], b"data: " + lines[4],
                                           *lines[5:]])
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s, \
                s.get("http://d/events") as resp:
            parts: AsyncIterator[bytes] = relay_sse(resp.content.iter_any(), "r1")
            text = b"".join([p async for p in parts])
    finally:
        await runner.cleanup()
    got = text.split(b"\n")
    assert got[0] == b"event: status" and json.loads(got[1][6:]) == {"job_id": "r1.j_00ab", "status": "running"}
    assert json.loads(got[4][6:]) == {"job_id": "r1.j_00ab", "image": image}
    assert got[6] == b"event: done"
    assert json.loads(got[7][6:]) == {"id": "r1.j_00ab", "url": "/v1/jobs/r1.j_00ab/outputs/0"}
    assert text.endswith(b"\n\n")


async def test_a_stream_cut_mid_line_passes_on_what_came() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'data: {"job_id": "j_0a"}\nda'
        yield b"ta: {\"job_"

    text = b"".join([p async for p in relay_sse(chunks(), "r1")])
    assert text == b'data: {"job_id":"r1.j_0a"}\ndata: {"job_'
