"""``diffusiond bench``: the trace summary's arithmetic, and a smoke run of every mode on ``tiny``.

Speed is never asserted here (see docs/benchmarks.md for the figures): the smoke run checks that
each mode runs to the end and reports what a reader of the table needs, on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffusiond.bench.load import LoadResult, steady_throughput
from diffusiond.bench.trace import intervals, summarize

MS = 1_000_000


def test_intervals_pair_each_batch_and_drop_unfinished_ones() -> None:
    events = [("compute_start", 1, 0), ("compute_end", 1, 5 * MS), ("compute_start", 2, 6 * MS),
              ("copy_start", 1, 5 * MS), ("compute_start", 3, 20 * MS)]  # fmt: skip
    spans = intervals(events, "compute_start", "compute_end")
    assert [(i.batch_id, i.ms) for i in spans] == [(1, 5.0)]


def test_host_summary_busy_share_and_idle_between_forwards() -> None:
    # three 10 ms forwards with 5 ms and 15 ms between them: 30 ms busy in a 50 ms window
    events = []
    for b, start in ((1, 0), (2, 15), (3, 40)):
        events += [("compute_start", b, start * MS), ("compute_end", b, (start + 10) * MS)]
    s = summarize(events, [])
    assert s is not None
    assert (s.batches, s.forward_ms, s.host_gap_ms) == (3, 10.0, 10.0)
    assert s.host_busy == pytest.approx(0.6)
    assert s.gpu_forward_ms is None and s.copy_overlap is None


def test_warm_up_forwards_before_since_are_left_out() -> None:
    events = [("compute_start", 1, 0), ("compute_end", 1, 100 * MS),
              ("compute_start", 2, 200 * MS), ("compute_end", 2, 210 * MS)]  # fmt: skip
    s = summarize(events, [], since_ns=150 * MS)
    assert s is not None and (s.batches, s.forward_ms) == (1, 10.0)
    assert summarize(events, [], since_ns=300 * MS) is None


def test_gpu_summary_overlap_counts_only_copy_time_inside_forwards() -> None:
    host = [("compute_start", 1, 0), ("compute_end", 1, 1), ("compute_start", 2, 2), ("compute_end", 2, 3)]
    gpu = [
        ("compute_start", 1, 0), ("compute_end", 1, 20 * MS),
        ("compute_start", 2, 25 * MS), ("compute_end", 2, 45 * MS),
        # batch 1's copy: 22-30 ms, of which 25-30 ms runs during forward 2
        ("copy_start", 1, 22 * MS), ("copy_end", 1, 30 * MS),
        ("compute_start", 9, 50 * MS), ("compute_end", 9, 99 * MS),  # not a measured batch
    ]  # fmt: skip
    s = summarize(host, gpu)
    assert s is not None
    assert (s.gpu_forward_ms, s.gpu_gap_ms, s.gpu_copy_ms) == (20.0, 5.0, 8.0)
    assert s.gpu_busy == pytest.approx(40 / 45)
    assert s.copy_overlap == pytest.approx(5 / 8)


def test_steady_throughput_counts_whole_batches_after_the_first() -> None:
    # batches of 4 every 2 s, outputs of a batch arriving over 0.3 s; a partial first batch of 1
    finished = [(10.0, 1, True)]
    for b in range(2, 6):
        finished += [(10.0 + 2 * (b - 1) + 0.1 * k, b, True) for k in range(4)]
    finished += [(18.5, 5, False), (20.3, 6, False)]  # extras: one shares batch 5, one after the end
    # window: end of batch 1 (10.0) to end of batch 5 (max 18.5); batches 2-5 hold 4+4+4+5 outputs
    assert steady_throughput(finished) == pytest.approx(17 / 8.5)
    assert LoadResult(0.0, [], finished=finished).batch_sizes() == [1, 4, 4, 4, 5]  # batch 6: extras only


def test_steady_throughput_without_batch_ids_and_with_too_few_batches() -> None:
    assert steady_throughput([(1.0, None, True), (1.5, None, True), (3.0, None, True)]) == pytest.approx(2 / 2.0)
    assert steady_throughput([(1.0, 7, True), (1.2, 7, True)]) is None  # one batch: no interval to time
    assert steady_throughput([]) is None
    assert LoadResult(0.0, [], finished=[(1.0, None, True)]).batch_sizes() == []  # no ids: nothing to say


def _bench(*extra: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "diffusiond", "bench", "--model", "tiny", "--size", "64x64", "--steps", "2",
            "--batch", "2", "--requests", "4", "--device", "cpu", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def test_bench_runs_every_mode_on_tiny_and_reports_where_the_time_goes(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    done = _bench("--trace", "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["setup"]["model"] == "tiny" and report["date"] and report["machine"]
    modes = {m["mode"]: m for m in report["modes"]}
    assert set(modes) == {"limit", "async", "sync", "naive"}
    assert modes["limit"]["ratio_to_limit"] == 1.0
    for name in ("async", "sync", "naive"):
        m = modes[name]
        assert m["requests"] == 4 and m["throughput"] > 0 and m["p50_ms"] <= m["p99_ms"], m
        assert m["ratio_to_limit"] == pytest.approx(m["throughput"] / modes["limit"]["throughput"], rel=1e-2)
        assert m["wall_throughput"] == pytest.approx(4 / m["seconds"]), m
    for name in ("async", "sync"):  # the daemon's own job records give the stage times
        assert {"queued", "compute", "encode"} <= set(modes[name]["stages_ms"]), modes[name]
        assert "batches hold measured requests" in modes[name]["note"], modes[name]
        t = modes[name]["trace"]
        assert t is not None and t["batches"] >= 2 and 0 < t["host_busy"] <= 1, t
        assert t["gpu_forward_ms"] is None  # CPU: no CUDA timeline
    assert modes["limit"]["trace"]["batches"] == 2  # 4 requests at batch 2
    assert modes["naive"]["trace"] is None  # the baseline has no worker to trace


def test_bench_table_and_a_clear_error_for_an_unknown_mode(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    done = _bench("--modes", "limit,async", "--trace", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout
    assert "| mode | req/s | x limit |" in table and "| async |" in table
    assert "Where the time goes" in table and table.count("| limit |") == 2
    bad = _bench("--modes", "limit,fast", env=env)
    assert bad.returncode == 2 and "unknown mode(s) ['fast']" in bad.stderr
    zero = _bench("--requests", "0", env=env)  # would otherwise wait forever for a first measured request
    assert zero.returncode == 2 and "--requests: must be at least 1, got 0" in zero.stderr
