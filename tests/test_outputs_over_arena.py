"""Outputs and the arena's pressure rule, against real daemons with a 1 MiB arena.

An output larger than the arena lies in a memfd of its own, which holds no arena room: spilling it
(copying it into the engine's memory) would free nothing a worker waits for, so it stays where it is,
is handed out by fd to a local client, and is delivered once. An output that was spilled (unfetched
outputs over half the arena) is delivered once as well, its copy dropped after the first complete
read, as its slot would have been. ``/health``'s ``output_memory_bytes`` and ``/metrics``'
``diffusiond_output_memory_bytes`` count what the engine holds in its own memory.
"""

from __future__ import annotations

import asyncio
import gc
import io
from typing import Any

import numpy as np
from daemonkit import Daemon, health, idle, submit, until
from hardeningkit import ENV, client, fetch, finished
from test_hardening_outputs import synthetic_output

from conftest import memfd_maps

BASE = {"model": "big", "prompt": "over the arena", "steps": 2, "output_format": "npy"}
F32_BYTES = 1024 * 1024 * 3 * 4  # 12 MiB a float32 output: twelve times the arena


def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def output_memfds(pid: int) -> list[str]:
    return [line for line in memfd_maps(pid) if "diffusiond-output" in line]


async def metric(s: Any, name: str) -> float:
    async with s.get("/metrics") as r:
        text = await r.text()
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


async def status_of(s: Any, url: str) -> tuple[int, dict[str, Any]]:
    async with s.get(url) as r:
        return r.status, (await r.json() if r.status != 200 else {})


async def test_an_output_larger_than_the_arena_stays_in_its_memfd_is_mapped_and_delivered_once(
    daemon_factory: Any,
) -> None:
    """Before the fix, such an output was copied into the engine's heap as it arrived: the FETCH was
    409 not_shared, /health showed 0 bytes held, and HTTP served it any number of times."""
    from diffusiond.client.zerocopy import OutputMapper

    d: Daemon = daemon_factory("--model", "big=synthetic:compute_ms=5", "--arena-mb", "1", "--no-persist", env=ENV)
    assert d.proc is not None
    async with client(d.socket) as s:
        jobs = [await submit(s, {**BASE, "width": 1024, "height": 1024, "output_dtype": "float32", "seed": seed})
                for seed in (1, 2)]
        done = [await finished(s, j["id"], 60) for j in jobs]
        assert all(j["status"] == "succeeded" for j in done), done
        h = await health(s)
        assert h["arena_bytes_in_use"] == 2 * F32_BYTES, h  # both still in shared memory
        assert h["output_memory_bytes"] == 0, h  # no copy of them in the engine
        assert len(output_memfds(d.proc.pid)) == 2
        assert "spilled output" not in d.log()

        with OutputMapper(str(d.socket)) as m:
            array = await asyncio.to_thread(m.array, jobs[0]["id"], 0)
            assert not array.flags.writeable
            assert np.array_equal(array, synthetic_output(1024, 1024, 1, "float32"))
            del array
            gc.collect()  # the mapper sends UNPIN: the lease was the output's one delivery
            await until(lambda: _held(s, F32_BYTES), 30, "the mapped output to be released")
        status, body = await status_of(s, done[0]["outputs"][0]["url"])
        assert (status, body["error"]["code"]) == (410, "output_released"), body

        got = load_npy(await fetch(s, done[1]["outputs"][0]["url"]))  # streamed from its memfd, once
        assert np.array_equal(got, synthetic_output(1024, 1024, 2, "float32"))
        status, body = await status_of(s, done[1]["outputs"][0]["url"])
        assert (status, body["error"]["code"]) == (410, "output_released"), body
        await until(lambda: idle(s), 30, "the outputs' memory to be released")
        assert not output_memfds(d.proc.pid)
        assert await metric(s, "diffusiond_output_memory_bytes") == 0


async def _held(s: Any, nbytes: int) -> bool:
    return bool((await health(s))["arena_bytes_in_use"] == nbytes)


async def test_a_spilled_npy_output_is_delivered_once_and_its_copy_dropped(daemon_factory: Any) -> None:
    """Unfetched outputs over half the arena are copied into the engine's memory (counted by the gauge);
    the first complete read of one is its delivery, as from its slot: a second fetch is 410 and the copy
    is gone. Before the fix a spilled copy was served any number of times and kept until retention."""
    d: Daemon = daemon_factory("--model", "big=synthetic:compute_ms=5", "--arena-mb", "1", "--no-persist",
                               "--retention-s", "600", env=ENV)
    async with client(d.socket) as s:
        job = await submit(s, {**BASE, "width": 256, "height": 256, "n": 4, "seed": 3})  # 192 KiB each
        done = await finished(s, job["id"], 60)
        assert done["status"] == "succeeded", done

        async def spilled() -> int:
            return int((await health(s))["output_memory_bytes"])

        held = await until(spilled, 30, "the unfetched outputs over half the arena to be spilled")
        assert await metric(s, "diffusiond_output_memory_bytes") == held
        for k, out in enumerate(done["outputs"]):
            got = load_npy(await fetch(s, out["url"]))
            assert np.array_equal(got, synthetic_output(256, 256, 3 + k)), f"output {k}"
        for k, out in enumerate(done["outputs"]):  # spilled or not, each was delivered once
            status, body = await status_of(s, out["url"])
            assert (status, body["error"]["code"]) == (410, "output_released"), (k, body)
        assert (await health(s))["output_memory_bytes"] == 0
        await until(lambda: idle(s), 30, "the arena to be empty")

        png = await submit(s, {**BASE, "width": 64, "height": 64, "output_format": "png", "seed": 4})
        png_done = await finished(s, png["id"], 60)
        assert png_done["status"] == "succeeded", png_done
        encoded = len(await fetch(s, png_done["outputs"][0]["url"]))  # encoded bytes stay for retention
        assert (await health(s))["output_memory_bytes"] == encoded
        assert await metric(s, "diffusiond_output_memory_bytes") == encoded
