"""Compile options (``compile_backend``, ``compile_shapes``, ``fuse_qkv``, ``channels_last``, ``compile_encoders``)
written in a model spec reach the compiled pipeline the worker builds, as the same options in a ``[[models]]`` table do:
the engine holds ``--warmup`` to the spec's ``compile_shapes`` at start, so the worker must use it too."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from workerkit import Driver, config

from diffusiond.daemon.config import ConfigError, build_config
from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.base import PipelineError
from diffusiond.pipelines.compile import CompiledPipeline, compilations, fuse_qkv, guidance_is_shape
from diffusiond.worker.process import Worker, _Progress

EAGER = {"compile_backend": "eager"}
FLUX = m.BatchParams(width=64, height=64, steps=2, guidance=3.5)


@pytest.fixture(autouse=True)
def _cache(model_cache: Path) -> None:
    """tiny is built once for the session."""


def load(cfg: m.WorkerConfig) -> object:
    """The worker's own load and compile, its load progress going nowhere."""
    return Worker._load(cfg, _Progress(lambda _p: None, 0))


def run(pipe: object, params: m.BatchParams) -> torch.Tensor:
    with torch.inference_mode():
        return pipe.run(params, [m.RequestSpec(request_id="r", prompt="a red fox", seed=1)],  # type: ignore[attr-defined]
                        lambda _s, _t: True)[0]


def fused(pipe: object) -> bool:
    unet = pipe.inner.pipe.unet  # type: ignore[attr-defined]
    return any(getattr(mod, "fused_projections", False) for mod in unet.modules())


def test_compile_options_in_the_spec_reach_the_compiled_pipeline() -> None:
    pipe = load(config("tiny,compile_backend=eager,fuse_qkv=1,compile_shapes=3", compile="default"))
    assert (pipe.backend, pipe.max_shapes) == ("eager", 3)  # type: ignore[attr-defined]
    assert fused(pipe)


def test_compile_encoders_0_leaves_the_text_encoder_eager_and_compiles_the_rest() -> None:
    """A cold start pays for every module compiled; an encoder that runs once an image may not be worth it."""
    pipe = load(config("tiny,compile_backend=eager,compile_encoders=0", compile="default"))
    assert "text_encoder" not in pipe.compiled and {"unet", "vae.decoder"} <= set(pipe.compiled)  # type: ignore[attr-defined]
    assert isinstance(run(pipe, m.BatchParams(width=64, height=64, steps=2, guidance=5.0)), torch.Tensor)


@pytest.mark.parametrize(("asked", "compiled"), [("", False), ("1", True), ("0", False)])
def test_beside_a_regionally_compiled_transformer_the_encoders_stay_eager_unless_asked(asked: str,
                                                                                       compiled: bool) -> None:
    """Each start (and each load on demand) pays for compiling T5 and CLIP, for forwards that run once an image."""
    options = {**EAGER, **({"compile_encoders": asked} if asked else {})}
    flux = CompiledPipeline(load_pipeline("tiny-flux", device="cpu", dtype="float32"), "default", options)
    assert any(c.startswith("transformer (regional") for c in flux.compiled)
    assert ({"text_encoder", "text_encoder_2"} <= set(flux.compiled)) is compiled
    assert "vae.decoder" in flux.compiled


def test_the_table_options_win_over_the_spec_s() -> None:
    pipe = load(config("tiny,compile_backend=inductor,compile_shapes=3", compile="default",
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


@pytest.mark.parametrize(("values", "words"), [
    ({"warmup": "60x64:1"}, ["--warmup 60x64:1", "multiples of 8"]),
    ({"warmup": "64x64:3", "compile": "default"}, ["--warmup 64x64:3", "never form", "1, 2, 4", "--batch-sizes"]),
])  # fmt: skip
def test_a_warmup_shape_no_request_can_have_is_refused_at_start(values: dict[str, object], words: list[str]) -> None:
    """Before any load: a size no request may ask for fails the warm-up after the model loads (FLUX: 30 s
    and more), and a batch that never forms costs a compile and a compile_shapes slot for nothing."""
    with pytest.raises(ConfigError) as exc:
        build_config({}, {"model": ["tiny"], **values})
    assert all(w in str(exc.value) for w in words), str(exc.value)
    assert build_config({}, {"model": ["tiny"], "warmup": "64x64:3"}).models[0].warmup == ((64, 64, 3),)  # eager: forms


async def test_a_warmup_size_off_the_model_s_own_step_stops_the_worker_naming_the_flag() -> None:
    """tiny-flux makes sizes in multiples of 16: 72x72 passes the engine's multiple of 8, not the model's."""
    with pytest.raises(Exception, match=r"--warmup 72x72:1: model 'tiny-flux' makes sizes in multiples of 16"):
        async with Driver(config("tiny-flux", warmup=[m.WarmupShape(72, 72, 1)]), start_timeout=300):
            pass


def test_fuse_qkv_on_flux_fuses_the_transformer_and_the_vae_and_keeps_the_image() -> None:
    """FluxPipeline has no fuse_qkv_projections in diffusers 0.42 (issue 31): fuse_qkv=1 fuses through the
    transformer and the VAE. The separate projections are gone after the fusion (they were never read again, so a
    LoRA or a weight update naming them did nothing), and the image equals the unfused one."""
    reference = run(load_pipeline("tiny-flux", device="cpu", dtype="float32"), FLUX)
    pipe = load(config("tiny-flux,compile_backend=eager,fuse_qkv=1", compile="default"))
    flux = pipe.inner.pipe  # type: ignore[attr-defined]
    names = [n for module in (flux.transformer, flux.vae) for n, _ in module.named_modules()]
    assert {"transformer_blocks.0.attn.to_qkv", "transformer_blocks.0.attn.to_added_qkv",
            "single_transformer_blocks.0.attn.to_qkv", "decoder.mid_block.attentions.0.to_qkv"} <= set(names)
    separate = {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}
    assert not [n for n in names if n.rsplit(".", 1)[-1] in separate], "the fused projections' copies are gone"
    torch.testing.assert_close(run(pipe, FLUX), reference, atol=1e-4, rtol=0)


def test_a_model_whose_attention_would_not_read_fused_projections_is_refused_by_name() -> None:
    """LTX's attention processor reads only the separate projections: fusing would hold them twice for nothing."""
    video = load_pipeline("tiny-video", device="cpu", dtype="float32")
    with pytest.raises(PipelineError, match=r"fuse_qkv=1: LTXPipeline's transformer cannot fuse its QKV projections: "
                                            r"its attention processor \w+ does not read fused projections"):
        fuse_qkv(video.pipe)  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_compile_encoders_value_other_than_0_or_1_is_refused_at_start_by_its_value(value: str) -> None:
    """``compile_encoders=yes`` read as unset would compile (or not) against what was asked, and say nothing."""
    with pytest.raises(ConfigError) as exc:
        build_config({}, {"model": [f"tiny,compile_encoders={value}"], "compile": "default"})
    assert f"compile_encoders={value!r}" in str(exc.value) and "give 1" in str(exc.value), str(exc.value)
