"""Compile options (``compile_backend``, ``compile_shapes``, ``fuse_qkv``, ``channels_last``) written in a
model spec reach the compiled pipeline the worker builds, as the same options in a ``[[models]]`` table do:
the engine holds ``--warmup`` to the spec's ``compile_shapes`` at start, so the worker must use it too."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from workerkit import config

from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.compile import CompiledPipeline, compilations, guidance_is_shape
from diffusiond.worker.process import Worker

EAGER = {"compile_backend": "eager"}
FLUX = m.BatchParams(width=64, height=64, steps=2, guidance=3.5)


@pytest.fixture(autouse=True)
def _cache(model_cache: Path) -> None:
    """tiny is built once for the session."""


def run(pipe: CompiledPipeline, params: m.BatchParams) -> None:
    with torch.inference_mode():
        pipe.run(params, [m.RequestSpec(request_id="r", prompt="a red fox", seed=1)], lambda _s, _t: True)


def fused(pipe: object) -> bool:
    unet = pipe.inner.pipe.unet  # type: ignore[attr-defined]
    return any(getattr(mod, "fused_projections", False) for mod in unet.modules())


def test_compile_options_in_the_spec_reach_the_compiled_pipeline() -> None:
    pipe = Worker._load(config("tiny,compile_backend=eager,fuse_qkv=1,compile_shapes=3", compile="default"))
    assert (pipe.backend, pipe.max_shapes) == ("eager", 3)  # type: ignore[attr-defined]
    assert fused(pipe)


def test_the_table_options_win_over_the_spec_s() -> None:
    pipe = Worker._load(config("tiny,compile_backend=inductor,compile_shapes=3", compile="default",
                               options={"compile_backend": "eager", "compile_shapes": "5"}))
    assert (pipe.backend, pipe.max_shapes) == ("eager", 5)  # type: ignore[attr-defined]
    assert not fused(pipe)


def test_guidance_on_a_guidance_distilled_model_is_no_new_shape() -> None:
    """FLUX takes guidance as a tensor of unchanged shape: a job at guidance 1 after one at 3.5 compiles
    nothing, so it must not be announced as ``compiling`` (nor spend a compile_shapes slot). On a CFG
    model (tiny, SD-like) guidance 1 halves the denoiser's batch: another shape."""
    flux = CompiledPipeline(load_pipeline("tiny-flux", device="cpu", dtype="float32"), "default", EAGER)
    run(flux, FLUX)
    before = compilations()
    assert not flux.will_compile(msgspec.structs.replace(FLUX, guidance=1.0), 1)
    run(flux, msgspec.structs.replace(FLUX, guidance=1.0))
    assert compilations() == before
    assert guidance_is_shape(load_pipeline("tiny", device="cpu", dtype="float32").pipe)  # type: ignore[attr-defined]
