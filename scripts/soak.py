"""Soak: many requests at high concurrency against a real daemon, with cancels, dropped
connections and never-fetched results mixed in; resource use before and after.

    python scripts/soak.py [--requests 2000] [--concurrency 64] [--seconds 600] [--retention-s 5]

Prints one JSON report; exits 1 if any request went wrong or anything was left behind.
Starts ``diffusiond serve --model tiny`` (two CPU workers) on a temporary socket, runs a
bounded number of requests (it also stops at ``--seconds``), then waits for the daemon to go
idle and compares: RSS and open fds of the daemon and its workers, arena bytes in use, jobs
by status, /dev/shm entries. Every request's outcome is checked: a job must end in exactly one
terminal state, and what the client saw must agree with what the daemon recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

BODY = {"prompt": "soak", "width": 64, "height": 64, "steps": 2}
KINDS = ("normal", "sync", "cancel", "disconnect_sync", "never_fetch", "npy")


def proc_stats(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = {k: v for k, _, v in (line.partition(":") for line in f)}
    kb = {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssShmem")}
    # RssShmem is the arena pages the process has touched: shared memory, not growth of the heap
    return {"rss_kb": kb["VmRSS"], "anon_kb": kb["RssAnon"], "shmem_kb": kb["RssShmem"],
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def tree_stats(pid: int) -> dict[str, Any]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return {"daemon": proc_stats(pid), "workers": {k: proc_stats(k) for k in kids}}


def settled_stats(pid: int) -> dict[str, Any]:
    """``tree_stats`` once the daemon's fd count holds still: the server closes the socket of the
    HTTP request that just asked whether it was idle a moment after the client did, so a single
    read can count that connection (before and after must compare like with like)."""
    stats = tree_stats(pid)
    for _ in range(20):
        time.sleep(0.1)
        again = tree_stats(pid)
        if again["daemon"]["fds"] == stats["daemon"]["fds"]:
            return again
        stats = again
    return stats


async def one(session: aiohttp.ClientSession, kind: str, seed: int, outcomes: Counter[str], errors: list[str]) -> None:
    body = {**BODY, "seed": seed}
    if kind in ("sync", "disconnect_sync"):
        openai_body = {"prompt": "soak", "size": "64x64", "num_inference_steps": 2, "seed": seed}
        timeout = aiohttp.ClientTimeout(total=0.05 if kind == "disconnect_sync" else 300)
        try:
            async with session.post("/v1/images/generations", json=openai_body, timeout=timeout) as r:
                outcomes[f"{kind}:{r.status}"] += 1
                await r.read()
        except TimeoutError:
            outcomes[f"{kind}:client-gave-up"] += 1
        return
    if kind == "npy":
        body["output_format"] = "npy"
    async with session.post("/v1/jobs", json=body) as r:
        if r.status != 202:
            outcomes[f"{kind}:refused-{r.status}"] += 1
            return
        job = await r.json()
    if kind == "cancel":
        await asyncio.sleep(random.random() * 0.3)
        # a cancel, as clients send it: a job that finished first keeps its result (409), where a
        # plain DELETE would delete it
        async with session.delete(f"/v1/jobs/{job['id']}", params={"finished": "keep"}) as r:
            outcomes[f"cancel:{r.status}"] += 1
    if kind == "never_fetch":
        outcomes["never_fetch:submitted"] += 1
        return
    while True:
        async with session.get(f"/v1/jobs/{job['id']}") as r:
            state = await r.json()
        if state["status"] in ("succeeded", "failed", "cancelled"):
            break
        await asyncio.sleep(0.05)
    outcomes[f"{kind}:{state['status']}"] += 1
    if kind == "cancel" and state["status"] not in ("cancelled", "succeeded"):
        errors.append(f"cancelled job ended {state['status']}: {state['error']}")
    if kind in ("normal", "npy") and state["status"] != "succeeded":
        errors.append(f"{kind} job {job['id']} ended {state['status']}: {state['error']}")
    if state["status"] == "succeeded":
        async with session.get(state["outputs"][0]["url"]) as r:
            data = await r.read()
            if r.status != 200 or len(data) != state["outputs"][0]["bytes"]:
                errors.append(f"output of {job['id']}: HTTP {r.status}, {len(data)} bytes")


async def drive(
    sock: Path, requests: int, concurrency: int, seconds: float, pid: int | None = None
) -> tuple[Counter[str], list[str], float, list[dict[str, Any]]]:
    """Run the requests; every ~10% of them, sample the process tree (does memory level off?)."""
    outcomes: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    errors: list[str] = []
    conn = aiohttp.UnixConnector(path=str(sock), limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=conn, base_url="http://d") as session:
        seeds = iter(range(requests))
        deadline = time.monotonic() + seconds
        t0 = time.monotonic()

        every = max(1, requests // 10)

        async def client() -> None:
            for seed in seeds:
                if time.monotonic() > deadline:
                    return
                if pid is not None and seed % every == 0:
                    samples.append({"after_requests": seed, **tree_stats(pid)})
                await one(session, random.choice(KINDS), seed, outcomes, errors)
                outcomes["requests"] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return outcomes, errors, time.monotonic() - t0, samples


async def health(sock: Path) -> dict[str, Any]:
    conn = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=conn) as s, s.get("http://d/health") as r:
        return await r.json()


async def wait_idle(sock: Path, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        h = await health(sock)
        if (h["jobs"]["queued"] == 0 and h["jobs"]["running"] == 0) or time.monotonic() > deadline:
            return h
        await asyncio.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--retention-s", type=float, default=5.0, help="daemon retention (never-fetched outputs)")
    args = ap.parse_args()
    random.seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="diffusiond-soak-"))
    sock = tmp / "d.sock"
    shm_before = set(os.listdir("/dev/shm"))
    log = open(tmp / "log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--model", "tiny",
                             "--state-dir", str(tmp / "state"), "--workers", "2", "--max-batch", "8",
                             "--retention-s", str(args.retention_s),
                             "--queue-size", str(max(256, args.concurrency * 2)), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        while not sock.exists() or asyncio.run(health(sock)).get("accepting") is not True:
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited: {(tmp / 'log').read_text()[-2000:]}")
            time.sleep(0.2)
        asyncio.run(drive(sock, 40, 8, 60))  # warm-up: allocator, encoders, first batches
        asyncio.run(wait_idle(sock))
        before = {"tree": settled_stats(proc.pid), "health": asyncio.run(health(sock))}
        outcomes, errors, elapsed, samples = asyncio.run(
            drive(sock, args.requests, args.concurrency, args.seconds, proc.pid))
        time.sleep(args.retention_s + 1.5)  # let never-fetched outputs reach the end of their retention
        idle = asyncio.run(wait_idle(sock))
        after = {"tree": settled_stats(proc.pid), "health": idle}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    shm_after = set(os.listdir("/dev/shm"))
    report = {
        "requests": outcomes.pop("requests", 0),
        "seconds": round(elapsed, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "errors": errors[:20], "error_count": len(errors),
        "arena_bytes_in_use_after": after["health"]["arena_bytes_in_use"],
        "jobs_after": after["health"]["jobs"],
        "daemon": {"before": before["tree"]["daemon"], "after": after["tree"]["daemon"]},
        "workers": {"before": before["tree"]["workers"], "after": after["tree"]["workers"]},
        "dev_shm_new_entries": sorted(shm_after - shm_before), "exit_code": code,
        "worker_anon_kb_series": [
            [s["after_requests"], *(w["anon_kb"] for w in s["workers"].values())] for s in samples
        ],
    }
    print(json.dumps(report, indent=1))
    ok = not errors and report["arena_bytes_in_use_after"] == 0 and not report["dev_shm_new_entries"] and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
