"""``DIFFUSIOND_TORCH_PROFILE``: a real daemon's worker writes one trace per forward after the
ones it skips, named by batch and preview setting, and ``scripts/profile_summary.py`` reads the
stream timeline a GPU trace holds (checked here on a made-up one: this box has no GPU)."""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

import pytest
from daemonkit import http, shared_daemon, submit, wait_job

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import profile_summary


async def test_the_worker_traces_each_forward_after_the_skipped_ones(tmp_path: Path, model_cache: Path) -> None:
    traces = tmp_path / "traces"
    env = {"DIFFUSIOND_TORCH_PROFILE": f"{traces}:1:2"}
    with shared_daemon(tmp_path, ["--model", "tiny", "--max-batch", "1"], model_cache, env) as d:
        async with http(d.socket) as s:
            for k, preview in enumerate([None, {"every": 2}, None, {"every": 1}]):
                body = {"prompt": "a lighthouse", "steps": 4, "seed": k, "width": 64, "height": 64}
                if preview:
                    body["preview"] = preview
                job = await submit(s, body)
                assert (await wait_job(s, job["id"]))["status"] == "succeeded"
    names = sorted(p.name for p in traces.iterdir())
    # forwards 2 and 3 of 4 (skip 1, count 2): the first with previews every 2 steps, the other without
    assert sorted(re.sub(r"^\d+-b\d+-", "", n) for n in names) == ["p0.json.gz", "p2.json.gz"], names
    for name in names:
        with gzip.open(traces / name, "rt") as f:
            assert json.load(f)["traceEvents"], f"{name} holds no events"


def test_a_bad_setting_is_refused_with_the_form_it_takes(tmp_path: Path) -> None:
    from diffusiond.worker.profile import ForwardProfiler

    with pytest.raises(ValueError, match=r"DIFFUSIOND_TORCH_PROFILE=.*DIR\[:SKIP\[:COUNT\]\]"):
        ForwardProfiler(f"{tmp_path}:two")


def test_the_summary_finds_the_forward_streams_gaps_and_what_ran_in_them(tmp_path: Path) -> None:
    def gpu(name: str, stream: int, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [
        gpu("unet_a", 7, 0, 400), gpu("unet_b", 7, 400, 300),  # back to back
        gpu("unet_c", 7, 900, 500),  # after a 200 µs gap
        gpu("convert", 20, 750, 100),  # the copy stream, inside that gap
        gpu("unet_d", 7, 1420, 80),  # a 20 µs gap: under the 50 µs threshold
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 960, "dur": 5, "tid": 3},
    ]
    s = profile_summary.summarize(events, gaps_wanted=2)
    assert s is not None
    assert s["span_ms"] == pytest.approx(1.5) and s["busy_ms"] == pytest.approx(1.28)
    assert s["idle_ms"] == pytest.approx(0.22) and s["gaps_over_50us"] == 1
    assert s["other_busy_ms"] == pytest.approx(0.1) and s["other_in_gaps_ms"] == pytest.approx(0.1)
    assert s["syncs"] == 1
    assert s["top_gaps"][0] == (0.2, "unet_b  ->  unet_c")
    path = tmp_path / "1-b3-p1.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert profile_summary.load(path) == events
