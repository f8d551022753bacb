"""What Ray Serve's proxy costs per request, against the daemon's own socket, in one run.

    python scripts/bench_ray.py [--requests 60] [--size 64x64] [--steps 2] [--model tiny] [--gpus 0]
                                [--concurrency C --rounds R] [--json OUT]

Starts a local Ray cluster on 127.0.0.1 with one replica of ``diffusiond.ray:build`` and asks
the *same* daemon the same synchronous request (``POST /v1/images/generations``, PNG as
b64_json) two ways, alternating one by one so both see the same load: through Serve's HTTP
proxy (proxy -> gateway -> replica -> daemon) and straight on the replica's daemon socket (the
path a workstation user takes). One request at a time: this is per-request latency, not
throughput. Prints p50 and p90 of each and the difference of the p50s.

With ``--concurrency C`` it then measures throughput too: ``--rounds`` rounds, each sending
``--requests`` requests with C in flight down one path and then the other (the order flips every
round, so drift falls on both), and prints each path's median req/s and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_socket() -> str:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            m = re.search(r"--socket (\S*diffusiond-ray-\S+/d\.sock)", cmd)
            if m:
                return m[1]
    raise RuntimeError("no replica daemon found")


async def timed(session: aiohttp.ClientSession, body: dict[str, Any]) -> float:
    t = time.perf_counter()
    async with session.post("/v1/images/generations", json=body) as r:
        await r.read()
        assert r.status == 200, await r.text()
    return (time.perf_counter() - t) * 1000


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "prompt": "a lighthouse", "size": args.size, "num_inference_steps": args.steps}


async def measure(url: str, sock: str, args: argparse.Namespace) -> dict[str, list[float]]:
    body = request_body(args)
    out: dict[str, list[float]] = {"serve proxy": [], "daemon socket": []}
    async with aiohttp.ClientSession(base_url=url) as proxy, \
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock), base_url="http://d") as direct:
        for i in range(5):  # warm-up: connections, the model's first forward
            await timed(proxy, {**body, "seed": i})
            await timed(direct, {**body, "seed": i})
        for i in range(args.requests):
            out["serve proxy"].append(await timed(proxy, {**body, "seed": i}))
            out["daemon socket"].append(await timed(direct, {**body, "seed": i}))
    return out


async def throughput(url: str, sock: str, args: argparse.Namespace) -> dict[str, list[float]]:
    body = request_body(args)
    out: dict[str, list[float]] = {"serve proxy": [], "daemon socket": []}
    limit = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=limit) as proxy, \
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock, limit=args.concurrency),
                                  base_url="http://d") as direct:
        paths = {"serve proxy": proxy, "daemon socket": direct}

        async def block(session: aiohttp.ClientSession) -> float:
            queue = iter(range(args.requests))

            async def client() -> None:
                for i in queue:
                    await timed(session, {**body, "seed": i})

            t = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.concurrency)))
            return args.requests / (time.perf_counter() - t)

        for session in paths.values():  # warm-up at this concurrency
            await block(session)
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                out[name].append(await block(paths[name]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--gpus", type=float, default=0.0, help="gpus_per_replica (a GPU box)")
    p.add_argument("--concurrency", type=int, default=0, help="also measure throughput with C in flight")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()

    import ray
    from ray import serve

    from diffusiond.ray import build

    port = free_port()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a one-machine cluster on 127.0.0.1, not the host's address
    tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray puts Unix sockets under it
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, logging_level="warning", log_to_driver=False,
             _temp_dir=tmp)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"model": args.model, "replicas": "1", "cpus_per_replica": "0",
                         "gpus_per_replica": str(args.gpus)}), name="diffusiond", route_prefix="/")
        url, sock = f"http://127.0.0.1:{port}", daemon_socket()
        results = asyncio.run(measure(url, sock, args))
        rates = asyncio.run(throughput(url, sock, args)) if args.concurrency else {}
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {}
    for name, ms in results.items():
        q = statistics.quantiles(ms, n=10)
        summary[name] = {"p50_ms": statistics.median(ms), "p90_ms": q[8], "n": len(ms)}
        print(f"{name:14s} p50 {statistics.median(ms):8.1f} ms   p90 {q[8]:8.1f} ms   (n={len(ms)})")
    diff = summary["serve proxy"]["p50_ms"] - summary["daemon socket"]["p50_ms"]
    print(f"proxy overhead p50: {diff:+.1f} ms per request")
    if rates:
        for name, rs in rates.items():
            summary[name]["req_per_s"] = statistics.median(rs)
            print(f"{name:14s} {statistics.median(rs):8.2f} req/s at concurrency {args.concurrency}   rounds {rs}")
        ratio = summary["serve proxy"]["req_per_s"] / summary["daemon socket"]["req_per_s"]
        print(f"proxy / socket throughput: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": summary, "raw_ms": results, "raw_req_per_s": rates}, f,
                      indent=1)


if __name__ == "__main__":
    main()
