"""``diffusiond bench --alternate SPEC_A SPEC_B --device-memory SIZE``: two models, requests alternating
between them one by one, on a daemon whose budget holds one of them, against the same daemon with both
resident.

What it prices is residency's turns (issue 27, "scheduling across models"): under a budget for one model,
every switch is a move off the device and one onto it, and the batches in flight drain first. The model on
the device keeps serving its queue (``daemon/residency/turns.py``), so a stream that alternates request by
request should pay a move per queue drained rather than one per request; this measures how close that comes
to not moving at all. The two daemons run side by side, idle while the other is driven, in the same rounds
with their order swapped every other round (as runner.py does with the limit, because a GPU's speed drifts),
and the figure is the median over rounds of the budget's throughput over the resident one's in the same round.

Each run reports the model loads it saw (``diffusiond_model_loads_total``, warm-up requests included), so a
budget that holds both models, where nothing moves and the figure means nothing, is said rather than hidden.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp

from diffusiond.bench.limit import PROMPT
from diffusiond.bench.load import BenchError, drive_daemon
from diffusiond.bench.procs import process, wait_ready
from diffusiond.bench.report import ModeResult, Setup
from diffusiond.bench.runner import _result, _setup, machine

MODES = ("resident", "budget")
MODELS = ("a", "b")
TARGET = 0.85  # issue 27: the budget's throughput at least this share of both resident


def run(args: argparse.Namespace) -> int:
    from diffusiond.pipelines.base import PipelineError

    wrong = refused(args)
    if wrong:
        print(f"diffusiond bench: error: {wrong}", file=sys.stderr)
        return 2
    specs = tuple(args.alternate)
    try:
        setup = replace(_setup(args), model=f"a={specs[0]}, b={specs[1]}", models=MODELS)
        runs = measure(setup, specs, args.device_memory, args.max_model_wait)
    except (BenchError, PipelineError) as exc:
        print(f"diffusiond bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    report = {"setup": asdict(setup), "machine": machine(setup.device), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["diffusiond", *sys.argv[1:]]),
              "alternate": {"a": specs[0], "b": specs[1], "device_memory": args.device_memory,
                            "max_model_wait": args.max_model_wait},
              "modes": per_mode(runs), "ratio": ratio(runs), "runs": [asdict(r) for r in runs]}
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0


def refused(args: argparse.Namespace) -> str | None:
    """Flags of the other modes that mean nothing here, said rather than ignored."""
    if not args.device_memory:
        return ("--alternate needs --device-memory SIZE: a budget that holds one of the two models with its "
                "working memory, and less than both models' weights together")
    for flag, given in (("--modes", args.modes), ("--sweep", args.sweep), ("--trace", args.trace),
                        ("--preview-every", args.preview_every != (0,)), ("--peak-tflops", args.peak_tflops)):
        if given:
            return f"{flag} does not apply to --alternate (its modes are {' and '.join(MODES)})"
    return None


def measure(s: Setup, specs: tuple[str, ...], budget: str, max_model_wait: str | None) -> list[ModeResult]:
    """Every measured run, in the order it ran; each run's note counts the model loads during it."""
    runs: list[ModeResult] = []

    t0 = time.monotonic()

    def log(what: str) -> None:  # each run's figure as it comes: a run cut short by a timeout keeps them
        print(f"bench: [{time.monotonic() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)

    with _daemons(s, specs, budget, max_model_wait) as socks:
        for mode in MODES:  # both models through a few moves (a first move off a GPU pins host memory)
            log(f"warming up {mode} ...")
            asyncio.run(drive_daemon(socks[mode], replace(s, requests=2 * s.concurrency), PROMPT))
        for k in range(s.rounds):
            for mode in MODES if k % 2 == 0 else MODES[::-1]:
                log(f"round {k + 1}/{s.rounds}: {mode} ...")
                before, timed, spent = asyncio.run(loads(socks[mode]))
                load = asyncio.run(drive_daemon(socks[mode], s, PROMPT))
                after, timed_after, spent_after = asyncio.run(loads(socks[mode]))
                moved, timed_moves = after - before, timed_after - timed
                each = f", {(spent_after - spent) / timed_moves:.2f} s each" if timed_moves > 0 else ""
                runs.append(replace(_result(mode, load, k, concurrency=s.concurrency),
                                    note=f"{moved:g} model loads{each}"))
                log(f"round {k + 1}/{s.rounds}: {mode}: {runs[-1].throughput:.3f} req/s, {runs[-1].note}")
    return runs


async def loads(sock: Path) -> tuple[float, float, float]:
    """Every model load the daemon has made so far, and how many of them were timed and the seconds those took (a
    load's time is what each move back onto the device costs the alternation: issue 27's 0.832x left it
    unnamed; a worker's own start counts as a load without a time), from its /metrics."""
    conn = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=conn) as session, session.get("http://x/metrics") as r:
        text = await r.text()
    def total(prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    return (total("diffusiond_model_loads_total{"), total("diffusiond_model_load_seconds_count"),
            total("diffusiond_model_load_seconds_sum"))


@contextlib.contextmanager
def _daemons(s: Setup, specs: tuple[str, ...], budget: str, max_model_wait: str | None) -> Iterator[dict[str, Path]]:
    """The two daemons, started together, each serving both models; models never expire (--keep-alive -1),
    so the daemon that waits while the other is driven keeps what it had."""
    with tempfile.TemporaryDirectory(prefix="diffusiond-bench-") as tmp, contextlib.ExitStack() as stack:
        started = []
        for mode in MODES:
            sock, log = Path(tmp) / f"{mode}.sock", Path(tmp) / f"{mode}.log"
            argv = [sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock),
                    *(a for name, spec in zip(MODELS, specs, strict=True) for a in ("--model", f"{name}={spec}")),
                    "--device", s.device, "--dtype", s.dtype, "--max-batch", str(s.batch),
                    "--arena-mb", str(s.arena_mb), "--batch-wait-ms", str(s.batch_wait_ms),
                    "--queue-size", str(max(256, s.requests * 2)), "--keep-alive", "-1", "--log-level", "warning"]
            if mode == "budget":
                argv += ["--device-memory", budget]
                argv += ["--max-model-wait", max_model_wait] if max_model_wait else []
            argv += ["--state-dir", str(Path(tmp) / f"{mode}.state")] if s.persist else ["--no-persist"]
            if s.compile:
                argv += ["--compile", s.compile, "--warmup", f"{s.width}x{s.height}:{s.batch}"]
            started.append((stack.enter_context(process(argv, log)), sock, log))
        for proc, sock, log in started:
            wait_ready(proc, sock, log, "diffusiond serve")
        yield {mode: sock for mode, (_, sock, _) in zip(MODES, started, strict=True)}


def ratio(runs: list[ModeResult]) -> float | None:
    """Median over rounds of the budget's throughput over the resident daemon's in the same round."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.mode] = r.throughput
    ratios = [m["budget"] / m["resident"] for m in by_round.values() if m.get("resident") and "budget" in m]
    return round(statistics.median(ratios), 3) if ratios else None


def per_mode(runs: list[ModeResult]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        if mine:
            rows.append({"mode": mode, "runs": len(mine), "throughput": statistics.median(r.throughput for r in mine),
                         "wall_throughput": statistics.median(r.wall_throughput or 0.0 for r in mine),
                         "p50_ms": statistics.median(r.p50_ms or 0.0 for r in mine),
                         "p99_ms": statistics.median(r.p99_ms or 0.0 for r in mine),
                         "loads": [r.note for r in mine]})
    return rows


def table(report: dict[str, Any]) -> str:
    s, alt = report["setup"], report["alternate"]
    wait = f", --max-model-wait {alt['max_model_wait']}" if alt["max_model_wait"] else ""
    lines = [
        f"two models alternating request by request: {s['model']} on {s['device']} ({s['dtype']}), "
        f"{s['width']}x{s['height']}, {s['steps']} steps, batch {s['batch']}, {s['requests']} requests, "
        f"concurrency {s['concurrency']}, format {s['format']}, {s['rounds']} round{'s' * (s['rounds'] != 1)}; "
        f"budget: --device-memory {alt['device_memory']}{wait}",
        f"machine: {report['machine']}; {report['date']}",
        "",
        "| mode | req/s | wall req/s | p50 ms | p99 ms | model loads, per run |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["modes"]:
        lines.append(f"| {r['mode']} | {r['throughput']:.3f} | {r['wall_throughput']:.3f} | {r['p50_ms']:.0f} "
                     f"| {r['p99_ms']:.0f} | {'; '.join(r['loads'])} |")
    figure = report["ratio"]
    lines += ["", f"budget / resident (median over rounds of the same round's runs): "
                  f"{'-' if figure is None else f'{figure:.3f}'} (target >= {TARGET})"]
    lines += ["req/s: steady state, from the end of the first batch of measured requests to the end of the last; "
              "model loads: loads the daemon made during the run, its warm-up requests included"]
    budget_loads = [r for r in report["runs"] if r["mode"] == "budget" and r["note"].startswith("0 ")]
    if budget_loads:
        lines += ["", "warning: a budget run moved no model: the budget held both, and the figure does not measure "
                      "turns; give a --device-memory below the two models' weights together"]
    if not str(s["device"]).startswith("cuda"):
        lines += ["", "note: measured on the CPU, where a model leaving goes to disk and coming back is a worker's "
                      "start (seconds), not the copy it is on a GPU: this figure says nothing about a GPU."]
    lines += ["", "| # | round | mode | req/s | wall req/s | loads |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(report["runs"], 1):
        lines.append(f"| {i} | {r['round'] + 1} | {r['mode']} | {r['throughput']:.3f} "
                     f"| {r['wall_throughput'] or 0:.3f} | {r['note']} |")
    return "\n".join(lines)
