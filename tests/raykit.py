"""Helpers of test_ray.py, which runs diffusiond on Ray Serve on a local cluster: the processes
(command lines, parents, children, a daemon's private socket), requests through Serve's proxy, and
what the replicas' daemons hold, asked of each on its own socket.

It imports diffusiond.ray, and so Ray: test_ray.py imports it after setting
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (read when Ray is imported) and checking that Ray is installed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import http

from diffusiond.ray.replica import daemon_load

GEN = {"model": "tiny", "size": "64x64", "num_inference_steps": 2}  # OpenAI-shaped
# enough steps that a job of tiny stays queued or running for a second or more even on an idle box:
# long enough to be seen in its daemon and still be there when the test kills that daemon
LONG_STEPS = 60


def free_port() -> int:
    """A port for Serve's proxy that the cluster starting after it is picked will not take: one the kernel hands
    out for port 0 (as the test first did) is in the ephemeral range, where Ray's own processes and every other
    test's listeners bind as they start, and one bound that way between the pick and the proxy's start failed
    the module ("Failed to bind to address '127.0.0.1:40053'", with the suite on two processes). Ray's workers
    take 10002-19999 by default, the kernel's ephemeral range starts at 32768 by default: this picks between."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, min(low, 32768)))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and the ephemeral range for Serve's proxy")


def cmdline(pid: int | str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def parent(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children(pids: set[int]) -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and parent(e) in pids}


async def generate(s: aiohttp.ClientSession, seed: int, steps: int = 2,
                   prompt: str = "a cat") -> tuple[int, dict[str, Any]]:
    body = {**GEN, "prompt": f"{prompt} {seed}", "seed": seed, "num_inference_steps": steps}
    async with s.post("/v1/images/generations", json=body) as r:
        return r.status, await r.json()


def daemon_socket(pid: int) -> str:
    m = re.search(r"--socket (\S+)", cmdline(pid))
    assert m, cmdline(pid)
    return m[1]


def replica_of(job_id: str) -> str:
    return job_id.split(".", 1)[0]


async def unfinished(running: dict[str, int], prompt: str) -> dict[str, int]:
    """Replica id -> the jobs whose prompt starts with ``prompt`` that its daemon holds queued or
    running, asked of each daemon on its own socket: where the router really sent the work."""
    held = {}
    for replica, pid in running.items():
        n = 0
        async with http(Path(daemon_socket(pid))) as d:
            for status in ("queued", "running"):
                async with d.get("/v1/jobs", params={"status": status}) as r:
                    n += sum(str(j["request"]["prompt"]).startswith(prompt) for j in (await r.json())["data"])
        held[replica] = n
    return held


async def idle(running: dict[str, int]) -> bool:
    """No daemon holds a job, queued or running (asked of each on its own socket)."""
    for pid in running.values():
        async with http(Path(daemon_socket(pid))) as d, d.get("/health") as r:
            if daemon_load(await r.json()):
                return False
    return True


Load = list[asyncio.Task[tuple[int, dict[str, Any]]]]


async def load_until(s: aiohttp.ClientSession, running: dict[str, int], prompt: str, seed: int,
                     enough: Callable[[dict[str, int]], bool], what: str, first: int = 8, most: int = 32,
                     timeout: float = 120.0, steps: int = LONG_STEPS) -> tuple[Load, dict[str, int]]:
    """Long synchronous requests through the proxy until the work the daemons hold is ``enough``.

    Which replica takes a request is the router's choice (least loaded, batch affinity, routing
    stats a few seconds old), so a test that needs work on some replica looks where the requests
    went instead of assuming: ``first`` are sent at once, then one more whenever every unanswered
    one has reached a daemon and the work is still not ``enough`` (at most ``most`` in all).
    Returns the requests, still running, and the jobs each replica held when it was enough."""
    load: Load = []

    def send() -> None:
        n = seed + len(load)
        load.append(asyncio.create_task(generate(s, n, steps=steps, prompt=prompt)))

    for _ in range(first):
        send()
    deadline = time.monotonic() + timeout
    try:
        while True:
            held = await unfinished(running, prompt)
            if enough(held):
                return load, held
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:g}s waiting for {what}: {len(load)} requests sent, "
                            f"{sum(t.done() for t in load)} answered, the replicas hold {held} of them")
            if sum(held.values()) >= sum(not t.done() for t in load) and len(load) < most:
                send()
            await asyncio.sleep(0.05)
    except BaseException:
        for t in load:
            t.cancel()
        raise


def model_loads(pid: int) -> Counter[str]:
    """Model -> how often the daemon brought it onto its device, from its /metrics on its own socket."""
    async def read() -> str:
        async with http(Path(daemon_socket(pid))) as d, d.get("/metrics") as r:
            return await r.text()
    text = asyncio.run(read())
    return Counter({m[1]: int(float(m[2])) for m in
                    re.finditer(r'^diffusiond_model_loads_total\{model="([^"]+)"\} (\S+)$', text, re.M)})
