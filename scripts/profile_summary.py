"""Where a forward's GPU time goes, from the traces ``DIFFUSIOND_TORCH_PROFILE`` writes.

    DIFFUSIOND_TORCH_PROFILE=/tmp/prof python3 -m diffusiond serve ...   # run some jobs, then
    python3 scripts/profile_summary.py /tmp/prof [--gaps 8]

Groups the traces by their preview setting (``-p<N>`` in the name) and prints, per group, the
medians of: the forward stream's span (first kernel to last), its busy time (the union of its
kernels and copies), its idle time inside the span and in gaps over 50 µs, kernel counts, the other
streams' busy time and how much of it ran while the forward stream was idle, and the host's
synchronising CUDA calls (the copy thread's event waits are expected; one on the forward's thread
is a stall). Then the longest gaps on the forward stream of one trace per group,
with the kernels on either side: a cost that previews add and the kernels do not account for
shows up there. The forward stream is the stream with the most busy time.

``--kernels N`` lists the N kernels (by name, over all traces of a group) that took the most of the forward
stream's time, and that time by family (convolution, matrix product, attention, the rest): what a faster
forward must make faster, before any guess at it.

``--host-op NAME`` (default ``aten::linear``) adds the host side: how long the forward thread's
NAME ops took, overall and in the 5 ms after another thread of the worker made a CUDA call. An
eager forward is bound by its host thread, so a thread that slows it there costs the forward
even when the GPU's kernels are unchanged (docs/benchmarks.md, previews).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU = ("kernel", "gpu_memcpy", "gpu_memset")
SYNCS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events: list[dict[str, Any]] = json.load(f).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X"]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)


def summarize(events: list[dict[str, Any]], gaps_wanted: int) -> dict[str, Any] | None:
    by_stream: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU:
            by_stream[int(e.get("args", {}).get("stream", -1))].append(e)
    if not by_stream:
        return None
    busy = {s: union([(e["ts"], e["ts"] + e["dur"]) for e in es]) for s, es in by_stream.items()}
    main = max(busy, key=lambda s: sum(e - b for b, e in busy[s]))
    spans = busy[main]
    first, last = spans[0][0], spans[-1][1]
    main_busy = sum(e - b for b, e in spans)
    gaps = [(spans[i + 1][0] - spans[i][1], spans[i][1], spans[i + 1][0]) for i in range(len(spans) - 1)]
    big = [g for g in gaps if g[0] > 50]
    others = {s: sp for s, sp in busy.items() if s != main}
    other_busy = sum(e - b for sp in others.values() for b, e in sp)
    # the other streams' time that ran inside the forward stream's idle gaps
    in_gaps = sum(covered(sp, g1, g2) for sp in others.values() for _, g1, g2 in gaps)
    syncs = [f"{e['name']} (thread {e.get('tid')})" for e in events
             if e.get("cat") == "cuda_runtime" and e["name"] in SYNCS]
    kernels = sorted(by_stream[main], key=lambda e: e["ts"])

    def around(t: float) -> str:
        before = [k["name"] for k in kernels if k["ts"] + k["dur"] <= t][-1:]
        after = [k["name"] for k in kernels if k["ts"] >= t][:1]
        return f"{(before or ['-'])[0][:60]}  ->  {(after or ['-'])[0][:60]}"

    return {
        "span_ms": (last - first) / 1000, "busy_ms": main_busy / 1000, "idle_ms": (last - first - main_busy) / 1000,
        "gaps_over_50us": len(big), "gaps_over_50us_ms": sum(g[0] for g in big) / 1000,
        "kernels": len(by_stream[main]), "other_kernels": sum(len(by_stream[s]) for s in others),
        "other_busy_ms": other_busy / 1000, "other_in_gaps_ms": in_gaps / 1000, "syncs": len(syncs),
        "sync_names": sorted(set(syncs)),
        "top_gaps": [(round(g[0] / 1000, 3), around(g[1])) for g in sorted(gaps, reverse=True)[:gaps_wanted]],
        "kernel_us": _by_name(by_stream[main]),
    }


def _by_name(kernels: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for k in kernels:
        out[k["name"][:90]] += k["dur"]
    return out


# Kernel names by family, first match wins: cuDNN's and CUTLASS's convolutions, cuBLAS's and Triton's matrix
# products, flash/cuDNN/efficient attention; the rest (norms, activations, copies, fused elementwise)
_FAMILIES = [("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)),
             ("convolution", re.compile(r"conv|implicit_gemm|cudnn|winograd|fft|dgrad|wgrad|fprop", re.I)),
             ("matrix product", re.compile(r"gemm|matmul|mm_|_mm|cublas|cutlass|sm90_xmma|xmma", re.I))]


def family(name: str) -> str:
    return next((f for f, rx in _FAMILIES if rx.search(name)), "other")


def print_kernels(name: str, rows: list[dict[str, Any]], top: int) -> None:
    total: dict[str, float] = defaultdict(float)
    for r in rows:
        for k, us in r["kernel_us"].items():
            total[k] += us / len(rows)
    busy = sum(total.values()) or 1.0
    fams: dict[str, float] = defaultdict(float)
    for k, us in total.items():
        fams[family(k)] += us
    print(f"\n{name}: the forward stream's time by family (per trace): " + ", ".join(
        f"{f} {us / 1000:.2f} ms ({100 * us / busy:.0f} %)" for f, us in sorted(fams.items(), key=lambda x: -x[1])))
    for k, us in sorted(total.items(), key=lambda x: -x[1])[:top]:
        print(f"  {us / 1000:8.3f} ms {100 * us / busy:5.1f} %  [{family(k)}] {k}")


def host_ops(events: list[dict[str, Any]], name: str) -> dict[str, float] | None:
    """The forward thread's ``name`` op durations (µs): overall, and near other threads' CUDA calls."""
    per_thread: dict[Any, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "cpu_op":
            per_thread[e.get("tid")] += 1
    if not per_thread:
        return None
    forward = max(per_thread, key=lambda t: per_thread[t])
    ops = [e for e in events if e.get("tid") == forward and e.get("name") == name]
    marks = sorted(e["ts"] for e in events if e.get("tid") != forward and e.get("cat") == "cuda_runtime")
    if not ops:
        return None
    near, far = [], []
    for e in ops:
        i = bisect.bisect_right(marks, e["ts"]) - 1
        (near if i >= 0 and e["ts"] - marks[i] < 5000 else far).append(e["dur"])
    return {"ops": len(ops), "median_us": statistics.median(e["dur"] for e in ops),
            "near": len(near), "near_median_us": statistics.median(near) if near else float("nan"),
            "far_median_us": statistics.median(far) if far else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--gaps", type=int, default=8, help="longest gaps to list per group")
    p.add_argument("--host-op", default="aten::linear", help="the forward thread's op to time (host side)")
    p.add_argument("--kernels", type=int, default=0, help="list the N kernels that took the most time")
    args = p.parse_args()
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    hosts: dict[str, list[dict[str, float]]] = defaultdict(list)
    paths = sorted(args.dir.glob("*.json*"))
    for path in paths:
        m = re.search(r"-p(\d+)\.json", path.name)
        group = f"every {m[1]}" if m and m[1] != "0" else "none"
        events = load(path)
        summary = summarize(events, args.gaps)
        if summary is not None:
            groups[group].append(summary)
        host = host_ops(events, args.host_op)
        if host is not None:
            hosts[group].append(host)
    if not groups:
        print(f"no GPU activity in the {len(paths)} traces under {args.dir} (a CPU run, or no traces yet)")
        return
    keys = ["span_ms", "busy_ms", "idle_ms", "gaps_over_50us", "gaps_over_50us_ms", "kernels", "other_kernels",
            "other_busy_ms", "other_in_gaps_ms", "syncs"]
    print("| previews | traces | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for name, rows in sorted(groups.items()):
        cells = [f"{statistics.median(r[k] for r in rows):.3f}" for k in keys]
        print(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    print("\n(medians over each group's traces; ms unless a count)")
    for name, rows in sorted(groups.items()):
        print(f"\n{name}: synchronising calls {rows[0]['sync_names'] or 'none'}; longest gaps on the forward stream:")
        for ms, where in rows[0]["top_gaps"]:
            print(f"  {ms:8.3f} ms  {where}")
    for name, rows in sorted(groups.items()):
        if args.kernels:
            print_kernels(name, rows, args.kernels)
    if hosts:
        print(f"\n| previews | traces | {args.host_op} ops | median µs | ops within 5 ms after another thread's "
              "CUDA call | their median µs | the others' median µs |")
        print("|---|---|---|---|---|---|---|")
        for name, hs in sorted(hosts.items()):
            def med(key: str, hs: list[dict[str, float]] = hs) -> float:
                return statistics.median(h[key] for h in hs)
            print(f"| {name} | {len(hs)} | {med('ops'):.0f} | {med('median_us'):.1f} | {med('near'):.0f} | "
                  f"{med('near_median_us'):.1f} | {med('far_median_us'):.1f} |")


if __name__ == "__main__":
    main()
