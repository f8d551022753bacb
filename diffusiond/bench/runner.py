"""The benchmark driver: runs each mode in rounds on one model and prints one table.

Order of a run: the limit's pipeline is loaded in this process and the daemons (``async``,
``sync``) are started side by side, idle while they are not driven. Each round measures the
limit, then each daemon mode (their order swapped every other round), and a last limit run
closes the sequence, so every daemon run has a limit run on each side (``report.compare``). The
hand-written baseline runs once at the end, after the daemons have stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from diffusiond.bench.flops import annotate, measure_flops
from diffusiond.bench.limit import PROMPT, Limit
from diffusiond.bench.load import BenchError, LoadResult, drive_daemon, drive_naive
from diffusiond.bench.procs import process, wait_ready
from diffusiond.bench.report import ModeResult, Setup, compare, per_mode, table
from diffusiond.bench.trace import summarize
from diffusiond.commands.argtypes import finite_float, parse_size, positive_int
from diffusiond.protocol import COMPILE_MODES, FORMATS, OUTPUT_DTYPES

# Nothing here at module level may load torch or numpy: ``diffusiond --help`` builds this parser,
# and every client command builds the whole parser. The pipeline's modules are imported where a
# run needs them.

MODES = ("limit", "limit-compiled", "async", "async-memory", "sync", "naive")
DEFAULT_MODES = "limit,async,sync,naive"
COMPILED_MODES = "limit,limit-compiled,async"  # the default with --compile
DAEMON_MODES = ("async", "async-memory", "sync")
# the daemon mode with --no-persist, run in the same rounds as the persisted one to price the state dir
MEMORY_SUFFIX = "-memory"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="measure the daemon against the forward-only limit and baselines",
        description="Runs the modes on one model and prints one table: limit (the pipeline in a loop in this "
                    "process, outputs left on the device), async (the daemon as shipped), async-memory (the same "
                    "with --no-persist), sync (the daemon with --output-mode sync) and naive (a hand-written "
                    "server, the baseline). Each mode also gets its achieved TFLOP/s (FLOPs per image, counted once "
                    "with torch's FlopCounterMode on one output of this model, size, steps and guidance, x req/s) and "
                    "its share of the device's dense bf16/fp16 peak (a table of datasheet peaks by GPU name, or "
                    "--peak-tflops). Figures and how to read them: docs/benchmarks.md.")
    p.add_argument("--model", default="tiny", metavar="SPEC", help="as serve --model (default: tiny)")
    p.add_argument("--device", default=None, help="default: cuda:0 if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--size", default="512x512", type=parse_size, metavar="WxH", help="default: 512x512")
    p.add_argument("--steps", type=positive_int, default=4, help="default: 4")
    p.add_argument("--guidance", type=finite_float, default=5.0, help="default: 5.0")
    p.add_argument("--batch", type=positive_int, default=1, help="outputs per forward (daemon: --max-batch)")
    p.add_argument("--requests", type=positive_int, default=64,
                   help="measured requests per mode and round, one output each (default: 64)")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="concurrent clients (default: 3 x batch + 2, so a full batch is always waiting)")
    p.add_argument("--format", default="png", choices=tuple(FORMATS))
    p.add_argument("--frames", type=positive_int, default=None, help="frames per output (video models)")
    p.add_argument("--output-dtype", default="uint8", choices=OUTPUT_DTYPES)
    p.add_argument("--modes", default=None,
                   help=f"comma-separated subset of {','.join(MODES)} (default: {DEFAULT_MODES}; "
                        f"with --compile: {COMPILED_MODES})")
    p.add_argument("--compile", nargs="?", const="default", default="", choices=COMPILE_MODES, metavar="MODE",
                   help="run the daemons with --compile MODE (and --warmup WxH:all: every batch size that forms), and "
                        "limit-compiled with the same mode; x limit stays against the eager limit")
    p.add_argument("--slo-scale", type=positive_float, default=3.0,
                   help="a request meets its SLO when its latency is under this x the single-request latency "
                        "measured before the rounds (default: 3)")
    p.add_argument("--sweep", type=concurrencies, default=(), metavar="N,N,...",
                   help="also run the daemon modes at each of these client concurrencies, e.g. 1,2,4,8,16")
    p.add_argument("--arena-mb", type=positive_int, default=None, help="default: room for 4 batches of outputs")
    p.add_argument("--batch-wait-ms", type=non_negative_float, default=0.0,
                   help="how long the daemon waits to fill a batch (serve --batch-wait-ms)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="measure every mode this many times, the limit around each daemon run, since GPU speed "
                        "drifts (default: 3)")
    p.add_argument("--preview-every", type=preview_list, default=(0,), metavar="N[,N...]",
                   help="ask the daemon for a preview every N steps; several values (0 = none) run each daemon "
                        "mode once per value, in the same rounds, to measure what previews cost (default: 0)")
    p.add_argument("--trace", action="store_true",
                   help="also say where the worker's time goes: forward and idle times, CUDA-timed on a GPU")
    p.add_argument("--no-persist", dest="persist", action="store_false",
                   help="daemons keep jobs in memory only (serve --no-persist); by default each has a temporary "
                        "state dir, as a served daemon has its own")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--verbose", action="store_true",
                   help="keep the model libraries' warnings and progress bars (silenced as the daemon's workers do)")
    p.add_argument("--no-flops", dest="flops", action="store_false",
                   help="skip counting FLOPs per image (one output at batch 1 under FlopCounterMode, cached per "
                        "model, size, steps, guidance and frames); the TFLOP/s and %% peak columns then show -")
    p.add_argument("--peak-tflops", type=positive_float, default=None, metavar="X",
                   help="the device's peak TFLOP/s to take each mode's share of (default: the dense bf16/fp16 "
                        "datasheet peak of a known GPU: H100, H200, A100, L40S, RTX 4090; none on a CPU)")
    p.add_argument("--alternate", nargs=2, metavar=("SPEC_A", "SPEC_B"),
                   help="instead of the modes: two models, requests alternating between them one by one, on a "
                        "daemon under --device-memory against the same daemon with both resident (bench/alternate.py)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="with --alternate: the budget daemon's serve --device-memory, holding one model, not both")
    p.add_argument("--max-model-wait", metavar="DURATION",
                   help="with --alternate: the budget daemon's serve --max-model-wait (default: the daemon's)")
    p.set_defaults(func=None)


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be positive, got 0")
    return value


def concurrencies(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected client counts of at least 1, got {text!r}")
    return values


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def preview_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step counts like 0,1,5, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected step counts of 0 or more, like 0,1,5, got {text!r}")
    return values


def _setup(args: argparse.Namespace) -> Setup:
    import torch

    from diffusiond.ipc.tensors import itemsize

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {device}, but no CUDA device is visible (check nvidia-smi, CUDA_VISIBLE_DEVICES)")
    dtype = args.dtype or ("float16" if device.startswith("cuda") else "float32")
    width, height = args.size
    per_output = width * height * 3 * (args.frames or 1) * itemsize(args.output_dtype)
    arena_mb = args.arena_mb or max(256, (4 * args.batch + 2) * per_output // (1 << 20) + 64)
    return Setup(model=args.model, device=device, dtype=dtype, width=width, height=height, steps=args.steps,
                 batch=args.batch, requests=args.requests, concurrency=args.concurrency or 3 * args.batch + 2,
                 format=args.format, frames=args.frames, output_dtype=args.output_dtype, guidance=args.guidance,
                 arena_mb=arena_mb, batch_wait_ms=args.batch_wait_ms, rounds=args.rounds, trace=args.trace,
                 persist=args.persist, compile=args.compile, slo_scale=args.slo_scale, sweep=args.sweep,
                 previews=args.preview_every)


def run(args: argparse.Namespace) -> int:
    from diffusiond.pipelines.base import PipelineError

    chosen = args.modes or (COMPILED_MODES if args.compile else DEFAULT_MODES)
    modes = [m.strip() for m in chosen.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"diffusiond bench: error: unknown mode(s) {unknown}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    if not args.verbose:  # before torch and the model libraries load: the in-process pipelines are quiet too
        from diffusiond.worker.startup import quiet_libraries  # here: the CLI's --help imports this module

        quiet_libraries()
    try:
        setup = _setup(args)
        runs, flops = measure(setup, modes, count_flops=args.flops, peak_tflops=args.peak_tflops,
                              json_rows=args.json)
    except (BenchError, PipelineError) as exc:
        print(f"diffusiond bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    compare(runs)
    rows = per_mode(runs, setup.batch)
    annotate(rows, flops)
    report = {"setup": asdict(setup), "machine": machine(setup.device), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["diffusiond", *sys.argv[1:]]), "flops": flops, "modes": rows,
              "runs": [asdict(r) for r in runs]}
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0


def measure(s: Setup, modes: list[str], count_flops: bool = False, peak_tflops: float | None = None,
            json_rows: bool = False) -> tuple[list[ModeResult], dict[str, Any] | None]:
    """Every measured run, in the order it ran, and (with ``count_flops``) the report's ``flops`` section."""
    runs: list[ModeResult] = []
    flops = None
    daemon_modes = [m for m in modes if m in DAEMON_MODES]

    def log(what: str) -> None:
        print(f"bench: {what} ...", file=sys.stderr, flush=True)

    def done(run: ModeResult) -> None:
        """Each run's figures on stderr as it ends: a bench cut off by a timeout has printed no JSON yet (a row of
        JSON under --json, for scripts; a sentence otherwise)."""
        runs.append(run)
        row = {k: getattr(run, k) for k in ("mode", "round", "requests", "seconds", "throughput", "p50_ms", "p99_ms",
                                            "batch_sizes")}
        latency = "" if run.p50_ms is None or run.p99_ms is None else \
            f", p50 {run.p50_ms:.0f} ms, p99 {run.p99_ms:.0f} ms"
        words = (f"{run.mode}, round {run.round + 1}: {run.requests} requests in {run.seconds:.2f} s, "
                 f"{run.throughput:.2f} req/s{latency}")
        text = f"row {json.dumps(row)}" if json_rows else words
        print(f"bench: {text}", file=sys.stderr, flush=True)

    with contextlib.ExitStack() as stack:
        limits: list[Limit] = []
        for mode in ("limit", "limit-compiled"):
            if mode in modes:
                log(f"loading the {mode} pipeline")
                limits.append(Limit(s, compiled=mode == "limit-compiled"))
                stack.callback(limits[-1].close)
        if count_flops:  # before the daemons start: a pipeline loaded to count is gone before theirs load
            eager = next((limit.pipe for limit in limits if limit.mode == "limit"), None)
            flops = measure_flops(s, eager, PROMPT, peak_tflops)
        socks = stack.enter_context(_daemons(s, daemon_modes)) if daemon_modes else {}
        slo_ms: dict[str, float] = {}
        for mode in daemon_modes:  # round 1 is not a fresh worker's first run (once the slowest one)
            log(f"warming up {mode}")
            asyncio.run(drive_daemon(socks[mode], replace(s, requests=2 * s.batch, trace=False), PROMPT))
            alone = asyncio.run(drive_daemon(socks[mode], replace(s, requests=4, concurrency=1, trace=False), PROMPT))
            slo_ms[mode] = s.slo_scale * sorted(alone.latencies_ms)[len(alone.latencies_ms) // 2]
        for k in range(s.rounds):
            for limit in limits:
                log(f"round {k + 1}/{s.rounds}: {limit.mode}")
                done(limit.measure(k))
            previews = s.previews if k % 2 == 0 else s.previews[::-1]
            for mode in daemon_modes if k % 2 == 0 else daemon_modes[::-1]:
                for c in (s.concurrency, *(c for c in s.sweep if c != s.concurrency)):
                    for every in previews:
                        name = mode if c == s.concurrency else f"{mode}@c{c}"
                        name += f"+preview/{every}" if every else ""
                        log(f"round {k + 1}/{s.rounds}: {name}")
                        run = replace(s, concurrency=c, preview_every=every)
                        load = asyncio.run(drive_daemon(socks[mode], run, PROMPT))
                        done(_result(name, load, k, slo_ms=slo_ms[mode], concurrency=c))
        if limits and len(modes) > 1:
            log("limit, closing the sequence")
            done(limits[0].measure(s.rounds - 1))
    if "naive" in modes:
        log("naive")
        done(run_naive(s))
    return runs, flops


def machine(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"


@contextlib.contextmanager
def _daemons(s: Setup, modes: list[str]) -> Iterator[dict[str, Path]]:
    """One daemon per mode, started together (their model loads overlap), each on its own socket."""
    with tempfile.TemporaryDirectory(prefix="diffusiond-bench-") as tmp, contextlib.ExitStack() as stack:
        started = []
        for mode in modes:
            sock, log = Path(tmp) / f"{mode}.sock", Path(tmp) / f"{mode}.log"
            argv = [sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--model", s.model,
                    "--device", s.device, "--dtype", s.dtype, "--max-batch", str(s.batch),
                    "--output-mode", mode.removesuffix(MEMORY_SUFFIX),
                    "--arena-mb", str(s.arena_mb), "--batch-wait-ms", str(s.batch_wait_ms),
                    "--queue-size", str(max(256, s.requests * 2)), "--log-level", "warning"]
            if s.trace:
                argv.append("--trace")
            # each daemon its own state dir: two daemons on one refuse to start
            persist = s.persist and not mode.endswith(MEMORY_SUFFIX)
            argv += ["--state-dir", str(Path(tmp) / f"{mode}.state")] if persist else ["--no-persist"]
            if s.compile:  # every batch size that forms at the measured size compiled before ready, as deployed
                argv += ["--compile", s.compile, "--warmup", f"{s.width}x{s.height}:all"]
            started.append((stack.enter_context(process(argv, log)), sock, log))
        for proc, sock, log in started:
            wait_ready(proc, sock, log, "diffusiond serve")
        yield {mode: sock for mode, (_, sock, _) in zip(modes, started, strict=True)}


def run_naive(s: Setup) -> ModeResult:
    with tempfile.TemporaryDirectory(prefix="diffusiond-bench-") as tmp:
        sock, log = Path(tmp) / "n.sock", Path(tmp) / "log"
        argv = [sys.executable, "-m", "diffusiond.bench.naive", "--socket", str(sock), "--model", s.model,
                "--device", s.device, "--dtype", s.dtype]
        with process(argv, log) as proc:
            wait_ready(proc, sock, log, "the naive server")
            res = asyncio.run(drive_naive(sock, s, PROMPT))
    return _result("naive", res, s.rounds - 1, note="hand-written baseline: pipeline under a lock, PIL, PNG inline")


def _result(mode: str, r: LoadResult, round_: int, note: str = "", slo_ms: float | None = None,
            concurrency: int | None = None) -> ModeResult:
    lat = sorted(r.latencies_ms)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))]

    stages = {k: sum(v) / len(v) for k, v in r.stages.items() if v}
    wall = len(lat) / r.seconds
    trace = None
    if r.trace:  # one worker per bench daemon
        w = r.trace[0]
        summary = summarize(w["events"], w["gpu_events"], since_ns=r.since_ns)
        trace = asdict(summary) if summary else None
    slo = None if slo_ms is None else sum(v <= slo_ms for v in lat) / len(lat)
    return ModeResult(mode, len(lat), r.seconds, r.steady_throughput() or wall, pct(50), pct(99), stages, note,
                      trace, wall, r.batch_sizes(), round_, concurrency=concurrency, slo_attainment=slo)
