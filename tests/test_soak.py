"""The short soak: ``scripts/soak.py`` at a size CI can afford, checked the way the long one is
(nothing lost, nothing left behind). The long run and its figures are in docs/reliability.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_soak_short_run_loses_nothing_and_leaves_nothing(model_cache: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--requests", "120", "--concurrency", "16",
         "--seconds", "300", "--retention-s", "2"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    report = json.loads(out.stdout)
    assert out.returncode == 0, (report, out.stderr[-2000:])
    assert report["requests"] == 120 and report["error_count"] == 0
    assert report["arena_bytes_in_use_after"] == 0 and not report["dev_shm_new_entries"]
    assert all(n == 0 for n in report["jobs_after"].values())  # every job expired after retention
    assert report["daemon"]["after"]["fds"] == report["daemon"]["before"]["fds"]
    assert report["exit_code"] == 0
