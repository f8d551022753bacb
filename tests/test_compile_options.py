"""Compile options (``compile_backend``, ``compile_shapes``, ``fuse_qkv``, ``channels_last``) written in a
model spec reach the compiled pipeline the worker builds, as the same options in a ``[[models]]`` table do:
the engine holds ``--warmup`` to the spec's ``compile_shapes`` at start, so the worker must use it too."""

from __future__ import annotations

from pathlib import Path

import pytest
from workerkit import config

from diffusiond.worker.process import Worker


@pytest.fixture(autouse=True)
def _cache(model_cache: Path) -> None:
    """tiny is built once for the session."""


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
