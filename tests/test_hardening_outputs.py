"""Hardening against a real daemon: large outputs and the arena. A reader that stalls in the
middle of a large output, readers that hang up, results nobody fetches (on one shared "big" daemon),
outputs larger than the arena and an arena that is full (on daemons of their own).

Large outputs are ``npy`` (streamed from the arena, the slot given back once streamed in full;
unfetched ones spilled out of the arena once they hold over half of it; the rest released when
retention ends): a reader that stalls keeps its slot pinned and must block nobody else, a reader
that hangs up must leak no pin, and the arena must come back to 0 bytes in use every time.

Every test talks to a ``diffusiond serve`` subprocess over its Unix socket; nothing is mocked
(test_hardening.py has the rest of the hardening tests, hardeningkit.py their helpers).
"""

from __future__ import annotations

import asyncio
import io
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, get, health, idle, shared_daemon, submit, until
from hardeningkit import ENV, client, fetch, finished

from conftest import memfd_maps

MIB = 1 << 20

# The "big" daemon: 48 MiB float32 outputs, an arena with room for three of them.
BIG = {"model": "big", "prompt": "big", "width": 2048, "height": 2048, "steps": 2,
       "output_format": "npy", "output_dtype": "float32"}
BIG_BYTES = 2048 * 2048 * 3 * 4


# helpers --------------------------------------------------------------------------------------
def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def synthetic_output(width: int, height: int, seed: int, dtype: str = "uint8") -> np.ndarray:
    """What a ``synthetic`` model's worker puts in the arena for ``seed``, computed here."""
    import torch

    from diffusiond.ipc.messages import BatchParams
    from diffusiond.pipelines.synthetic import SyntheticPipeline
    from diffusiond.worker.copier import to_output_layout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: a computation split otherwise can differ in the last bit
    try:
        pipe = SyntheticPipeline(options={"compute_ms": "0"})
        with torch.inference_mode():
            out = pipe._output(BatchParams(width=width, height=height, steps=1, guidance=1.0), seed)
            return to_output_layout(out, dtype).numpy()
    finally:
        torch.set_num_threads(threads)


# 2. large outputs: a stalled reader, a reader that hangs up, results nobody fetches -------------
@pytest.fixture(scope="module")
def big_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("big"), [
        "--model", "big=synthetic:compute_ms=5", "--arena-mb", "160", "--retention-s", "4", "--job-timeout", "120",
        "--no-persist",  # the arena and in-memory retention on their own: nothing kept in a state dir
    ], model_cache, ENV) as d:
        yield d


@pytest.fixture
async def big(big_daemon: Daemon) -> Path:
    assert big_daemon.proc is not None and big_daemon.proc.poll() is None, big_daemon.log()
    async with client(big_daemon.socket) as s:
        await until(lambda: idle(s), 60, "the big-output daemon to go idle")
    return big_daemon.socket


async def raw_get(sock: Path, url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """GET ``url`` on a connection of our own; returns it with the first bytes of the answer."""
    reader, writer = await asyncio.open_unix_connection(str(sock), limit=64 << 10)
    writer.write(f"GET {url} HTTP/1.1\r\nHost: diffusiond\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


async def fetch_and_check(s: aiohttp.ClientSession, seed: int) -> str:
    """Run a BIG job, fetch its 48 MiB and compare them with the model's output; returns its id."""
    job = await submit(s, {**BIG, "seed": seed})
    done = await finished(s, job["id"], 60)
    assert done["status"] == "succeeded", done
    array = load_npy(await fetch(s, done["outputs"][0]["url"]))
    assert np.array_equal(array, synthetic_output(2048, 2048, seed, "float32")), f"seed {seed}: wrong bytes"
    return str(job["id"])


async def test_a_stalled_reader_blocks_nobody_and_its_slot_comes_back_when_it_goes(big: Path) -> None:
    async with client(big) as s:
        job = await submit(s, {**BIG, "seed": 1})
        done = await finished(s, job["id"], 60)
        reader, writer, head = await raw_get(big, done["outputs"][0]["url"])
        try:
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert len(await reader.readexactly(4096)) == 4096  # a few KB, then the client stops reading
            # other clients keep generating and fetching 48 MiB outputs, bytes checked
            others: list[str] = []
            for seeds in ((10, 11), (12, 13), (14, 15)):
                others += await asyncio.wait_for(asyncio.gather(*(fetch_and_check(s, k) for k in seeds)), 120)

            # every job's retention ends; the stalled one's slot is still being read: held, not reused
            async def only_the_stalled_slot_held() -> bool:
                codes = [(await get(s, f"/v1/jobs/{j}"))[0] for j in [job["id"], *others]]
                return set(codes) == {404} and (await health(s))["arena_bytes_in_use"] == BIG_BYTES

            await until(only_the_stalled_slot_held, 30, "only the stalled reader's slot to be held")
            assert (await health(s))["status"] == "ok"
        finally:
            writer.close()  # the stalled client goes away
        await until(lambda: idle(s), 30, "the stalled reader's slot to come back (arena 0)")
        await fetch_and_check(s, 16)


async def test_readers_that_hang_up_mid_stream_leak_nothing(big: Path) -> None:
    async def hang_up(url: str, times: int) -> None:
        for _ in range(times):  # at different points of the 48 MiB
            reader, writer, head = await raw_get(big, url)
            assert head.startswith(b"HTTP/1.1 200 "), head
            await reader.readexactly(random.randrange(1, 8 * MIB))
            writer.transport.abort()

    async with client(big) as s:
        done = await finished(s, (await submit(s, {**BIG, "seed": 2}))["id"], 60)
        await hang_up(done["outputs"][0]["url"], 3)
        # the output is intact for a reader that stays, and reading it in full gives its slot back
        array = load_npy(await fetch(s, done["outputs"][0]["url"]))
        assert np.array_equal(array, synthetic_output(2048, 2048, 2, "float32"))
        await until(lambda: idle(s), 30, "the slot of the output read in full to come back")
        # one whose readers all hung up comes back when its retention ends: no reader's pin leaked
        other = await finished(s, (await submit(s, {**BIG, "seed": 3}))["id"], 60)
        await hang_up(other["outputs"][0]["url"], 2)
        await until(lambda: idle(s), 30, "the slot to come back at the end of retention (arena 0)")
        assert (await get(s, f"/v1/jobs/{other['id']}"))[0] == 404
        assert (await health(s))["status"] == "ok"
        await fetch_and_check(s, 17)


async def test_results_nobody_fetches_do_not_fill_the_arena_for_good(big: Path) -> None:
    async with client(big) as s:
        # twice as many 48 MiB results as the arena holds, none ever fetched
        jobs = [await submit(s, {**BIG, "seed": 100 + k}) for k in range(6)]
        for job in jobs:
            ended = await finished(s, job["id"], 90)
            assert ended["status"] == "succeeded", ended
        (w,) = (await health(s))["workers"]
        assert w["arena_bytes"] < 4 * BIG_BYTES and w["restarts"] == 0, w
        await until(lambda: idle(s), 30, "the unfetched results' slots to come back (arena 0)")
        await fetch_and_check(s, 18)


# 3. outputs larger than the arena; an arena that is full ---------------------------------------
async def test_outputs_larger_than_the_arena_get_a_dedicated_memfd_with_the_right_bytes(
    daemon_factory: Any,
) -> None:
    d: Daemon = daemon_factory("--model", "big=synthetic:compute_ms=5", "--arena-mb", "1", "--retention-s", "120",
                               "--no-persist",
                               env=ENV)
    assert d.proc is not None
    base = {"model": "big", "prompt": "dedicated", "steps": 2}
    async with client(d.socket) as s:
        (w,) = (await health(s))["workers"]
        assert w["arena_bytes"] == MIB
        npy = await submit(s, {**base, "width": 1024, "height": 1024, "output_format": "npy", "seed": 5, "n": 3})
        f32 = await submit(s, {**base, "width": 512, "height": 512, "output_format": "npy",
                               "output_dtype": "float32", "seed": 6})
        png = await submit(s, {**base, "width": 1024, "height": 1024, "output_format": "png", "seed": 7})
        small = await submit(s, {**base, "width": 64, "height": 64, "output_format": "npy", "seed": 8})
        jobs = {k: await finished(s, j["id"], 60) for k, j in
                (("npy", npy), ("f32", f32), ("png", png), ("small", small))}
        assert all(j["status"] == "succeeded" for j in jobs.values()), jobs
        for k, out in enumerate(jobs["npy"]["outputs"]):
            got = load_npy(await fetch(s, out["url"]))
            assert np.array_equal(got, synthetic_output(1024, 1024, 5 + k)), f"output {k}"
        got = load_npy(await fetch(s, jobs["f32"]["outputs"][0]["url"]))
        assert np.array_equal(got, synthetic_output(512, 512, 6, "float32"))
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(await fetch(s, jobs["png"]["outputs"][0]["url"]))))
        assert np.array_equal(image, synthetic_output(1024, 1024, 7))
        got = load_npy(await fetch(s, jobs["small"]["outputs"][0]["url"]))
        assert np.array_equal(got, synthetic_output(64, 64, 8))
        # streamed (or spilled), every dedicated buffer is unmapped and the accounting is back to 0
        await until(lambda: idle(s), 30, "the outputs' memory to be released")
        assert not [line for line in memfd_maps(d.proc.pid) if "diffusiond-output" in line]


async def test_full_arena_fails_the_job_naming_the_sizes_instead_of_hanging(daemon_factory: Any) -> None:
    """An output that does not fit the free part of the arena waits for a slot, then fails with
    the arena's own account of the sizes; a job with a deadline ends at its deadline.

    What holds the arena here is an output a client is still reading (a reader that stalls):
    unfetched outputs no longer fill it (they are spilled once they hold over half of it), but
    an output being streamed is pinned. The wait is ``--slot-timeout-s``, set to 3 s here.
    """
    arena = 8 * MIB
    d: Daemon = daemon_factory("--model", "big=synthetic:compute_ms=5", "--arena-mb", "8", "--retention-s", "600",
                               "--no-persist",
                               "--slot-timeout-s", "3", env=ENV)
    base = {"model": "big", "prompt": "fill", "width": 1024, "steps": 2, "output_format": "npy"}
    held, large = 1024 * 1360 * 3, 1024 * 1400 * 3  # just under half the arena; just over what is left
    assert held <= arena // 2 and large > arena - held
    async with client(d.socket) as s:
        first = await finished(s, (await submit(s, {**base, "height": 1360, "seed": 1}))["id"], 60)
        assert first["status"] == "succeeded", first
        reader, writer, head = await raw_get(d.socket, first["outputs"][0]["url"])
        try:
            assert head.startswith(b"HTTP/1.1 200 "), head
            await reader.readexactly(4096)  # ... and stalls
            assert (await health(s))["arena_bytes_in_use"] == held
            t0 = time.monotonic()
            waiting = await submit(s, {**base, "height": 1400, "seed": 2})
            short = await submit(s, {**base, "height": 1400, "seed": 3, "timeout_s": 2})
            # a job with a deadline ends at its deadline, stuck in copying, not later
            ended = await finished(s, short["id"], 30)
            assert ended["status"] == "failed" and ended["error"]["code"] == "deadline_exceeded", ended
            assert ended["error"]["stage"] == "copying", ended
            # the other waits for a slot, then fails naming the sizes
            failed = await finished(s, waiting["id"], 60)
            assert time.monotonic() - t0 < 50
            assert failed["status"] == "failed", failed
            err = failed["error"]
            assert err["stage"] == "copying" and err["code"] == "generation_failed", err
            assert f"no free slot of {large} bytes after 3.0s" in err["message"], err
            assert f"{held} of {arena} bytes in use in 1 slots" in err["message"], err
            assert f"largest free range {arena - held} bytes" in err["message"], err
            assert "--arena-mb" in err["message"] and "worker 0 (pid " in err["message"], err
            h = await health(s)
            assert h["status"] == "ok" and h["workers"][0]["restarts"] == 0 and h["queue_depth"] == 0, h
            # an output that fits the free part goes through meanwhile
            small = await finished(s, (await submit(s, {**base, "height": 1024, "seed": 4}))["id"], 60)
            assert small["status"] == "succeeded", small
        finally:
            writer.close()
        # once the held output is read in full its slot comes back, and the large output fits
        got = load_npy(await fetch(s, first["outputs"][0]["url"]))
        assert np.array_equal(got, synthetic_output(1024, 1360, 1))
        assert (await finished(s, (await submit(s, {**base, "height": 1400, "seed": 5}))["id"], 60))["status"] \
            == "succeeded"
