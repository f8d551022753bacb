"""``scripts/bench_preview_ab.py``'s arithmetic: ratios pair each arm with the no-preview forward
of the same cycle (of the same run, when saved runs are merged), and the interval it prints
brackets the median it prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_preview_ab as ab


def rows(ms: dict[int, list[float]]) -> list[dict[str, object]]:
    """One cycle per position: ``ms[every][k]`` is arm ``every``'s forward in cycle ``k``."""
    return [{"index": 0, "cycle": k, "every": every, "batch": k, "compute_ms": t, "gpu_ms": t}
            for every, times in ms.items() for k, t in enumerate(times)]


def test_each_arm_is_compared_with_the_no_preview_forward_of_its_own_cycle() -> None:
    # the GPU slows down over the run; every step costs 10 % of whatever the cycle's speed is
    none = [100.0, 200.0, 300.0, 400.0, 500.0]
    summary = ab.summarize(rows({0: none, 1: [t * 1.1 for t in none]}), [0, 1])
    every = next(m for m in summary if m["every"] == 1)
    assert every["ratio_median"] == pytest.approx(1.1) and every["slower"] == 5
    low, high = every["ratio_median_ci95"]
    assert low == pytest.approx(1.1) and high == pytest.approx(1.1)


def test_the_interval_brackets_the_median_and_widens_with_noise() -> None:
    none = [100.0] * 40
    noisy = [100.0 * (1.0 + (0.2 if k % 2 else -0.15)) for k in range(40)]
    every = ab.summarize(rows({0: none, 1: noisy}), [0, 1])[1]
    low, high = every["ratio_median_ci95"]
    assert low <= every["ratio_median"] <= high and high - low > 0.1
    assert every["slower"] == 20


def test_merged_runs_keep_their_cycles_apart(tmp_path: Path) -> None:
    paths = []
    for run, scale in enumerate([1.0, 2.0]):  # the second run's GPU is twice as slow
        none = [100.0 * scale] * 3
        doc = {"setup": {"arms": "0,5"}, "summary": [], "rows": rows({0: none, 5: [t * 1.02 for t in none]})}
        paths.append(tmp_path / f"run{run}.json")
        paths[-1].write_text(json.dumps(doc))
    merged, arms = ab.merged([str(p) for p in paths])
    every = ab.summarize(merged, arms)[1]
    assert arms == [0, 5] and every["forwards"] == 6 and every["ratio_median"] == pytest.approx(1.02)
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"setup": {"arms": "0,1"}, "rows": []}))
    with pytest.raises(SystemExit, match="arms"):
        ab.merged([str(paths[0]), str(bad)])
