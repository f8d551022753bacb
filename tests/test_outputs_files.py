"""Outputs served from their files in the state dir, against one real persistent daemon.

An npy output's first fetch comes from shared memory; every later one, and every encoded output's,
from its file. Those are sent a piece at a time as the client takes them, so:

- a reader that stops reading holds a piece or two of the engine's memory, not the file, and is cut
  off after ``--stream-stall-s``, as a reader of shared memory is;
- a reader that reads gets the exact bytes, and HEAD still answers the headers only;
- a DELETE of the job while it is read does not cut a reader short: the open file keeps its bytes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, delete, fds_named, http, shared_daemon, submit, until, wait_job, when_idle

STALL_S = 2
NPY = {"prompt": "p", "steps": 1, "output_format": "npy", "output_dtype": "float32"}
BIG = 128 + 2048 * 2048 * 3 * 4  # a 2048x2048 float32 npy: 48 MiB behind its header
READERS = 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("files"), [
        "--model", "synthetic:compute_ms=1", "--arena-mb", "160", "--stream-stall-s", str(STALL_S)],
            model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d


@pytest.fixture
async def sock(daemon: Daemon) -> Path:
    return await when_idle(daemon)


async def _file_served(s: aiohttp.ClientSession, seed: int, size: int = 2048) -> tuple[dict[str, Any], bytes]:
    """A finished npy job whose output was fetched once (from shared memory, which let its slot go): from here
    on it is served from its file. Returns the job and the output's bytes."""
    job = await wait_job(s, (await submit(s, {**NPY, "seed": seed, "width": size, "height": size}))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return job, await r.read()


async def _open(sock: Path, request: str, rcvbuf: int = 4096) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection with a small receive buffer (what the kernel holds for a reader counts little)."""
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    rx.connect(str(sock))
    reader, writer = await asyncio.open_unix_connection(sock=rx, limit=64 << 10)
    writer.write(request.encode())
    await writer.drain()
    return reader, writer


def _length(head: bytes) -> int:
    return int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")).split(b":")[1])


def _anon_kib(pid: int) -> int:
    """The engine's anonymous resident memory (its heap: where a whole-file read would land; the page cache and
    the workers' shared memory it maps are not in it)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("RssAnon:")).split()[1])


def _file_of(job: dict[str, Any]) -> str:
    return f"{job['id']}-0.npy"


async def test_a_reader_gets_the_exact_bytes_and_head_only_headers(daemon: Daemon, sock: Path) -> None:
    async with http(sock) as s:
        job, first = await _file_served(s, 1, 512)
        url = job["outputs"][0]["url"]
        async with s.get(url) as r:  # from the file now
            assert r.status == 200 and int(r.headers["Content-Length"]) == len(first) == job["outputs"][0]["bytes"]
            assert await r.read() == first
        png = await wait_job(s, (await submit(s, {"prompt": "p", "steps": 1, "seed": 2, "width": 256,
                                                   "height": 256, "output_format": "png"}))["id"])
        async with s.get(png["outputs"][0]["url"]) as r:  # encoded: only ever in its file
            body = await r.read()
            assert r.status == 200 and body[:8] == b"\x89PNG\r\n\x1a\n" and len(body) == png["outputs"][0]["bytes"]
    reader, writer = await _open(sock, f"HEAD {url} HTTP/1.1\r\nHost: d\r\n\r\nGET /health HTTP/1.1\r\nHost: d\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ") and _length(head) == len(first)
        nxt = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert nxt.startswith(b"HTTP/1.1 200 OK"), f"HEAD of a file-served output sent a body: {nxt[:80]!r}"
    finally:
        writer.close()


async def test_stalled_readers_hold_pieces_not_the_file_and_are_cut_off(daemon: Daemon, sock: Path) -> None:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    async with http(sock) as s:
        job, whole = await _file_served(s, 3)
    assert len(whole) == BIG
    before = _anon_kib(pid)
    conns = [await _open(sock, f"GET {job['outputs'][0]['url']} HTTP/1.1\r\nHost: d\r\n\r\n")
             for _ in range(READERS)]
    try:
        heads = [await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30) for r, _ in conns]
        assert all(h.startswith(b"HTTP/1.1 200 ") and _length(h) == BIG for h in heads)
        peak = before
        for _ in range(10):
            await asyncio.sleep(0.05)
            peak = max(peak, _anon_kib(pid))
        grown = (peak - before) * 1024
        assert grown < READERS * BIG // 4, (f"{READERS} stalled readers of a {BIG >> 20} MiB file grew the engine's "
                                            f"heap by {grown >> 20} MiB: each holds the file, not a few pieces")
        # every reader is stalled, its file open (not yet cut off: that takes STALL_S)
        assert len(fds_named(pid, _file_of(job))) == READERS
        await until(lambda: _cut_off(daemon, str(job["id"])), 30, "the daemon to cut the stalled readers off")
        for reader, _ in conns:
            rest = await asyncio.wait_for(reader.read(), 30)  # what the kernel held for it, then EOF
            assert len(rest) < BIG, "a stalled reader was not cut off"
    finally:
        for _, writer in conns:
            writer.close()
    await until(lambda: _closed(pid, _file_of(job)), 10, "the engine to close the file of each cut-off reader")


async def _cut_off(daemon: Daemon, job_id: str) -> bool:
    return daemon.log().count(f"client stopped reading output 0 of job {job_id} for {STALL_S}s; closing") >= READERS


async def _closed(pid: int, name: str) -> bool:
    return not fds_named(pid, name)


async def test_a_reader_still_reading_when_its_job_is_deleted_gets_every_byte(daemon: Daemon, sock: Path) -> None:
    assert daemon.proc is not None and daemon.state_dir is not None
    async with http(sock) as s:
        job, whole = await _file_served(s, 4)
        reader, writer = await _open(sock, f"GET {job['outputs'][0]['url']} HTTP/1.1\r\nHost: d\r\n\r\n")
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            got = bytearray(await reader.readexactly(1 << 20))

            async def read_on() -> None:  # steadily, never stalled: 64 KiB every 5 ms (seconds for the 48 MiB)
                while len(got) < _length(head):
                    piece = await reader.read(64 << 10)
                    if not piece:
                        return
                    got.extend(piece)
                    await asyncio.sleep(0.005)

            reading = asyncio.ensure_future(read_on())
            assert (await delete(s, str(job["id"])))[0] == 200
            assert len(got) < BIG, "the reader was done before the DELETE: nothing was tested"
            assert not (daemon.state_dir / "outputs" / _file_of(job)).exists(), "DELETE left the output's file"
            async with s.get(job["outputs"][0]["url"]) as r:  # a new read of a deleted job is refused
                assert r.status == 404
            await asyncio.wait_for(reading, 120)
        finally:
            writer.close()
        body = bytes(got)
    assert body == whole, "a reader cut short or given other bytes by the DELETE of its job"
    await until(lambda: _closed(daemon.proc.pid, _file_of(job)), 10,  # type: ignore[union-attr]
                "the engine to close the deleted file once its reader was done")


async def test_the_output_of_a_job_read_back_from_the_state_dir_is_streamed_the_same_way(daemon_factory: Any) -> None:
    """A job that left memory (--retention-s) is served from its record and file: exact bytes for a reader, a cut
    after --stream-stall-s for one that stalls."""
    d = daemon_factory("--model", "synthetic:compute_ms=1", "--arena-mb", "64", "--retention-s", "1",
                       "--stream-stall-s", str(STALL_S), env={"OMP_NUM_THREADS": "1"})
    async with http(d.socket) as s:
        job = await wait_job(s, (await submit(s, {**NPY, "seed": 5, "width": 1024, "height": 1024}))["id"])
        assert job["status"] == "succeeded", job

        async def left_memory() -> bool:
            async with s.get("/health") as r:
                return not any((await r.json())["jobs"].values())

        await until(left_memory, 60, "the finished job leaving memory after --retention-s 1")
        assert d.state_dir is not None
        on_disk = (d.state_dir / "outputs" / _file_of(job)).read_bytes()
        async with s.get(job["outputs"][0]["url"]) as r:
            assert r.status == 200 and await r.read() == on_disk
    reader, writer = await _open(d.socket, f"GET {job['outputs'][0]['url']} HTTP/1.1\r\nHost: d\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        await until(lambda: _logged(d, f"client stopped reading output 0 of job {job['id']}"), 30,
                    "the daemon to cut the stalled reader off")
        rest = await asyncio.wait_for(reader.read(), 30)
        assert len(rest) < _length(head) == len(on_disk), "the stalled reader was not cut off"
        assert on_disk.startswith(rest), "the stalled reader got bytes that are not its output's"
    finally:
        writer.close()


async def _logged(d: Daemon, text: str) -> bool:
    return text in d.log()
