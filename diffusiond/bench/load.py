"""Load generation: concurrent clients over a Unix socket, each request timed to its last byte."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp


@dataclass
class LoadResult:
    seconds: float
    latencies_ms: list[float]
    stages: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    bytes_received: int = 0
    since_ns: int = 0  # time.monotonic_ns() when the measured phase began (warm-up before it)
    trace: list[dict[str, Any]] | None = None  # GET /v1/admin/trace after the run, with --trace

    def record(self, t0: float, received: int, stages: dict[str, float] | None = None) -> None:
        """One finished request, timed from ``t0`` (perf_counter) to its last byte."""
        self.latencies_ms.append((time.perf_counter() - t0) * 1000)
        self.bytes_received += received
        for k, v in (stages or {}).items():
            self.stages[k].append(v)


def _body(s: Any, prompt: str, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "width": s.width, "height": s.height, "steps": s.steps,
                            "guidance_scale": s.guidance, "seed": seed, "output_format": s.format}
    if s.frames:
        body["num_frames"] = s.frames
    if s.output_dtype != "uint8":
        body["output_dtype"] = s.output_dtype
    return body


async def _run(sock: Path, s: Any, one: Any, fetch_trace: bool = False) -> LoadResult:
    conn = aiohttp.UnixConnector(path=str(sock), limit=s.concurrency * 2 + 4)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(connector=conn, base_url="http://diffusiond", timeout=timeout) as session:
        seeds = itertools.count()
        # warm-up, not measured: first forwards, allocator growth, encoder pools
        await asyncio.gather(*(one(session, next(seeds), None) for _ in range(max(s.concurrency, s.batch * 2))))
        result = LoadResult(0.0, [])
        remaining = s.requests

        async def client() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one(session, next(seeds), result)

        result.since_ns = time.monotonic_ns()
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(s.concurrency)))
        result.seconds = time.perf_counter() - t0
        if fetch_trace:
            async with session.get("/v1/admin/trace") as r:
                if r.status != 200:
                    raise RuntimeError(f"trace: {r.status} {await r.text()}")
                result.trace = (await r.json())["workers"]
        return result


async def drive_daemon(sock: Path, s: Any, prompt: str) -> LoadResult:
    async def one(session: aiohttp.ClientSession, seed: int, result: LoadResult | None) -> None:
        t0 = time.perf_counter()
        async with session.post("/v1/jobs", json=_body(s, prompt, seed)) as r:
            job = await r.json()
            if r.status != 202:
                raise RuntimeError(f"job refused: {job}")
        final = None
        async with session.get(f"/v1/jobs/{job['id']}/events") as r:
            event = None
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event in ("done", "error"):
                    final = json.loads(line[6:])
                    break
        if final is None or final["status"] != "succeeded":
            raise RuntimeError(f"job failed: {final}")
        received = 0
        for out in final["outputs"]:
            async with session.get(out["url"]) as r:
                async for chunk in r.content.iter_chunked(1 << 20):
                    received += len(chunk)
        if result is not None:
            result.record(t0, received, final["timings_ms"])

    return await _run(sock, s, one, fetch_trace=s.trace)


async def drive_naive(sock: Path, s: Any, prompt: str) -> LoadResult:
    async def one(session: aiohttp.ClientSession, seed: int, result: LoadResult | None) -> None:
        t0 = time.perf_counter()
        async with session.post("/generate", json=_body(s, prompt, seed)) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"naive server: {r.status} {data[:200]!r}")
        if result is not None:
            result.record(t0, len(data))

    return await _run(sock, s, one)
