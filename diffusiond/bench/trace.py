"""Where a worker's time goes: a summary of the timeline a ``--trace`` daemon records.

Throughput below the forward-only limit has two possible causes, and they need different fixes:
the forwards themselves run slower (GPU contention from the copies, or a slower code path), or
they run as fast but start late (the GPU waits for the host: dispatch, the worker's GIL, the
engine). The host timeline (``compute_start``/``compute_end`` around each pipeline call) says
how long the worker sat between calls; the CUDA-timed one says how long the GPU's default stream
spent in each forward, how long it sat idle between them, and how much of each copy on the side
stream ran while a forward was running.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Event = Sequence[Any]  # [name, batch_id, t_ns], as GET /v1/admin/trace returns them (JSON: checked by int())


@dataclass(frozen=True)
class Interval:
    batch_id: int
    start_ns: int
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass(frozen=True)
class TraceSummary:
    batches: int
    forward_ms: float  # median forward, host-timed (pipeline call to return)
    host_gap_ms: float  # mean time the worker spent between one forward's end and the next's start
    host_busy: float  # share of the window the worker spent inside forwards
    gpu_forward_ms: float | None = None  # median forward on the GPU's default stream
    gpu_gap_ms: float | None = None  # mean GPU idle between consecutive forwards
    gpu_busy: float | None = None  # share of the GPU window spent in forwards
    gpu_copy_ms: float | None = None  # mean copy on the side stream
    copy_overlap: float | None = None  # share of copy time that ran while a forward ran
    # Means beside the medians: throughput follows the mean, and a mean well above the median
    # says a few slow forwards, not all of them, made a run slow.
    forward_mean_ms: float | None = None
    gpu_forward_mean_ms: float | None = None


def intervals(events: Iterable[Event], start: str, end: str, batch_ids: set[int] | None = None) -> list[Interval]:
    """Pair each batch's ``start`` and ``end`` events; batches missing either are left out."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for name, batch_id, t_ns in events:
        b, t = int(batch_id), int(t_ns)
        if batch_ids is not None and b not in batch_ids:
            continue
        if name == start:
            starts.setdefault(b, t)
        elif name == end:
            ends[b] = t
    return sorted(
        (Interval(b, starts[b], ends[b]) for b in starts if b in ends and ends[b] >= starts[b]),
        key=lambda i: i.start_ns,
    )


def _busy_and_gap(spans: list[Interval]) -> tuple[float, float]:
    window = spans[-1].end_ns - spans[0].start_ns
    busy = sum(i.end_ns - i.start_ns for i in spans)
    gaps = [max(0, b.start_ns - a.end_ns) for a, b in itertools.pairwise(spans)]
    return (busy / window if window > 0 else 1.0), (sum(gaps) / len(gaps) / 1e6 if gaps else 0.0)


def _overlap_ns(span: Interval, others: list[Interval]) -> int:
    return sum(max(0, min(span.end_ns, o.end_ns) - max(span.start_ns, o.start_ns)) for o in others)


def summarize(events: Sequence[Event], gpu_events: Sequence[Event], since_ns: int = 0) -> TraceSummary | None:
    """The forwards that started at or after ``since_ns`` (host clock; warm-up excluded)."""
    host = [i for i in intervals(events, "compute_start", "compute_end") if i.start_ns >= since_ns]
    if not host:
        return None
    busy, gap = _busy_and_gap(host)
    summary = TraceSummary(len(host), statistics.median([i.ms for i in host]), gap, busy,
                           forward_mean_ms=statistics.fmean(i.ms for i in host))
    ids = {i.batch_id for i in host}
    gpu = intervals(gpu_events, "compute_start", "compute_end", ids)
    if len(gpu) < 2:
        return summary
    gpu_busy, gpu_gap = _busy_and_gap(gpu)
    copies = intervals(gpu_events, "copy_start", "copy_end", ids)
    copy_ns = sum(c.end_ns - c.start_ns for c in copies)
    overlap = sum(_overlap_ns(c, gpu) for c in copies)
    return dataclasses.replace(
        summary, gpu_forward_ms=statistics.median([i.ms for i in gpu]), gpu_gap_ms=gpu_gap, gpu_busy=gpu_busy,
        gpu_forward_mean_ms=statistics.fmean(i.ms for i in gpu),
        gpu_copy_ms=copy_ns / len(copies) / 1e6 if copies else None,
        copy_overlap=overlap / copy_ns if copy_ns > 0 else None,
    )
