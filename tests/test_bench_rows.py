"""``diffusiond bench`` prints each run's figures as the run ends: a bench stopped by a timeout (a GPU step's
bound, scripts/gpu_round3.sh) has printed no JSON report yet, and the rows are all that is left of it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def test_each_run_s_row_is_on_stderr_as_it_ends(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "diffusiond", "bench", "--model", "tiny", "--size", "64x64", "--steps", "1",
            "--requests", "1", "--device", "cpu", "--modes", "limit", "--rounds", "1", "--no-flops", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line.removeprefix("bench: row ")) for line in done.stderr.splitlines()
            if line.startswith("bench: row ")]
    report = json.loads(done.stdout)
    assert [r["mode"] for r in rows] == [r["mode"] for r in report["runs"]] == ["limit"]
    assert rows[0]["throughput"] == report["runs"][0]["throughput"] > 0


def test_bench_leaves_the_libraries_chatter_out_and_says_each_run_in_words(model_cache: Path) -> None:
    """Its in-process pipeline flooded stderr with transformers' warnings, diffusers' progress bars and raw JSON rows
: quieted as the daemon's workers are (``--verbose`` keeps it), rows as JSON only with
    ``--json``."""
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "diffusiond", "bench", "--model", "tiny", "--size", "64x64", "--steps", "1",
            "--requests", "1", "--device", "cpu", "--modes", "limit", "--rounds", "1", "--no-flops"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[:2] == ["bench: loading the limit pipeline ...", "bench: round 1/1: limit ..."], done.stderr
    assert len(lines) == 3 and re.fullmatch(r"bench: limit, round 1: 1 requests in [\d.]+ s, [\d.]+ req/s", lines[2]), \
        done.stderr
    assert "| limit |" in done.stdout
