"""Load generation: concurrent clients over a Unix socket, each request timed to its last byte."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from diffusiond.client import SSEParser
from diffusiond.protocol import TERMINAL_EVENTS, JobStatus


class BenchError(RuntimeError):
    """A server under test refused or failed a request, or did not start: the run cannot go on."""


@dataclass
class LoadResult:
    seconds: float  # from the start of the measured phase to the last measured request's last byte
    latencies_ms: list[float]
    stages: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    bytes_received: int = 0
    since_ns: int = 0  # time.monotonic_ns() when the measured phase began (warm-up before it)
    trace: list[dict[str, Any]] | None = None  # GET /v1/admin/trace after the run, with --trace
    # (last byte, batch id or None, measured?) of every request after the warm-up, the extra
    # ones that keep the load on until the last measured request is done included
    finished: list[tuple[float, int | None, bool]] = field(default_factory=list)

    def record(self, done: Done, measured: bool) -> None:
        self.finished.append((done.t1, done.batch, measured))
        if not measured:
            return
        self.latencies_ms.append((done.t1 - done.t0) * 1000)
        self.bytes_received += done.received
        for k, v in done.stages.items():
            self.stages[k].append(v)

    def steady_throughput(self) -> float | None:
        return steady_throughput(self.finished)

    def batch_sizes(self) -> list[int]:
        """Outputs per forward, for the batches that hold measured requests (daemon modes)."""
        if not any(batch is not None for _, batch, _ in self.finished):
            return []
        return [n for _, n in measured_batches(self.finished)]


@dataclass
class Done:
    """One request, from its first byte sent (``t0``) to its output's last byte (``t1``)."""

    t0: float
    t1: float
    received: int
    stages: dict[str, float] = field(default_factory=dict)
    batch: int | None = None  # the forward that computed it; None where the server does not say


def measured_batches(finished: list[tuple[float, int | None, bool]]) -> list[tuple[float, int]]:
    """(end, outputs) of each batch that holds a measured request, in order of their ends.

    A batch ends with the last byte of its last output. Requests without a batch id (the naive
    server) count as batches of one.
    """
    groups: dict[object, list[float]] = defaultdict(list)
    measured: set[object] = set()
    for k, (t1, batch, is_measured) in enumerate(finished):
        key: object = ("request", k) if batch is None else batch
        groups[key].append(t1)
        if is_measured:
            measured.add(key)
    return sorted((max(groups[key]), len(groups[key])) for key in measured)


def steady_throughput(finished: list[tuple[float, int | None, bool]]) -> float | None:
    """Requests per second between the first and the last batch that hold measured requests.

    The comparable figure to ``limit``, which times forwards back to back: it leaves out the
    pipeline's fill (the first batch's wait, forward, copy and encode) and its drain, which a
    run of a few dozen requests would otherwise charge to throughput once. Counting whole
    batches, by the id the daemon gives each output, keeps the window exact when outputs arrive
    in bursts; the first batch's requests are outside the window (it ends where the window
    starts). None with fewer than two batches.
    """
    ends = measured_batches(finished)
    if len(ends) < 2 or ends[-1][0] <= ends[0][0]:
        return None
    return sum(n for _, n in ends[1:]) / (ends[-1][0] - ends[0][0])


def _body(s: Any, prompt: str, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "width": s.width, "height": s.height, "steps": s.steps,
                            "guidance_scale": s.guidance, "seed": seed, "output_format": s.format}
    if s.frames:
        body["num_frames"] = s.frames
    if s.output_dtype != "uint8":
        body["output_dtype"] = s.output_dtype
    if getattr(s, "preview_every", 0):  # the naive server has no previews; the daemon draws 256 px jpegs
        body["preview"] = {"every": s.preview_every}
    if getattr(s, "models", ()):  # --alternate: request by request, in the order they are sent (seeds count them)
        body["model"] = s.models[seed % len(s.models)]
    return body


async def _run(sock: Path, s: Any, one: Callable[[aiohttp.ClientSession, int], Awaitable[Done]],
               fetch_trace: bool = False) -> LoadResult:
    conn = aiohttp.UnixConnector(path=str(sock), limit=s.concurrency * 2 + 4)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(connector=conn, base_url="http://diffusiond", timeout=timeout) as session:
        seeds = itertools.count()
        # warm-up, not measured: first forwards, allocator growth, encoder pools
        await asyncio.gather(*(one(session, next(seeds)) for _ in range(max(s.concurrency, s.batch * 2))))
        result = LoadResult(0.0, [])
        submitted = 0
        last_measured = asyncio.Event()
        t0 = time.perf_counter()

        async def client() -> None:
            # Clients keep submitting until the last measured request is done, so the batches
            # that hold measured requests are formed under full load, as in a long run.
            nonlocal submitted
            while not last_measured.is_set():
                measured = submitted < s.requests
                submitted += 1
                result.record(await one(session, next(seeds)), measured)
                if len(result.latencies_ms) == s.requests and not last_measured.is_set():
                    result.seconds = time.perf_counter() - t0
                    last_measured.set()

        result.since_ns = time.monotonic_ns()
        await asyncio.gather(*(client() for _ in range(s.concurrency)))
        if fetch_trace:
            async with session.get("/v1/admin/trace") as r:
                if r.status != 200:
                    raise BenchError(f"GET /v1/admin/trace answered {r.status}: {await r.text()}")
                result.trace = (await r.json())["workers"]
        return result


async def run_job(session: aiohttp.ClientSession, s: Any, prompt: str, seed: int) -> tuple[dict[str, Any], int]:
    """One job as a client runs it: create it, follow its events to the end, download every
    output. Returns the terminal event's job and the bytes received."""
    async with session.post("/v1/jobs", json=_body(s, prompt, seed)) as r:
        job = await r.json()
        if r.status != 202:
            raise BenchError(f"the daemon refused a job ({r.status}): {job}")
    final = None
    async with session.get(f"/v1/jobs/{job['id']}/events") as r:
        parser = SSEParser()
        async for chunk in r.content.iter_any():
            for name, data in parser.feed(chunk):
                if name in TERMINAL_EVENTS:
                    final = json.loads(data)
                    break
            if final is not None:
                break
    if final is None or final["status"] != JobStatus.SUCCEEDED:
        raise BenchError(f"a job did not succeed: {final}")
    received = 0
    for out in final["outputs"]:
        async with session.get(out["url"]) as r:
            async for chunk in r.content.iter_chunked(1 << 20):
                received += len(chunk)
    return final, received


async def drive_daemon(sock: Path, s: Any, prompt: str) -> LoadResult:
    async def one(session: aiohttp.ClientSession, seed: int) -> Done:
        t0 = time.perf_counter()
        final, received = await run_job(session, s, prompt, seed)
        batch = final["outputs"][0].get("batch") if final["outputs"] else None
        return Done(t0, time.perf_counter(), received, final["timings_ms"], batch)

    return await _run(sock, s, one, fetch_trace=s.trace)


async def drive_naive(sock: Path, s: Any, prompt: str) -> LoadResult:
    async def one(session: aiohttp.ClientSession, seed: int) -> Done:
        t0 = time.perf_counter()
        async with session.post("/generate", json=_body(s, prompt, seed)) as r:
            data = await r.read()
            if r.status != 200:
                raise BenchError(f"the naive server answered {r.status}: {data[:200]!r}")
        return Done(t0, time.perf_counter(), len(data))

    return await _run(sock, s, one)
