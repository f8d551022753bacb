"""npy outputs: streamed once straight from the arena, then the slot goes back; outputs nobody
fetches are spilled out of the arena under pressure, so it never fills for good."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import numpy as np
from daemonkit import http, wait_job

BIG = {"prompt": "p", "width": 512, "height": 512, "steps": 1, "output_format": "npy", "output_dtype": "float32"}
ONE_OUTPUT = 512 * 512 * 3 * 4  # 3 MiB


async def _health(s: Any) -> dict[str, Any]:
    async with s.get("/health") as r:
        return await r.json()


async def _submit(s: Any, seed: int) -> str:
    async with s.post("/v1/jobs", json={**BIG, "seed": seed}) as r:
        assert r.status == 202, await r.text()
        return (await r.json())["id"]


async def test_npy_output_is_streamed_once_then_released(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    # in memory only (--no-persist): with a state dir an npy output is also kept as a file, fetchable again
    d = daemon_factory("--model", "synthetic:compute_ms=1", "--arena-mb", "64", "--no-persist")
    async with http(d.socket) as s:
        job = await wait_job(s, await _submit(s, 1))
        assert (await _health(s))["arena_bytes_in_use"] >= ONE_OUTPUT
        async with s.get(job["outputs"][0]["url"]) as r:
            arr = np.load(io.BytesIO(await r.read()))
        assert arr.shape == (512, 512, 3) and arr.dtype == np.float32
        assert (await _health(s))["arena_bytes_in_use"] == 0
        async with s.get(job["outputs"][0]["url"]) as r:
            assert r.status == 410 and "streamed" in (await r.json())["error"]["message"]


async def test_unfetched_npy_outputs_are_spilled_so_the_arena_never_fills(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    # an 16 MiB arena holds five 3 MiB outputs; twelve are made and none fetched until the end
    d = daemon_factory("--model", "synthetic:compute_ms=1", "--arena-mb", "16", "--retention-s", "600", "--no-persist")
    async with http(d.socket) as s:
        jobs = []
        for seed in range(12):
            jobs.append(await wait_job(s, await _submit(s, seed), timeout=60))
        assert all(j["status"] == "succeeded" for j in jobs), [j["error"] for j in jobs]

        async def settled() -> int:
            while (used := (await _health(s))["arena_bytes_in_use"]) > 8 << 20:
                await asyncio.sleep(0.05)
            return used

        assert await asyncio.wait_for(settled(), 30) <= 8 << 20  # at most half the arena stays held
        first = None
        for j in jobs:  # spilled or not, every output arrives intact
            async with s.get(j["outputs"][0]["url"]) as r:
                assert r.status == 200
                arr = np.load(io.BytesIO(await r.read()))
            assert arr.shape == (512, 512, 3)
            first = arr if first is None else first
        assert not np.array_equal(first, arr)


async def test_a_copy_waiting_for_a_slot_makes_the_engine_spill_unfetched_outputs(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """An unfetched output just under half the arena is not spilled by the half-arena rule, yet
    leaves too little room for a slightly larger next output: the copy thread's SLOT_WAIT makes
    the engine spill it, and the next job succeeds instead of failing after the slot timeout."""
    d = daemon_factory("--model", "synthetic:compute_ms=1", "--arena-mb", "8", "--retention-s", "600", "--no-persist",
                       "--slot-timeout-s", "20")
    base = {"prompt": "p", "width": 1024, "steps": 1, "output_format": "npy"}
    async with http(d.socket) as s:
        async with s.post("/v1/jobs", json={**base, "height": 1360, "seed": 1}) as r:
            first = await wait_job(s, (await r.json())["id"])
        assert (await _health(s))["arena_bytes_in_use"] >= 1024 * 1360 * 3  # held: under half the arena
        async with s.post("/v1/jobs", json={**base, "height": 1400, "seed": 2}) as r:
            second = await wait_job(s, (await r.json())["id"], timeout=60)
        assert second["status"] == "succeeded", second["error"]
        assert second["timings_ms"]["total"] < 20_000  # it did not wait the slot timeout out
        async with s.get(first["outputs"][0]["url"]) as r:  # the spilled output is still served
            assert np.load(io.BytesIO(await r.read())).shape == (1360, 1024, 3)


async def test_an_output_over_the_size_limit_is_413_at_admission(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "limits.toml"
    cfg.write_text("[limits]\nmax_output_bytes = 110_000_000\n")  # 110 MB
    d = daemon_factory("--model", "synthetic:compute_ms=1", "--config", str(cfg))
    body = {"prompt": "p", "width": 2048, "height": 2048, "output_format": "npy", "output_dtype": "float32"}
    async with http(d.socket) as s:
        async with s.post("/v1/jobs", json={**body, "n": 2}) as r:  # 2 x 48 MiB: fits
            assert r.status == 202
        async with s.post("/v1/jobs", json={**body, "n": 3}) as r:  # 3 x 48 MiB: does not
            err = (await r.json())["error"]
            assert r.status == 413 and err["code"] == "output_too_large" and err["field"] == "n", err
            assert "limit is 0.1 GiB" in err["message"]


async def test_a_download_that_stalls_is_closed_and_the_output_stays_fetchable(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A reader that stops reading is cut off after --stream-stall-s; the slot is no longer
    pinned (so it can be spilled or released) and the output can be fetched again in full."""
    d = daemon_factory("--model", "synthetic:compute_ms=1", "--arena-mb", "128", "--stream-stall-s", "1")
    big = {"prompt": "p", "width": 2048, "height": 2048, "steps": 1, "output_format": "npy",
           "output_dtype": "float32", "seed": 5}  # 48 MiB: far more than the socket buffers hold
    async with http(d.socket) as s:
        async with s.post("/v1/jobs", json=big) as r:
            job = await wait_job(s, (await r.json())["id"])
        reader, writer = await asyncio.open_unix_connection(str(d.socket), limit=64 << 10)
        writer.write(f"GET {job['outputs'][0]['url']} HTTP/1.1\r\nHost: d\r\n\r\n".encode())
        await reader.readexactly(4096)  # ... and stop reading

        async def logged() -> None:
            while "stopped reading" not in d.log():
                await asyncio.sleep(0.1)

        await asyncio.wait_for(logged(), 30)
        rest = await asyncio.wait_for(reader.read(), 30)  # what was in flight, then EOF: it was cut
        assert 4096 + len(rest) < 2048 * 2048 * 3 * 4
        writer.close()
        async with s.get(job["outputs"][0]["url"]) as r:
            arr = np.load(io.BytesIO(await r.read()))
        assert arr.shape == (2048, 2048, 3) and arr.dtype == np.float32
