"""``diffusiond bench``'s FLOP count (issue 31) is a property of the shapes, not of the attention kernel.

torch's FLOP counter has formulas for SDPA's kernels only: a count made on another backend (the
model's ``attention=`` option) would leave attention out, or, on eager FlexAttention, fail. These
tests check the count of one tiny-flux step against the arithmetic of its shapes, and that a model
served with a non-default backend reports the same FLOPs as the default one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SIZE, STEPS = 64, 1


@pytest.fixture(scope="module")
def flux(model_cache: Path) -> Any:
    from diffusiond.pipelines.registry import load_pipeline

    return load_pipeline("tiny-flux", device="cpu", dtype="float32")


def _params(pipeline: Any) -> Any:
    from diffusiond.ipc.messages import BatchParams

    return BatchParams(width=SIZE, height=SIZE, steps=STEPS, guidance=pipeline.capabilities.guidance)


def _analytic_step(pipeline: Any) -> int:
    """One transformer forward's FLOPs from its shapes alone: 2·M·K·N for every linear layer called (the
    shapes recorded by hooks on a run with no counter) and 4·B·H·S·S·D for each block's joint attention
    over the image tokens (the latent packed 2x2) and the T5 tokens; guidance-distilled, so B = 1."""
    import torch

    from diffusiond.pipelines.tiny_flux import T5_TOKENS, TRANSFORMER

    transformer = pipeline.pipe.transformer
    linear = [0]

    def hook(module: torch.nn.Linear, args: tuple[torch.Tensor, ...], _out: Any) -> None:
        linear[0] += 2 * args[0].numel() * module.out_features

    hooks = [m.register_forward_hook(hook) for m in transformer.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.inference_mode():
            pipeline.run(_params(pipeline), _request(), lambda _s, _t: True)
    finally:
        for h in hooks:
            h.remove()
    tokens = (SIZE // pipeline.pipe.vae_scale_factor // 2) ** 2 + T5_TOKENS
    heads, dim = TRANSFORMER["num_attention_heads"], TRANSFORMER["attention_head_dim"]
    blocks = TRANSFORMER["num_layers"] + TRANSFORMER["num_single_layers"]
    return linear[0] // STEPS + blocks * 4 * heads * tokens * tokens * dim


def _request() -> list[Any]:
    from diffusiond.ipc.messages import RequestSpec

    return [RequestSpec(request_id="r", prompt="a cat", seed=0)]


def test_a_step_counts_its_matmuls_and_attention_on_any_attention_backend(flux: Any) -> None:
    from diffusiond.bench.flops import count
    from diffusiond.pipelines.attention import apply_attention

    default = count(flux, _params(flux), "a cat")
    assert default.denoiser_forwards == STEPS
    assert default.denoiser / STEPS == pytest.approx(_analytic_step(flux), rel=1e-6)
    transformer = flux.pipe.transformer
    for name in ("flex", "_native_math"):  # flex fails under the counter; math runs as matrix multiplies
        apply_attention(flux.pipe, name, flux.device)
        try:
            assert count(flux, _params(flux), "a cat") == default, name
            processors = [getattr(m, "processor", None) for m in transformer.modules()]
            backends = {p._attention_backend for p in processors if hasattr(p, "_attention_backend")}
            assert {str(getattr(b, "value", b)) for b in backends} == {name}  # put back after the count
        finally:
            transformer.reset_attention_backend()


def test_bench_of_a_model_on_flex_attention_reports_the_default_models_flops(flux: Any, tmp_path: Path) -> None:
    from diffusiond.bench.flops import count

    # a fresh cache: a count an earlier run left in <cache>/bench/flops.json would be served without counting
    env = {**os.environ, "DIFFUSIOND_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "diffusiond", "bench", "--model", "tiny-flux,attention=flex", "--size",
            f"{SIZE}x{SIZE}", "--steps", str(STEPS), "--batch", "1", "--requests", "1", "--device", "cpu",
            "--modes", "limit", "--rounds", "1", "--guidance", str(flux.capabilities.guidance), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    default = count(flux, _params(flux), "a cat")
    assert report["flops"]["cached"] is False, report["flops"]  # counted under flex attention, not read back
    assert report["flops"]["per_image"] == default.per_image > 0, report["flops"]
    assert report["flops"]["denoiser"] == default.denoiser
    assert report["modes"][0]["tflops"] > 0
