"""A pipeline with two denoisers (Wan 2.2 A14B: ``transformer`` for the high-noise steps, ``transformer_2`` for the
low-noise ones) gets ``--compile``, ``attention`` and ``cache`` on both (issue 31): given to the first
alone, half of every job's steps ran eager, on the default kernel or uncached while the model's fields said otherwise.

A tiny two-expert WanPipeline folder is built from tests/wankit.py's modules and loaded through the real loading path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from wankit import Z, _scheduler, _text, _transformer, _vae

from diffusiond.ipc import messages as m
from diffusiond.pipelines.compile import CompiledPipeline, compilations
from diffusiond.pipelines.gen_tokenizers import t5_tokenizer
from diffusiond.pipelines.registry import load_pipeline

PARAMS = m.BatchParams(width=32, height=32, steps=2, guidance=1.0, num_frames=5)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import WanPipeline

    out = tmp_path_factory.mktemp("wan-a14b")
    tokenizer = t5_tokenizer(1024, extra_ids=0, max_length=64)
    with torch.random.fork_rng(devices=[]):
        first = _transformer(Z, Z)
        torch.manual_seed(1)  # the second expert's own weights
        second = _transformer(Z, Z)
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=_text(tokenizer), scheduler=_scheduler(),
                           transformer=first, transformer_2=second, vae=_vae(False), boundary_ratio=0.5)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def run(pipe: Any) -> torch.Tensor:
    reqs = [m.RequestSpec(request_id="a", prompt="a boat", seed=1)]
    with torch.inference_mode():
        return torch.stack(pipe.run(PARAMS, reqs, lambda _s, _t: True))


def test_both_experts_are_compiled_and_run_compiled(a14b: Path) -> None:
    eager = load_pipeline(str(a14b), device="cpu", dtype="float32")
    assert eager.pipe.transformer_2 is not None  # type: ignore[attr-defined]
    want = run(eager)
    pipe = CompiledPipeline(load_pipeline(str(a14b), device="cpu", dtype="float32"), "default",
                            {"compile_backend": "eager"})
    assert [c.split(" ")[0] for c in pipe.compiled][:2] == ["transformer", "transformer_2"]
    second = pipe.inner.pipe.transformer_2  # type: ignore[attr-defined]
    assert all(b._compiled_call_impl is not None for b in second.blocks)  # regionally, as the first
    before = compilations()
    got = run(pipe)
    assert compilations() > before
    assert torch.equal(got, want)  # the eager backend: the same kernels, the same output


def test_attention_and_cache_reach_the_second_expert(a14b: Path) -> None:
    pipe: Any = load_pipeline(str(a14b), device="cpu", dtype="float32",
                              options={"attention": "_native_math", "cache": "taylorseer:2"})
    for denoiser in (pipe.pipe.transformer, pipe.pipe.transformer_2):
        backends = {mod.processor._attention_backend for mod in denoiser.modules()
                    if hasattr(getattr(mod, "processor", None), "_attention_backend")}
        assert backends == {"_native_math"}
        assert denoiser.is_cache_enabled
    assert pipe.capabilities.attention == "_native_math"
    assert run(pipe).isfinite().all()  # both cached experts run a job
