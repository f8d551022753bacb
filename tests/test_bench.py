"""``diffusiond bench``: the trace summary's arithmetic, and a smoke run of every mode on ``tiny``.

Speed is never asserted here (see docs/benchmarks.md for the figures): the smoke run checks that
each mode runs to the end and reports what a reader of the table needs, on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from diffusiond.bench.load import LoadResult, _body, steady_throughput
from diffusiond.bench.report import ModeResult, Setup, compare, per_mode, table
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


def test_a_slow_minority_of_forwards_shows_in_the_mean_not_the_median() -> None:
    events, gpu = [], []
    for b, (start, ms) in enumerate(((0, 10), (10, 10), (20, 40)), 1):  # back to back: 10, 10 and 40 ms
        events += [("compute_start", b, start * MS), ("compute_end", b, (start + ms) * MS)]
    gpu = list(events)
    s = summarize(events, gpu)
    assert s is not None
    assert (s.forward_ms, s.forward_mean_ms) == (10.0, 20.0)
    assert (s.gpu_forward_ms, s.gpu_forward_mean_ms) == (10.0, 20.0)


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


def _run(mode: str, throughput: float, sizes: list[int] | None = None) -> ModeResult:
    return ModeResult(mode, 8, 1.0, throughput, None, None, batch_sizes=sizes or [])


def test_each_daemon_run_is_compared_with_the_limit_runs_around_it() -> None:
    # the GPU slows through the run: 10, 9, 8 req/s from the limit; the daemon at 0.95 of its neighbours
    runs = [_run("limit", 10.0), _run("async", 9.025, [8, 8]), _run("limit", 9.0), _run("async", 8.075, [8, 4]),
            _run("limit", 8.0), _run("naive", 4.0)]  # fmt: skip
    compare(runs)
    assert [r.ratio_to_limit for r in runs] == [1.111, 0.95, 1.0, 0.95, 0.889, 0.5]  # naive: the last limit only
    rows = {r["mode"]: r for r in per_mode(runs, batch=8)}
    assert rows["async"]["ratio_to_limit"] == 0.95  # the best-of-limits would have said 0.9025 and 0.8075
    assert rows["async"]["throughput"] == pytest.approx((9.025 + 8.075) / 2) and rows["async"]["runs"] == 2
    assert rows["async"]["note"] == "4 batches hold measured requests, 7.00 outputs each on average, 3 of them full (8)"
    assert rows["limit"]["ratio_to_limit"] == 1.0 and rows["limit"]["throughput"] == 9.0


def test_without_a_limit_run_there_is_no_ratio() -> None:
    runs = [_run("async", 5.0), _run("sync", 4.0)]
    compare(runs)
    assert all(r.ratio_to_limit is None for r in runs)
    assert all(row["ratio_to_limit"] is None for row in per_mode(runs, batch=1))


def _bench(*extra: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "diffusiond", "bench", "--model", "tiny", "--size", "64x64", "--steps", "2",
            "--batch", "2", "--requests", "4", "--device", "cpu", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def test_bench_runs_every_mode_in_rounds_on_tiny_and_reports_where_the_time_goes(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    done = _bench("--rounds", "2", "--trace", "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["setup"]["model"] == "tiny" and report["setup"]["rounds"] == 2
    assert report["date"] and report["machine"]
    # the limit around every daemon run, daemon order swapped in round 2, the baseline last
    assert [r["mode"] for r in report["runs"]] == ["limit", "async", "sync", "limit", "sync", "async", "limit", "naive"]
    runs = report["runs"]
    for i in (1, 2, 4, 5):  # each daemon run against the mean of the limit runs on either side of it
        around = [r["throughput"] for r in runs[:i] if r["mode"] == "limit"][-1:] + \
                 [r["throughput"] for r in runs[i:] if r["mode"] == "limit"][:1]
        assert runs[i]["ratio_to_limit"] == pytest.approx(runs[i]["throughput"] / (sum(around) / 2), abs=1e-3)
    assert runs[7]["ratio_to_limit"] == pytest.approx(runs[7]["throughput"] / runs[6]["throughput"], abs=1e-3)
    modes = {m["mode"]: m for m in report["modes"]}
    assert set(modes) == {"limit", "async", "sync", "naive"}
    assert modes["limit"]["ratio_to_limit"] == 1.0 and modes["limit"]["runs"] == 3
    for name in ("async", "sync"):
        m, mine = modes[name], [r for r in runs if r["mode"] == name]
        assert m["runs"] == 2 and m["requests"] == 8 and m["p50_ms"] <= m["p99_ms"], m
        assert m["ratio_to_limit"] == pytest.approx(sum(r["ratio_to_limit"] for r in mine) / 2, abs=1e-3)
        assert {"queued", "compute", "encode"} <= set(m["stages_ms"]), m  # from the daemon's own job records
        assert "batches hold measured requests" in m["note"], m
        for r in mine:
            assert r["wall_throughput"] == pytest.approx(4 / r["seconds"]), r
            assert sum(r["batch_sizes"]) >= 4 and max(r["batch_sizes"]) <= 2, r
            t = r["trace"]
            assert t is not None and t["batches"] >= 2 and 0 < t["host_busy"] <= 1, t
            assert t["gpu_forward_ms"] is None  # CPU: no CUDA timeline
    assert all(r["trace"]["batches"] == 2 for r in runs if r["mode"] == "limit")  # 4 requests at batch 2
    assert runs[7]["trace"] is None  # the baseline has no worker to trace
    text = table(report)  # what the command prints without --json, from the same report
    assert "| mode | req/s | x limit |" in text and "| async |" in text and "1 round," not in text
    assert "Runs, in the order they ran" in text and "| 4 | limit |" in text  # more runs than modes
    assert "Where the time goes" in text
    assert "note: measured on the CPU. These figures do not measure" in text  # no CPU ratio read as a result


def test_bench_refuses_an_unknown_mode_and_bad_numbers_in_one_line(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    bad = _bench("--modes", "limit,fast", env=env)
    assert bad.returncode == 2 and "unknown mode(s) ['fast']" in bad.stderr
    zero = _bench("--requests", "0", env=env)  # would otherwise wait forever for a first measured request
    assert zero.returncode == 2 and "--requests: must be at least 1, got 0" in zero.stderr
    wait = _bench("--batch-wait-ms", "-5", env=env)
    assert wait.returncode == 2 and "--batch-wait-ms: must not be negative, got -5" in wait.stderr


def test_bench_says_in_one_line_why_it_cannot_run(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    limit = _bench("--model", "/no/such/model", "--modes", "limit", env=env)  # fails in this process
    assert limit.returncode == 1 and "Traceback" not in limit.stderr, limit.stderr[-2000:]
    assert "diffusiond bench: error: /no/such/model does not exist; give a diffusers folder" in limit.stderr
    daemon = _bench("--model", "/no/such/model", "--modes", "async", env=env)  # fails in the daemon it starts
    assert daemon.returncode == 1, daemon.stderr[-2000:]
    assert "diffusiond bench: error: diffusiond serve exited with 2 before it was ready" in daemon.stderr
    assert "/no/such/model does not exist" in daemon.stderr  # the daemon's own reason, checked before its start


def test_bench_on_a_cuda_device_without_cuda_is_a_clear_error(model_cache: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache)}
    done = _bench("--device", "cuda:0", env=env)
    assert done.returncode == 1 and "--device cuda:0, but no CUDA device is visible" in done.stderr


def test_bench_sweep_reports_each_concurrency_with_its_slo_attainment(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    runs = {}
    for scale in ("1000", "0.001"):  # every request within 1000 x the alone latency; none within 0.001 x
        done = _bench("--modes", "async", "--rounds", "1", "--concurrency", "2", "--sweep", "1,2",
                      "--slo-scale", scale, "--no-flops", "--json", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout)
        runs[scale] = {r["mode"]: r for r in report["runs"]}
        # --no-flops: nothing counted, and the figures that need the count are absent, not zero
        assert report["flops"] is None and "counting FLOPs" not in done.stderr
        assert all(m["tflops"] is None and m["peak_share"] is None for m in report["modes"])
    assert set(runs["1000"]) == {"async", "async@c1"}
    assert (runs["1000"]["async"]["concurrency"], runs["1000"]["async@c1"]["concurrency"]) == (2, 1)
    assert {r["slo_attainment"] for r in runs["1000"].values()} == {1.0}
    assert {r["slo_attainment"] for r in runs["0.001"].values()} == {0.0}
    bad = _bench("--sweep", "1,x", env=env)
    assert bad.returncode == 2 and "expected whole numbers separated by commas, got '1,x'" in bad.stderr


def test_bench_prices_the_state_dir_with_a_memory_only_daemon_in_the_same_rounds(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    done = _bench("--modes", "async,async-memory", "--rounds", "2", "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # the two daemons alternate, so a drift of the machine's speed falls on both alike
    assert [r["mode"] for r in report["runs"]] == ["async", "async-memory", "async-memory", "async"]
    assert all(r["requests"] == 4 and r["throughput"] > 0 for r in report["runs"])


def _independent_tiny_flops(model_cache: Path, steps: int) -> tuple[int, int]:
    """FLOPs of one 64x64 tiny image counted here, module by module, with no code from the bench: the
    text encoder on the prompt and on the negative prompt, the UNet on the CFG batch of 2 at every step,
    the VAE decode of one latent. Attention runs on torch's math path, which the stock counter counts
    as matrix multiplies, so the bench's own formula for CPU attention is checked too.
    Returns (per image, of which in the UNet)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CLIPTextModel

    from diffusiond.pipelines.tiny import ensure_tiny

    folder = ensure_tiny(model_cache)
    text = CLIPTextModel.from_pretrained(folder / "text_encoder")
    unet = UNet2DConditionModel.from_pretrained(folder / "unet")
    vae = AutoencoderKL.from_pretrained(folder / "vae")
    latent = 64 // 2  # tiny's VAE halves each side
    tokens = torch.zeros((1, 77), dtype=torch.long)

    def flops(run: Any) -> int:
        with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as mode:
            run()
        return int(mode.get_total_flops())

    hidden = text(tokens)[0]
    encoder = flops(lambda: text(tokens))
    forward = flops(lambda: unet(torch.randn(2, 4, latent, latent), torch.tensor(999),
                                 encoder_hidden_states=hidden.repeat(2, 1, 1)))
    decode = flops(lambda: vae.decode(torch.randn(1, 4, latent, latent)))
    assert min(encoder, forward, decode) > 0
    return 2 * encoder + steps * forward + decode, steps * forward


def test_bench_reports_tflops_from_flops_per_image_counted_once_per_shape(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"}
    (model_cache / "bench" / "flops.json").unlink(missing_ok=True)  # this run counts, not a cache
    # --guidance 4: a key of this test's own, so no other bench run can have cached it meanwhile
    done = _bench("--modes", "limit,async", "--rounds", "1", "--guidance", "4", "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    flops = report["flops"]
    per_image, in_unet = _independent_tiny_flops(model_cache, steps=2)
    assert flops["cached"] is False and flops["counted_on"] == "cpu, float32, batch 1"
    assert (flops["per_image"], flops["denoiser"], flops["denoiser_forwards"]) == (per_image, in_unet, 2)
    assert flops["peak_tflops"] is None and "no peak for a CPU" in flops["note"]
    for row in report["modes"]:  # achieved TFLOP/s = FLOPs per image x images per second
        assert row["tflops"] == pytest.approx(per_image * row["throughput"] / 1e12, rel=1e-9), row
        assert row["tflops"] > 0 and row["peak_share"] is None, row
    text = table(report)
    assert "| mode | req/s | x limit | TFLOP/s | % peak |" in text
    assert f"TFLOP/s: {per_image / 1e9:.3g} GFLOP per image (denoiser: 2 forwards" in text
    assert "% peak: no peak for a CPU" in text

    again = _bench("--modes", "limit", "--rounds", "1", "--guidance", "4", "--peak-tflops", "0.5", "--json", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads(again.stdout)
    assert second["flops"]["cached"] is True and second["flops"]["per_image"] == per_image
    assert "counting FLOPs" not in again.stderr  # counted once per shape
    (limit,) = second["modes"]
    assert second["flops"]["peak_tflops"] == 0.5 and second["flops"]["peak_from"] == "--peak-tflops"
    assert limit["peak_share"] == pytest.approx(limit["tflops"] / 0.5) and limit["peak_share"] > 0

    # --no-flops is checked by the sweep test's runs


def test_the_peak_is_the_datasheet_figure_of_a_known_gpu_and_none_otherwise() -> None:
    from diffusiond.bench.flops import datasheet_peak as lookup

    assert lookup("NVIDIA H200") == 989.0 and lookup("NVIDIA H100 80GB HBM3") == 989.0
    assert lookup("NVIDIA H100 PCIe") == 756.0 and lookup("NVIDIA H200 NVL") == 835.0
    assert lookup("NVIDIA A100-SXM4-80GB") == 312.0 and lookup("NVIDIA L40S") == 362.0
    assert lookup("NVIDIA GeForce RTX 4090") == 165.2 and lookup("NVIDIA GeForce RTX 3060") is None


# --alternate: two models, requests alternating between them, under a budget against both resident ----------

def _setup(**kw: object) -> Setup:
    return Setup(model="m", device="cuda:0", dtype="float16", width=64, height=64, steps=2, batch=1, requests=4,
                 concurrency=4, format="png", frames=None, output_dtype="uint8", guidance=1.0, arena_mb=256,
                 batch_wait_ms=0.0, **kw)  # type: ignore[arg-type]


def test_alternating_requests_go_to_each_model_in_turn_in_the_order_they_are_sent() -> None:
    s = _setup(models=("a", "b"))
    assert [_body(s, "p", seed)["model"] for seed in range(5)] == ["a", "b", "a", "b", "a"]
    assert "model" not in _body(_setup(), "p", 0), "one model: the daemon's default"


def test_the_alternate_figure_is_the_median_of_each_rounds_budget_over_its_resident_run() -> None:
    from diffusiond.bench.alternate import per_mode as alternate_rows
    from diffusiond.bench.alternate import ratio, table

    runs = [ModeResult(mode, 8, 1.0, tp, 100.0, 200.0, note=f"{moved} model loads", wall_throughput=tp, round=k)
            for mode, tp, k, moved in (("resident", 10.0, 0, 0), ("budget", 9.0, 0, 6), ("budget", 4.0, 1, 5),
                                       ("resident", 5.0, 1, 0), ("resident", 8.0, 2, 0), ("budget", 8.0, 2, 7))]
    assert ratio(runs) == 0.9  # 0.9, 0.8, 1.0
    assert ratio(runs[:1]) is None
    rows = {r["mode"]: r for r in alternate_rows(runs)}
    assert rows["budget"]["throughput"] == 8.0 and rows["budget"]["loads"] == ["6 model loads", "5 model loads",
                                                                                  "7 model loads"]
    report = {"setup": asdict(_setup(rounds=3)), "machine": "m", "date": "d", "ratio": ratio(runs),
              "alternate": {"a": "A", "b": "B", "device_memory": "12GiB", "max_model_wait": None},
              "modes": alternate_rows(runs), "runs": [asdict(r) for r in runs]}
    text = table(report)
    assert "budget: --device-memory 12GiB" in text and "0.900 (target >= 0.85)" in text
    assert "moved no model" not in text and "measured on the CPU" not in text
    runs[1].note = "0 model loads"
    report["runs"] = [asdict(r) for r in runs]
    assert "warning: a budget run moved no model: the budget held both" in table(report)


def test_alternate_says_what_it_needs_and_what_does_not_apply(model_cache: Path) -> None:
    env = {**os.environ, "DIFFUSIOND_CACHE": str(model_cache)}
    bare = _bench("--alternate", "tiny", "tiny", env=env)
    assert bare.returncode == 2 and "--alternate needs --device-memory SIZE" in bare.stderr, bare.stderr
    modes = _bench("--alternate", "tiny", "tiny", "--device-memory", "10MB", "--modes", "async", env=env)
    assert modes.returncode == 2 and "--modes does not apply to --alternate" in modes.stderr, modes.stderr
    peak = _bench("--alternate", "tiny", "tiny", "--device-memory", "10MB", "--peak-tflops", "100", env=env)
    assert peak.returncode == 2 and "--peak-tflops does not apply to --alternate" in peak.stderr, peak.stderr
