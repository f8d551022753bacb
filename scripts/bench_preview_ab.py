"""What previews cost the forward, measured request by request so that GPU drift cancels out.

``diffusiond bench --preview-every 0,1,5`` runs each variant as its own block of requests; on a
GPU whose speed drifts by 20 % between blocks (docs/benchmarks.md, the previews section) that
cannot resolve a cost of 1 or 2 %. This script runs one ``--trace`` daemon and interleaves the
variants request by request (A B C, then B C A, then C A B ...), so neighbouring forwards of
different variants run seconds apart on the same GPU state. The cost of a variant is the ratio
of its CUDA-timed forward (default stream, from the worker's trace) to the no-preview forward of
the same cycle; the median over cycles is the figure, and the mean ratio the throughput cost
(the worker never waits between forwards, so throughput follows the forward time).

    python scripts/bench_preview_ab.py --model random:sdxl --size 1024x1024 --steps 20 --cycles 16

Forward times on a shared H200 varied by ±15 % from one forward to the next (2026-12-01), so the
pairs only cancel slow drift; the spread of the ratios says how many cycles a figure needs.
``--budget-s`` ends the run in time with the cycles completed so far.

Prints one Markdown table, and the raw per-request rows with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from diffusiond.bench.limit import PROMPT
from diffusiond.bench.load import run_job
from diffusiond.bench.report import Setup
from diffusiond.bench.runner import _daemons
from diffusiond.bench.trace import intervals


async def drive(sock: Path, s: Setup, arms: list[int], cycles: int, concurrency: int,
                budget_s: float) -> list[dict[str, Any]]:
    # cycle k runs the arms rotated by k, so no variant always follows the same one
    order = [(k, arms[(i + k) % len(arms)]) for k in range(cycles) for i in range(len(arms))]
    rows: list[dict[str, Any]] = []
    conn = aiohttp.UnixConnector(path=str(sock))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(connector=conn, base_url="http://diffusiond", timeout=timeout) as session:
        for every in arms:  # warm-up: first forwards, allocator growth, the preview encoder's pool
            await run_job(session, replace(s, preview_every=every), PROMPT, 10_000 + every)
        todo = iter(enumerate(order))
        seeds = itertools.count()
        stop_at = time.monotonic() + budget_s

        async def client() -> None:
            for index, (cycle, every) in todo:
                if time.monotonic() > stop_at:  # out of time: what ran so far is the result
                    return
                final, _ = await run_job(session, replace(s, preview_every=every), PROMPT, next(seeds))
                rows.append({"index": index, "cycle": cycle, "every": every,
                             "batch": final["outputs"][0]["batch"], "compute_ms": final["timings_ms"]["compute"]})

        await asyncio.gather(*(client() for _ in range(concurrency)))
        async with session.get("/v1/admin/trace") as r:
            worker = (await r.json())["workers"][0]
    gpu = {i.batch_id: i.ms for i in intervals(worker["gpu_events"], "compute_start", "compute_end")}
    for row in rows:
        row["gpu_ms"] = gpu.get(row["batch"])
    return sorted(rows, key=lambda r: r["index"])


BOOTSTRAP = 5000  # resamples for the median's interval


def summarize(rows: list[dict[str, Any]], arms: list[int]) -> list[dict[str, Any]]:
    """Per arm: forward times, and its ratios to the no-preview forward of the same cycle (rows
    from several runs, as ``--from`` reads them, carry ``run`` so that their cycles stay apart).
    The median ratio comes with a bootstrap 95 % interval (resampled cycles, a fixed seed) and the
    number of cycles in which the arm was slower: how far the noise leaves the figure open."""
    key = "gpu_ms" if all(r["gpu_ms"] is not None for r in rows) else "compute_ms"
    by_cycle: dict[tuple[int, int], dict[int, float]] = {}
    for r in rows:
        by_cycle.setdefault((r.get("run", 0), r["cycle"]), {})[r["every"]] = r[key]
    by_cycle = {k: c for k, c in by_cycle.items() if len(c) == len(arms)}  # a cycle cut short by the budget
    out = []
    rng = random.Random(0)
    for every in arms:
        times = [c[every] for c in by_cycle.values()]
        ratios = sorted(c[every] / c[0] for c in by_cycle.values())
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
        out.append({"every": every, "timed": key, "forwards": len(times), "median_ms": statistics.median(times),
                    "mean_ms": statistics.fmean(times), "ratio_median": statistics.median(ratios),
                    "ratio_mean": statistics.fmean(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
                    "ratio_median_ci95": [medians[int(0.025 * BOOTSTRAP)], medians[int(0.975 * BOOTSTRAP) - 1]],
                    "slower": sum(x > 1 for x in ratios)})
    return out


def table(summary: list[dict[str, Any]]) -> str:
    lines = ["| previews | forwards | forward ms (median / mean) | x no previews: median of pairs "
             "| its 95 % interval | mean | IQR | pairs slower |", "|---|---|---|---|---|---|---|---|"]
    for m in summary:
        name = ("every step" if m["every"] == 1 else f"every {m['every']} steps") if m["every"] else "none"
        low, high = m.get("ratio_median_ci95") or (None, None)
        interval = f"{low:.4f}-{high:.4f}" if m["every"] and low is not None else "-"
        slower = f"{m['slower']} of {m['forwards']}" if m["every"] and "slower" in m else "-"
        lines.append(f"| {name} | {m['forwards']} | {m['median_ms']:.1f} / {m['mean_ms']:.1f} | "
                     f"{m['ratio_median']:.4f} | {interval} | {m['ratio_mean']:.4f} | "
                     f"{m['ratio_q1']:.4f}-{m['ratio_q3']:.4f} | {slower} |")
    timed = summary[0]["timed"]
    return "\n".join(lines) + f"\n\nforwards timed by: {timed} (gpu_ms: CUDA events on the default stream)"


def merged(paths: list[str]) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows of several saved runs (``--json`` output), each run's cycles kept apart."""
    rows: list[dict[str, Any]] = []
    arms: list[int] | None = None
    for run, path in enumerate(paths):
        with open(path) as f:
            doc = json.load(f)
        these = [int(a) for a in str(doc["setup"]["arms"]).split(",")]
        if arms is not None and these != arms:
            raise SystemExit(f"{path}: arms {these} differ from the first run's {arms}; merge like with like")
        arms = these
        rows += [{**r, "run": run} for r in doc["rows"]]
    assert arms is not None
    return rows, arms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--arms", default="0,1,5", help="preview every N steps, 0 = none (must include 0)")
    p.add_argument("--cycles", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no request after this many seconds of measuring; complete cycles are the result")
    p.add_argument("--concurrency", type=int, default=2, help="2 keeps the worker busy without a deep queue")
    p.add_argument("--json", action="store_true")
    p.add_argument("--from", dest="saved", nargs="+", metavar="JSON",
                   help="run nothing: summarize these saved runs (--json output) together")
    args = p.parse_args()
    if args.saved:
        rows, arms = merged(args.saved)
        print(table(summarize(rows, arms)))
        return 0
    arms = [int(a) for a in args.arms.split(",")]
    if 0 not in arms:
        p.error("--arms must include 0, the variant the others are compared with")
    width, height = (int(v) for v in args.size.split("x"))
    s = Setup(model=args.model, device=args.device, dtype=args.dtype, width=width, height=height,
              steps=args.steps, batch=1, requests=args.cycles * len(arms), concurrency=args.concurrency,
              format="png", frames=None, output_dtype="uint8", guidance=5.0, arena_mb=512, batch_wait_ms=0.0,
              trace=True)
    t0 = time.monotonic()
    with _daemons(s, ["async"]) as socks:
        print(f"daemon ready after {time.monotonic() - t0:.0f} s", file=sys.stderr)
        rows = asyncio.run(drive(socks["async"], s, arms, args.cycles, args.concurrency, args.budget_s))
    summary = summarize(rows, arms)
    print(json.dumps({"setup": vars(args), "summary": summary, "rows": rows}, indent=1) if args.json
          else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
