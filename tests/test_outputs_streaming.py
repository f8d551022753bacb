"""Outputs streamed from shared memory over HTTP, against one real daemon.

- A reader cut off by ``--stream-stall-s`` never receives the bytes of the output that later takes
  its slot (the transport is aborted, not closed gracefully with views of the slot in its buffer).
- HEAD answers the headers only: no body, and an npy's one delivery is left for the GET.
- ``--stream-stall-s`` times a reader that reads nothing, not one that reads slowly.
- A client that hangs up mid-download is not logged as a daemon bug.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, delete, http, shared_daemon, submit, until, wait_job, when_idle

STALL_S = 2
# one output is width * height * 3 float32 values behind a 128-byte npy header
NPY = {"prompt": "p", "steps": 1, "output_format": "npy", "output_dtype": "float32"}
PNG = {"prompt": "p", "steps": 1, "output_format": "png"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("streaming"), [
        "--model", "synthetic:compute_ms=1", "--arena-mb", "160", "--no-persist", "--retention-s", "4",
        "--stream-stall-s", str(STALL_S)], model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d


@pytest.fixture
async def sock(daemon: Daemon) -> Path:
    return await when_idle(daemon)


async def _job(s: aiohttp.ClientSession, seed: int, width: int, height: int, fmt: str = "npy") -> dict[str, Any]:
    body = NPY if fmt == "npy" else PNG
    job = await wait_job(s, (await submit(s, {**body, "seed": seed, "width": width, "height": height}))["id"])
    assert job["status"] == "succeeded", job
    return job


async def _open(sock: Path, request: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(sock), limit=64 << 10)
    writer.write(request.encode())
    await writer.drain()
    return reader, writer


def _length(head: bytes) -> int:
    return int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")).split(b":")[1])


async def test_a_stalled_reader_never_receives_the_output_that_later_takes_its_slot(daemon: Daemon, sock: Path) -> None:
    async with http(sock) as s:
        a = await _job(s, 1, 512, 512)
        reader, writer = await _open(sock, f"GET {a['outputs'][0]['url']} HTTP/1.1\r\nHost: d\r\n\r\n")
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await until(lambda: _logged(daemon, f"stopped reading output 0 of job {a['id']}"), 30,
                        "the daemon to cut the stalled reader off")
            # its slot goes back, and another output is written there while the reader still holds its socket
            assert (await delete(s, str(a["id"])))[0] == 200
            b = await _job(s, 2, 512, 512)
            body = await asyncio.wait_for(reader.read(), 30)  # what the kernel held for it, then EOF
        finally:
            writer.close()
        assert len(body) < _length(head), "the stalled reader was not cut off"
        again = await _job(s, 1, 512, 512)  # the same seed: the same bytes as job a's output
        async with s.get(again["outputs"][0]["url"]) as r:
            expected = await r.read()
        assert body == expected[: len(body)], f"the stalled reader got bytes that are not job a's (job b: {b['id']})"


async def _logged(daemon: Daemon, text: str) -> bool:
    return text in daemon.log()


async def test_head_of_an_output_answers_its_headers_and_leaves_the_npy_for_the_get(sock: Path) -> None:
    async with http(sock) as s:
        job = await _job(s, 3, 256, 256)
        out = job["outputs"][0]
        async with s.head(out["url"]) as r:
            assert r.status == 200
            assert r.headers["Content-Length"] == str(out["bytes"]) == str(128 + 256 * 256 * 3 * 4)
            assert r.headers["Content-Type"] == "application/x-npy" and r.headers["X-Seed"] == "3"
        # no body after the headers: the next answer on the same connection follows them at once
        reader, writer = await _open(sock, f"HEAD {out['url']} HTTP/1.1\r\nHost: d\r\n\r\n"
                                           "GET /health HTTP/1.1\r\nHost: d\r\n\r\n")
        try:
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200 OK")
        finally:
            writer.close()
        async with s.get(out["url"]) as r:  # the one delivery is still there
            assert r.status == 200 and len(await r.read()) == out["bytes"]
        async with s.head(out["url"]) as r:  # ... and now it is used up, as a GET would say
            assert r.status == 410

        png = (await _job(s, 4, 64, 64, "png"))["outputs"][0]
        async with s.head(png["url"]) as r:
            assert r.status == 200 and r.headers["Content-Length"] == str(png["bytes"])
            assert r.headers["Content-Type"] == "image/png"


async def test_head_of_the_event_stream_answers_its_headers_and_returns(sock: Path) -> None:
    async with http(sock) as s:
        job = await _job(s, 5, 64, 64)
    reader, writer = await _open(sock, f"HEAD /v1/jobs/{job['id']}/events HTTP/1.1\r\nHost: d\r\n\r\n"
                                       "GET /health HTTP/1.1\r\nHost: d\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head
        nxt = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert nxt.startswith(b"HTTP/1.1 200 OK"), f"HEAD of /events sent a body: {nxt[:80]!r}"
    finally:
        writer.close()


async def test_a_slow_steady_reader_is_not_cut_off(sock: Path) -> None:
    """128 KiB every 0.1 s: never idle for long, but a 4 MiB write takes it longer than --stream-stall-s."""
    async with http(sock) as s:
        job = await _job(s, 6, 1024, 512)
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # what the kernel holds for it counts little
    rx.connect(str(sock))
    reader, writer = await asyncio.open_unix_connection(sock=rx, limit=128 << 10)
    try:
        writer.write(f"GET {job['outputs'][0]['url']} HTTP/1.1\r\nHost: d\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        size, got = _length(head), 0
        while got < size:
            await asyncio.sleep(0.1)
            piece = await asyncio.wait_for(reader.read(128 << 10), 30)
            if not piece:
                break
            got += len(piece)
    finally:
        writer.close()
    assert got == size == 128 + 1024 * 512 * 3 * 4, f"cut off after {got} of {size} bytes"


async def test_clients_that_hang_up_mid_download_are_not_logged_as_daemon_errors(daemon: Daemon, sock: Path) -> None:
    async with http(sock) as s:
        job = await _job(s, 7, 2048, 2048)  # 48 MiB: the writes wait on the socket when the client goes
        for _ in range(10):
            reader, writer = await _open(sock, f"GET {job['outputs'][0]['url']} HTTP/1.1\r\nHost: d\r\n\r\n")
            await reader.readexactly(1000)
            writer.transport.abort()
        async with s.get(job["outputs"][0]["url"]) as r:
            assert r.status == 200 and len(await r.read()) == 128 + 2048 * 2048 * 3 * 4
    assert "unexpected error" not in daemon.log(), daemon.log()[-3000:]
