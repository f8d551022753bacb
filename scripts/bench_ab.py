"""What one request field costs: two kinds of request on one daemon, in alternating rounds.

    python scripts/bench_ab.py --serve "--model m=random:sd15,save=0 --dtype float16" \
        --base '{"size": "512x512", "steps": 20, "scheduler": "ddim", "eta": 1.0}' \
        --b '{"trajectory": {"latents": true, "log_probs": true}}' --requests 32 --concurrency 4 --rounds 4

``--base`` is every request's body (the prompt and seed are added), ``--a`` and ``--b`` what each arm adds
to it (``--a`` defaults to nothing). One daemon serves both arms, so the model, the workers and the GPU are
the same; the arms alternate round by round (a, b, b, a, ...) after one warm-up round of each, and each
round sends ``--requests`` jobs through ``--concurrency`` clients and reads every output back (as an array,
zero-copy where the daemon offers it; with ``trajectory``, the trajectory too, as a trainer does). The
figure is the median over rounds of b's images/s over a's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diffusiond.bench.procs import process, wait_ready
from diffusiond.client import AsyncClient


async def one_round(sock: Path, body: dict[str, Any], requests: int, concurrency: int, seed0: int) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    want_traj = bool(body.get("trajectory"))

    async def client() -> None:
        async with AsyncClient(str(sock), timeout=900) as c:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                params = {k: v for k, v in body.items() if k != "prompt"}
                h = await c.submit(body.get("prompt", "a lighthouse at dusk"), seed=seed0 + i,
                                   output_format="npy", **params)
                job = await h.wait()
                if job["status"] != "succeeded":
                    raise SystemExit(f"job {h.id} ended {job['status']}: {job.get('error')}")
                for k in range(len(job["outputs"])):
                    arr = await c.array(h.id, k)
                    _ = arr.shape
                    if want_traj:
                        traj = await c.trajectory(h.id, k)
                        _ = {n: a.shape for n, a in traj.items()}
                await c.delete(h.id)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return requests * int(body.get("n", 1)) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", required=True, help="serve's arguments, one string")
    ap.add_argument("--base", required=True, help="JSON: every request's body")
    ap.add_argument("--a", default="{}", help="JSON added to the base for arm a")
    ap.add_argument("--b", required=True, help="JSON added to the base for arm b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--label", default="")
    ap.add_argument("--ready-timeout", type=float, default=600)
    args = ap.parse_args()
    base = json.loads(args.base)
    arms = {"a": {**base, **json.loads(args.a)}, "b": {**base, **json.loads(args.b)}}
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        sock = Path(tmp) / "d.sock"
        log = Path(tmp) / "serve.log"
        argv = [sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--state-dir", f"{tmp}/state",
                *shlex.split(args.serve)]
        env_note = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        with process(argv, log) as proc:
            try:
                wait_ready(proc, sock, log, "diffusiond", args.ready_timeout)
                for arm in ("a", "b"):  # warm-up: the model loads, every kernel of both shapes runs once
                    asyncio.run(one_round(sock, arms[arm], max(2, args.concurrency), args.concurrency, 10**6))
                order = [("a", "b") if r % 2 == 0 else ("b", "a") for r in range(args.rounds)]
                rates: dict[str, list[float]] = {"a": [], "b": []}
                for r, pair in enumerate(order):
                    for arm in pair:
                        rates[arm].append(asyncio.run(one_round(sock, arms[arm], args.requests, args.concurrency,
                                                                1000 * r)))
            except BaseException:
                print(log.read_text()[-3000:], file=sys.stderr)
                raise
    ratios = [b / a for a, b in zip(rates["a"], rates["b"], strict=True)]
    out = {"label": args.label, "serve": args.serve, "base": base, "a": json.loads(args.a), "b": json.loads(args.b),
           "requests": args.requests, "concurrency": args.concurrency, "images_per_s": rates,
           "b_over_a": ratios, "b_over_a_median": statistics.median(ratios), "cuda_visible": env_note,
           "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True).stdout.strip() if os.path.exists("/usr/bin/nvidia-smi") else ""}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
