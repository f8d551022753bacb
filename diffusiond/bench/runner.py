"""The benchmark driver: runs each mode in turn on one model and prints one table."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from diffusiond.bench.load import LoadResult, drive_daemon, drive_naive
from diffusiond.bench.trace import summarize
from diffusiond.cli_generate import parse_size, positive_int
from diffusiond.ipc.tensors import itemsize

MODES = ("limit", "async", "sync", "naive")
PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"


@dataclass
class Setup:
    model: str
    device: str
    dtype: str
    width: int
    height: int
    steps: int
    batch: int
    requests: int
    concurrency: int
    format: str
    frames: int | None
    output_dtype: str
    guidance: float
    arena_mb: int
    batch_wait_ms: float
    trace: bool = False


@dataclass
class ModeResult:
    mode: str
    requests: int
    seconds: float
    throughput: float  # steady state: what the ratio to the limit is taken from
    p50_ms: float | None
    p99_ms: float | None
    stages_ms: dict[str, float] = field(default_factory=dict)
    note: str = ""
    trace: dict[str, Any] | None = None  # TraceSummary fields, with --trace
    wall_throughput: float | None = None  # measured requests / seconds, fill and drain included


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure the daemon against the forward-only limit and baselines")
    p.add_argument("--model", default="tiny", metavar="SPEC")
    p.add_argument("--device", default=None, help="default: cuda:0 if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--size", default="512x512", type=parse_size, metavar="WxH")
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--batch", type=positive_int, default=1, help="outputs per forward (daemon: --max-batch)")
    p.add_argument("--requests", type=positive_int, default=64, help="measured requests per mode (one output each)")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="concurrent clients (default: 3 x batch + 2, so a full batch is always waiting)")
    p.add_argument("--format", default="png", choices=("png", "jpeg", "webp", "npy", "mp4"))
    p.add_argument("--frames", type=positive_int, default=None, help="frames per output (video models)")
    p.add_argument("--output-dtype", default="uint8", choices=("uint8", "float16", "float32"))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--arena-mb", type=positive_int, default=None, help="default: room for 4 batches of outputs")
    p.add_argument("--batch-wait-ms", type=float, default=0.0)
    p.add_argument("--trace", action="store_true",
                   help="also say where the worker's time goes: forward and idle times, CUDA-timed on a GPU")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=None)


def _setup(args: argparse.Namespace) -> Setup:
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float16" if device.startswith("cuda") else "float32")
    width, height = args.size
    per_output = width * height * 3 * (args.frames or 1) * itemsize(args.output_dtype)
    arena_mb = args.arena_mb or max(256, (4 * args.batch + 2) * per_output // (1 << 20) + 64)
    return Setup(model=args.model, device=device, dtype=dtype, width=width, height=height, steps=args.steps,
                 batch=args.batch, requests=args.requests, concurrency=args.concurrency or 3 * args.batch + 2,
                 format=args.format, frames=args.frames, output_dtype=args.output_dtype, guidance=args.guidance,
                 arena_mb=arena_mb, batch_wait_ms=args.batch_wait_ms, trace=args.trace)


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"diffusiond bench: error: unknown mode(s) {unknown}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    setup = _setup(args)
    results: list[ModeResult] = []
    for mode in modes:
        print(f"bench: running {mode} ...", file=sys.stderr, flush=True)
        if mode == "limit":
            results.append(run_limit(setup))
        elif mode in ("async", "sync"):
            results.append(run_daemon(setup, mode))
        else:
            results.append(run_naive(setup))
    if "limit" in modes and len(modes) > 1:
        # Measured again at the end: host speed drifts on shared machines, and the ratio to the
        # limit should not flatter the daemon because the first limit run was a slow one.
        print("bench: running limit again ...", file=sys.stderr, flush=True)
        again = run_limit(setup)
        first = next(r for r in results if r.mode == "limit")
        best = max(first, again, key=lambda r: r.throughput)
        best.note += f"; best of two runs ({first.throughput:.2f} and {again.throughput:.2f} req/s)"
        results[results.index(first)] = best
    report = {"setup": asdict(setup), "machine": machine(setup.device), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["diffusiond", *sys.argv[1:]]), "modes": [asdict(r) for r in results]}
    limit = next((r.throughput for r in results if r.mode == "limit"), None)
    for r in report["modes"]:
        r["ratio_to_limit"] = round(r["throughput"] / limit, 3) if limit else None
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(table(report))
    return 0


def machine(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def table(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [
        f"model {s['model']} on {s['device']} ({s['dtype']}), {s['width']}x{s['height']}, {s['steps']} steps, "
        f"batch {s['batch']}, {s['requests']} requests, concurrency {s['concurrency']}, format {s['format']}"
        + (f", {s['frames']} frames" if s["frames"] else ""),
        f"machine: {report['machine']}; {report['date']}",
        "",
        "| mode | req/s | x limit | wall req/s | p50 ms | p99 ms | queued ms | compute ms | copy ms | encode ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    def g(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in report["modes"]:
        st = r["stages_ms"]
        ratio = "-" if r["ratio_to_limit"] is None else f"{r['ratio_to_limit']:.3f}"
        lines.append(
            f"| {r['mode']} | {r['throughput']:.2f} | {ratio} | {g(r.get('wall_throughput'))} | "
            f"{f(r['p50_ms'])} | {f(r['p99_ms'])} | "
            f"{f(st.get('queued'))} | {f(st.get('compute'))} | {f(st.get('copy'))} | {f(st.get('encode'))} |"
        )
    notes = [f"{r['mode']}: {r['note']}" for r in report["modes"] if r["note"]]
    legend = ["", "req/s: steady state, from the end of the first batch of measured requests to the end of the "
              "last (what x limit compares; the limit times forwards back to back); wall req/s: measured "
              "requests over the whole measured phase, the pipeline's fill and drain included."]
    return "\n".join(lines + legend + (["", *notes] if notes else []) + trace_table(report))


def trace_table(report: dict[str, Any]) -> list[str]:
    """With --trace: forward time and idle time per batch, host-timed and GPU-timed."""
    rows = [r for r in report["modes"] if r.get("trace")]
    if not rows:
        return []

    def f(v: float | None, scale: float = 1.0) -> str:
        return "-" if v is None else f"{v * scale:.1f}"

    lines = ["", "Where the time goes (median forward, mean idle between forwards, per batch; busy = share of the "
             "window spent in forwards; overlap = share of copy time that ran during a forward):", "",
             "| mode | batches | forward ms | idle ms | busy % | GPU forward ms | GPU idle ms | GPU busy % "
             "| GPU copy ms | copy overlap % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["trace"]
        lines.append(
            f"| {r['mode']} | {t['batches']} | {f(t['forward_ms'])} | {f(t['host_gap_ms'])} | {f(t['host_busy'], 100)} "
            f"| {f(t['gpu_forward_ms'])} | {f(t['gpu_gap_ms'])} | {f(t['gpu_busy'], 100)} | {f(t['gpu_copy_ms'])} "
            f"| {f(t['copy_overlap'], 100)} |"
        )
    return lines


# limit ----------------------------------------------------------------------------------------
def run_limit(s: Setup) -> ModeResult:
    import torch

    from diffusiond.ipc.messages import BatchParams, RequestSpec
    from diffusiond.pipelines import load_pipeline

    pipe = load_pipeline(s.model, device=s.device, dtype=s.dtype)
    params = BatchParams(width=s.width, height=s.height, steps=s.steps, guidance=s.guidance, num_frames=s.frames,
                         output_dtype=s.output_dtype)  # type: ignore[arg-type]
    batches = max(1, s.requests // s.batch)
    reqs = [RequestSpec(request_id=str(i), prompt=PROMPT, seed=i) for i in range(s.batch)]
    cuda = s.device.startswith("cuda")
    with torch.inference_mode():
        for _ in range(2):
            pipe.run(params, reqs, lambda a, b: True)
        if cuda:
            torch.cuda.synchronize()
        events: list[tuple[str, int, int]] = []
        gpu_marks: list[tuple[str, int, Any]] = []

        def mark(name: str, k: int) -> None:
            if not s.trace:
                return
            events.append((name, k, time.monotonic_ns()))
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                gpu_marks.append((name, k, ev))

        t0 = time.perf_counter()
        outs = None
        for k in range(batches):
            mark("compute_start", k)
            outs = pipe.run(params, reqs, lambda a, b: True)
            mark("compute_end", k)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        trace = None
        if s.trace:
            gpu_events = [(n, k, int(gpu_marks[0][2].elapsed_time(ev) * 1e6)) for n, k, ev in gpu_marks]
            summary = summarize(events, gpu_events)  # type: ignore[arg-type]
            trace = asdict(summary) if summary else None
    del pipe, outs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    n = batches * s.batch
    per_batch = elapsed / batches * 1000
    return ModeResult("limit", n, elapsed, n / elapsed, None, None, {"compute": per_batch},
                      note=f"forward only, outputs left on the device; {per_batch:.1f} ms per batch", trace=trace)


# daemon modes ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _process(argv: list[str], sock: Path, log: Path):  # type: ignore[no-untyped-def]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_ready(proc, sock, log)
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], sock: Path, log: Path, timeout: float = 1800) -> None:
    async def poll() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if sock.exists():
                try:
                    conn = aiohttp.UnixConnector(path=str(sock))
                    async with aiohttp.ClientSession(connector=conn) as s, s.get("http://x/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
            await asyncio.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s")

    asyncio.run(poll())


def run_daemon(s: Setup, mode: str) -> ModeResult:
    with tempfile.TemporaryDirectory(prefix="diffusiond-bench-") as tmp:
        sock = Path(tmp) / "d.sock"
        argv = [sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--model", s.model,
                "--device", s.device, "--dtype", s.dtype, "--max-batch", str(s.batch), "--output-mode", mode,
                "--arena-mb", str(s.arena_mb), "--batch-wait-ms", str(s.batch_wait_ms),
                "--queue-size", str(max(256, s.requests * 2)), "--log-level", "warning"]
        if s.trace:
            argv.append("--trace")
        with _process(argv, sock, Path(tmp) / "log"):
            res = asyncio.run(drive_daemon(sock, s, PROMPT))
    return _result(mode, res, s.batch)


def run_naive(s: Setup) -> ModeResult:
    with tempfile.TemporaryDirectory(prefix="diffusiond-bench-") as tmp:
        sock = Path(tmp) / "n.sock"
        argv = [sys.executable, "-m", "diffusiond.bench.naive", "--socket", str(sock), "--model", s.model,
                "--device", s.device, "--dtype", s.dtype]
        with _process(argv, sock, Path(tmp) / "log"):
            res = asyncio.run(drive_naive(sock, s, PROMPT))
    return _result("naive", res, s.batch, note="hand-written baseline: pipeline under a lock, PIL, PNG inline")


def _result(mode: str, r: LoadResult, batch: int, note: str = "") -> ModeResult:
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
    steady = r.steady_throughput()
    sizes = r.batch_sizes()
    if sizes:  # a batch below --batch costs a whole forward: the first thing to look at in a gap
        full = sum(n >= batch for n in sizes)
        note = (f"{len(sizes)} batches hold measured requests, {sum(sizes) / len(sizes):.2f} outputs each on "
                f"average, {full} of them full ({batch})")
    return ModeResult(mode, len(lat), r.seconds, steady or wall, pct(50), pct(99), stages, note, trace, wall)
