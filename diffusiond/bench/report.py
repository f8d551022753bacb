"""What a bench run reports: one result per measured run, the figures per mode, and the tables.

A GPU's speed drifts over a run of a few minutes (clocks settle, the host's turbo changes with
load), by more than the margins the daemon is measured against. So the limit is measured in
every round, around the daemon's runs, and each daemon run is compared with the mean of the
limit runs just before and just after it: drift that is linear over the pair cancels, and the
comparison no longer depends on where in the run a mode happened to go. The figure per mode is
the median over rounds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from diffusiond.bench.flops import describe
from diffusiond.protocol import OutputDtype


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
    output_dtype: OutputDtype
    guidance: float
    arena_mb: int
    batch_wait_ms: float
    rounds: int = 1
    trace: bool = False
    persist: bool = True  # the daemons keep jobs in a state dir (their own, temporary), as serve does
    compile: str = ""  # torch.compile mode of the daemons and of limit-compiled; "" for eager
    slo_scale: float = 3.0  # a request meets its SLO under slo_scale x the single-request latency
    sweep: tuple[int, ...] = ()  # client concurrencies to run the daemon modes at, besides --concurrency
    previews: tuple[int, ...] = (0,)  # --preview-every: each daemon mode runs once per value (0: none)
    preview_every: int = 0  # the value of the run being driven
    models: tuple[str, ...] = ()  # --alternate: the served models, request k going to models[k % len(models)]


@dataclass
class ModeResult:
    """One measured run of one mode."""

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
    batch_sizes: list[int] = field(default_factory=list)  # outputs per forward holding measured requests
    round: int = 0
    ratio_to_limit: float | None = None  # against the limit runs around this one
    concurrency: int | None = None  # clients, for daemon runs
    slo_attainment: float | None = None  # share of measured requests within the SLO (daemon runs)


def compare(runs: list[ModeResult]) -> None:
    """Set each run's ratio to the limit from the limit runs next to it in the sequence.

    A daemon run between two limit runs is compared with their mean; one with a limit run on one
    side only (the baseline, run last) with that one. Limit runs get their ratio to the median
    limit, which shows the drift the bracketing takes out.
    """
    limits = [i for i, r in enumerate(runs) if r.mode == "limit"]
    if not limits:
        return
    median = statistics.median(runs[i].throughput for i in limits)
    for i, r in enumerate(runs):
        if r.mode == "limit":
            r.ratio_to_limit = round(r.throughput / median, 3)
            continue
        before = [runs[j].throughput for j in limits if j < i][-1:]
        after = [runs[j].throughput for j in limits if j > i][:1]
        r.ratio_to_limit = round(r.throughput / statistics.fmean(before + after), 3)


def per_mode(runs: list[ModeResult], batch: int) -> list[dict[str, Any]]:
    """One row per mode, in first-run order: medians over its runs, stage means, pooled batch sizes."""
    rows = []
    for mode in dict.fromkeys(r.mode for r in runs):
        mine = [r for r in runs if r.mode == mode]
        stages: dict[str, list[float]] = {}
        for r in mine:
            for k, v in r.stages_ms.items():
                stages.setdefault(k, []).append(v)
        sizes = [n for r in mine for n in r.batch_sizes]
        note = mine[0].note
        if sizes:  # a batch below --batch costs a whole forward: the first thing to look at in a gap
            note = (f"{len(sizes)} batches hold measured requests, {sum(sizes) / len(sizes):.2f} outputs each on "
                    f"average, {sum(n >= batch for n in sizes)} of them full ({batch})")
        rows.append({
            "mode": mode, "runs": len(mine), "requests": sum(r.requests for r in mine),
            "throughput": statistics.median(r.throughput for r in mine),
            "ratio_to_limit": 1.0 if mode == "limit" else _median([r.ratio_to_limit for r in mine]),
            "wall_throughput": _median([r.wall_throughput for r in mine]),
            "p50_ms": _median([r.p50_ms for r in mine]), "p99_ms": _median([r.p99_ms for r in mine]),
            "slo_attainment": _median([r.slo_attainment for r in mine]),
            "stages_ms": {k: statistics.fmean(v) for k, v in stages.items()}, "note": note,
        })  # fmt: skip
    return rows


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _f(v: float | None, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.1f}"


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _t(v: float | None) -> str:
    """TFLOP/s to three significant figures: a CPU's 0.00123 and an H200's 412 both stay readable."""
    return "-" if v is None else f"{v:.3g}"


def _two(t: dict[str, Any], key: str) -> str:
    """Median / mean; reports written before the mean was recorded have the median only."""
    mean = t.get(f"{key}_mean_ms")
    return _f(t[f"{key}_ms"]) + ("" if mean is None else f" / {mean:.1f}")


CPU_NOTE = ("note: measured on the CPU. These figures do not measure what the daemon is built for (the GPU "
            "path: a copy thread overlapping forwards, pinned shared memory), and the modes compete with the "
            "forwards for the same cores, so ratios to the limit (a naive server far above 1x) say nothing about a "
            "GPU; run on a CUDA device for figures that mean something.")
"""Printed under a table measured off the GPU: a ratio like the naive server at 10.8x the limit on a
2-core box reads as a result unless something says it is not one."""


def table(report: dict[str, Any]) -> str:
    s = report["setup"]
    rounds = s.get("rounds", 1)
    lines = [
        f"model {s['model']} on {s['device']} ({s['dtype']}), {s['width']}x{s['height']}, {s['steps']} steps, "
        f"batch {s['batch']}, {s['requests']} requests, concurrency {s['concurrency']}, format {s['format']}"
        + (f", {s['frames']} frames" if s["frames"] else "") + f", {rounds} round{'s' * (rounds != 1)}",
        f"machine: {report['machine']}; {report['date']}",
        "",
        "| mode | req/s | x limit | TFLOP/s | % peak | wall req/s | p50 ms | p99 ms | SLO % | queued ms | compute ms "
        "| copy ms | encode ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["modes"]:
        st = r["stages_ms"]
        lines.append(
            f"| {r['mode']} | {r['throughput']:.2f} | {_r(r['ratio_to_limit'])} | {_t(r.get('tflops'))} | "
            f"{_f(r.get('peak_share'), 100)} | {_g(r.get('wall_throughput'))} | "
            f"{_f(r['p50_ms'])} | {_f(r['p99_ms'])} | {_f(r.get('slo_attainment'), 100)} | "
            f"{_f(st.get('queued'))} | {_f(st.get('compute'))} | {_f(st.get('copy'))} | {_f(st.get('encode'))} |"
        )
    legend = ["", "req/s: steady state, from the end of the first batch of measured requests to the end of the "
              "last (what x limit compares; the limit times forwards back to back); wall req/s: measured "
              "requests over the whole measured phase, the pipeline's fill and drain included. x limit: each "
              "run against the mean of the limit runs just before and after it; per mode, medians over its runs. "
              f"SLO %: measured requests whose latency was under {s.get('slo_scale', 3.0):g} x the single-request "
              "latency measured before the rounds (--slo-scale); MODE@cN: the daemon at N concurrent clients "
              "(--sweep)."]
    notes = [f"{r['mode']}: {r['note']}" for r in report["modes"] if r["note"]]
    if not str(s["device"]).startswith("cuda"):
        legend += ["", CPU_NOTE]
    legend += describe(report.get("flops"))
    return "\n".join(lines + legend + (["", *notes] if notes else []) + runs_table(report) + trace_table(report))


def runs_table(report: dict[str, Any]) -> list[str]:
    """Every measured run in the order it ran: the spread behind each median, and the drift."""
    runs = report.get("runs", [])
    if len(runs) <= len(report["modes"]):
        return []
    lines = ["", "Runs, in the order they ran (a limit run's x limit is against the median limit: the drift):", "",
             "| # | round | mode | req/s | x limit | batches (mean size) |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        sizes = r.get("batch_sizes") or []
        batches = f"{len(sizes)} ({sum(sizes) / len(sizes):.2f})" if sizes else "-"
        lines.append(f"| {i} | {r['round'] + 1} | {r['mode']} | {r['throughput']:.2f} | {_r(r['ratio_to_limit'])} "
                     f"| {batches} |")
    return lines


def trace_table(report: dict[str, Any]) -> list[str]:
    """With --trace: forward time and idle time per batch, host-timed and GPU-timed, for each run."""
    rows = [(i, r) for i, r in enumerate(report.get("runs", []), 1) if r.get("trace")]
    if not rows:
        return []
    lines = ["", "Where the time goes (forward: median / mean; idle: mean between forwards; busy = share of the "
             "window spent in forwards; overlap = share of copy time that ran during a forward):", "",
             "| # | mode | batches | forward ms | idle ms | busy % | GPU forward ms | GPU idle ms | GPU busy % "
             "| GPU copy ms | copy overlap % |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in rows:
        t = r["trace"]
        lines.append(
            f"| {i} | {r['mode']} | {t['batches']} | {_two(t, 'forward')} | {_f(t['host_gap_ms'])} "
            f"| {_f(t['host_busy'], 100)} | {_two(t, 'gpu_forward')} | {_f(t['gpu_gap_ms'])} "
            f"| {_f(t['gpu_busy'], 100)} | {_f(t['gpu_copy_ms'])} | {_f(t['copy_overlap'], 100)} |"
        )
    return lines
