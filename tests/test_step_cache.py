"""The step caches (``cache=fbc|taylorseer``, pipelines/speedups.py) across a failed forward, and their
place among the options ``--compile`` refuses.

A cache hook keeps state between the denoiser's calls of one generation; diffusers resets it at the
end of a pipeline call, which a forward that raises (an out-of-memory in the denoise loop or the VAE
decode, a preview that fails) never reaches. The worker then retries the batch in halves, or runs
the next one, on the failed batch's state. The failure here is injected as the worker's step
callback raising mid-loop, which is how an error inside the forward reaches the pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusiond.daemon.config import ConfigError, build_config
from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.base import PipelineError
from diffusiond.pipelines.compile import CompiledPipeline

PARAMS = m.BatchParams(width=64, height=64, steps=4, guidance=3.5)


@pytest.fixture(autouse=True)
def _cache(model_cache: Path) -> None:
    """tiny-flux is built once for the session."""


def run(pipe: object, seeds: list[int], fail_at: int = 0) -> torch.Tensor:
    def on_step(step: int, _total: int) -> bool:
        if step == fail_at:
            raise RuntimeError("injected: out of memory in the denoise loop")
        return True

    reqs = [m.RequestSpec(request_id=str(s), prompt=f"a red fox {s}", seed=s) for s in seeds]
    with torch.inference_mode():
        return torch.stack(pipe.run(PARAMS, reqs, on_step))  # type: ignore[attr-defined]


@pytest.mark.parametrize("cache", ["taylorseer:2", "taylorseer-lite:2"])
def test_a_failed_batch_leaves_no_cache_state_behind(cache: str) -> None:
    """The batch after a failed one (here: its own retry at half the size) gives the output a fresh
    model gives, not one computed from the failed batch's cached features."""
    pipe = load_pipeline("tiny-flux", device="cpu", dtype="float32", options={"cache": cache})
    fresh = run(pipe, [7])
    with pytest.raises(RuntimeError, match="injected"):
        run(pipe, [7, 8], fail_at=2)
    assert torch.equal(run(pipe, [7]), fresh)


@pytest.mark.parametrize(("options", "words"), [
    ({"cache": "fbc:0.2"}, ["--compile with cache=fbc:0.2", "drop cache="]),
    ({"quant": "unet:fp8-storage"}, ["--compile with quant=unet:fp8-storage", "drop --compile"]),
])  # fmt: skip
def test_compile_refuses_a_step_cache_and_fp8_storage_at_start(options: dict[str, str], words: list[str]) -> None:
    """At start, in the spec or in the model's table, before a worker loads anything."""
    spec = "t=tiny," + ",".join(f"{k}={v}" for k, v in options.items())
    with pytest.raises(ConfigError) as exc:
        build_config({}, {"model": [spec], "compile": "default"})
    assert all(w in str(exc.value) for w in words), str(exc.value)
    table = {"models": [{"name": "t", "spec": "tiny", "compile": "default", "options": options}]}
    with pytest.raises(ConfigError, match="--compile with"):
        build_config(table, {})


def test_the_compiled_pipeline_refuses_a_step_cache_itself() -> None:
    """The bench's ``limit-compiled`` and other in-process callers build it without the engine."""
    pipe = load_pipeline("tiny-flux", device="cpu", dtype="float32", options={"cache": "fbc"})
    with pytest.raises(PipelineError, match="--compile with cache=fbc is refused"):
        CompiledPipeline(pipe, "default", {"cache": "fbc", "compile_backend": "eager"})


def test_compile_leaves_a_text_encoder_stored_in_fp8_eager_and_compiles_the_rest() -> None:
    """A 24 GiB card holds FLUX.1-dev compiled in fp8 only beside T5 in fp8 storage (issue 28): its casting hooks
    cannot be compiled, so the encoder, run once an image, runs eager while the denoiser compiles, and the
    picture is the uncompiled model's. Even where the encoders are asked to compile (``compile_encoders=1``; beside
    a transformer they stay eager by default)."""
    options = {"quant": "text_encoder_2:fp8-storage"}
    build_config({}, {"model": ["t=tiny-flux,quant=text_encoder_2:fp8-storage"], "compile": "default"})  # admitted
    pipe = load_pipeline("tiny-flux", device="cpu", dtype="float32", options=options)
    want = run(pipe, [7])
    compiled = CompiledPipeline(pipe, "default", {**options, "compile_backend": "eager", "compile_encoders": "1"})
    assert "text_encoder_2" not in compiled.compiled and "text_encoder" in compiled.compiled
    assert any(name.startswith("transformer") for name in compiled.compiled)
    assert torch.allclose(run(compiled, [7]), want, atol=1e-5, rtol=0)


def test_taylorseer_lite_skips_the_blocks_between_full_steps_and_says_so() -> None:
    """What the lite mode is for (issue 31's >= 2.5x with a step cache): the full mode predicts attention only,
    so each block's feed-forward still runs at every step; the lite mode runs it only on the full steps (the
    first three, then every INTERVAL-th), and the output names the approximation."""
    params = m.BatchParams(width=64, height=64, steps=16, guidance=3.5)
    ran = {}
    for cache in ("taylorseer:4", "taylorseer-lite:4"):
        pipe = load_pipeline("tiny-flux", device="cpu", dtype="float32", options={"cache": cache})
        count = [0]
        for name, module in pipe._pipe.transformer.named_modules():  # type: ignore[attr-defined]
            if name.endswith(".ff"):
                module.register_forward_pre_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        reqs = [m.RequestSpec(request_id="1", prompt="a red fox", seed=7)]
        with torch.inference_mode():
            pipe.run(params, reqs, lambda step, total: True)  # type: ignore[attr-defined]
        ran[cache] = count[0]
        named = pipe.capabilities.approximations[0]
        assert named.startswith("taylorseer-cache(interval=4") and ("lite" in named) == ("lite" in cache), named
    feed_forwards = ran["taylorseer:4"] // 16  # per step
    assert ran["taylorseer:4"] == 16 * feed_forwards > 0
    full_steps = 3 + -(-(16 - 3) // 4)  # diffusers' default: the first 3 steps, then at most every 4th
    assert 0 < ran["taylorseer-lite:4"] <= full_steps * feed_forwards


def test_taylorseer_lite_is_refused_where_an_output_head_would_run_on_the_skipped_blocks_zeros() -> None:
    """LTX-2's transformer has an audio head beside proj_out; the lite mode predicts only proj_out,
    so its sound would come from zeros at every predicted step. Refused at load, with what to use instead; the
    models it fits load (tiny-flux above)."""
    from accelerate import init_empty_weights
    from diffusers import LTX2VideoTransformer3DModel

    from diffusiond.pipelines.speedups import apply_speedups

    with init_empty_weights():
        ltx2 = LTX2VideoTransformer3DModel()

    pipe = type("Pipe", (), {"transformer": ltx2, "components": {"transformer": ltx2}})()
    with pytest.raises(PipelineError) as exc:
        apply_speedups(pipe, {"cache": "taylorseer-lite"}, torch.device("cpu"))
    assert "audio_proj_out" in str(exc.value) and "use cache=taylorseer" in str(exc.value), str(exc.value)
    assert not ltx2.is_cache_enabled  # refused before any hook


@pytest.mark.parametrize("cache", ["taylorseer:2", "taylorseer-lite:2", "fbc:0.2"])
def test_a_cached_flux_model_edits_images(cache: str) -> None:
    """FluxImg2ImgPipeline and FluxInpaintPipeline set no cache context, which diffusers' cache hooks
    require, so every edit job on a cached FLUX model failed as if the request were at fault."""
    import numpy as np

    pipe = load_pipeline("tiny-flux", device="cpu", dtype="float32", options={"cache": cache})
    params = m.BatchParams(width=64, height=64, steps=4, guidance=3.5, edit="image-to-image", strength=0.8)
    reqs = [m.RequestSpec(request_id="e", prompt="a red barn", seed=3)]
    inputs = [(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8), None)]
    with torch.inference_mode():
        (out,) = pipe.edit(params, reqs, inputs, lambda _s, _t: True)  # type: ignore[attr-defined]
    assert out.isfinite().all()
    assert torch.equal(run(pipe, [7]), run(pipe, [7]))  # and the text-to-image path after it, as before


@pytest.fixture(scope="module")
def tiny_chroma(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """A ChromaPipeline folder on tiny-flux's T5, VAE and scheduler: a pipeline that sets no cache context and runs
    its classifier-free guidance as two denoiser calls a step."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FluxPipeline

    from diffusiond.pipelines.tiny_flux import ensure_tiny_flux

    flux = FluxPipeline.from_pretrained(str(ensure_tiny_flux()))
    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
        approximator_layers=1)
    out = tmp_path_factory.mktemp("chroma") / "tiny-chroma"
    chroma = ChromaPipeline(scheduler=flux.scheduler, vae=flux.vae, text_encoder=flux.text_encoder_2,
                            tokenizer=flux.tokenizer_2, transformer=transformer)
    chroma.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.mark.parametrize("cache", ["taylorseer:2", "taylorseer-lite:2", "fbc:0.2"])
def test_a_step_cache_is_refused_at_load_where_cfg_passes_would_share_its_state(tiny_chroma: Path, cache: str) -> None:
    """ChromaPipeline (and Kandinsky 5) set no cache context and call the denoiser twice a step for
    CFG; one context around the call made both passes share one cache state (silently wrong images). Refused at
    load, naming the class and what to do; the same folder loads without cache=."""
    with pytest.raises(PipelineError) as exc:
        load_pipeline(str(tiny_chroma), device="cpu", dtype="float32", options={"cache": cache})
    said = str(exc.value)
    assert f"cache={cache}:" in said and "ChromaPipeline" in said and "without cache=" in said, said
    pipe = load_pipeline(str(tiny_chroma), device="cpu", dtype="float32")
    assert pipe.capabilities.approximations == ()


def test_a_sibling_that_cannot_run_the_cache_is_refused_before_it_runs(tiny_chroma: Path) -> None:
    """Edit siblings are not checked at load (only the model's own class is): a cached denoiser under a class that
    sets no context and is not known to call it once a step is refused at the call, not run in one state."""
    from diffusers import TaylorSeerCacheConfig

    from diffusiond.pipelines.speedups import step_cache_context

    pipe = load_pipeline(str(tiny_chroma), device="cpu", dtype="float32")._pipe  # type: ignore[attr-defined]
    pipe.transformer.enable_cache(TaylorSeerCacheConfig(cache_interval=2))
    with pytest.raises(PipelineError, match=r"ChromaPipeline .*without cache="), step_cache_context(pipe):
        pass


def test_which_pipeline_classes_run_a_step_cache_and_how(monkeypatch: pytest.MonkeyPatch) -> None:
    """The classes the daemon serves with cache=: their own contexts, one around the call (declared to call the
    denoiser once a step as the daemon calls them), or refused. A FLUX edit class would make a second call under
    true CFG, so it is refused once the daemon passes it true_cfg_scale."""
    import diffusers

    from diffusiond.pipelines import call_defaults, speedups

    def plan(name: str) -> str:
        return speedups._context_plan(getattr(diffusers, name))

    assert {plan(n) for n in ("FluxPipeline", "QwenImagePipeline", "WanPipeline", "LTXPipeline")} == {"own"}
    assert {plan(n) for n in speedups.ONE_CALL_A_STEP} == {"one"}
    assert "not known to call its denoiser once a step" in plan("Kandinsky5T2IPipeline")
    # true CFG off by default, as the daemon calls it: one call a step, served as before;
    # the Skyreels sibling's defaults to 6 with the negative prompt the daemon always passes: two, refused
    assert plan("HunyuanVideoImageToVideoPipeline") == "one"
    assert "not known to call its denoiser once a step" in plan("HunyuanSkyreelsImageToVideoPipeline")
    monkeypatch.setattr(call_defaults, "TRUE_CFG", ("QwenImage", "Flux"))
    monkeypatch.setattr(speedups, "_PLANS", {})
    assert "twice a step where true_cfg_scale > 1" in plan("FluxImg2ImgPipeline")
    monkeypatch.setattr(call_defaults, "TRUE_CFG", ("QwenImage", "HunyuanVideo"))
    monkeypatch.setattr(speedups, "_PLANS", {})
    assert "twice a step where true_cfg_scale > 1" in plan("HunyuanVideoImageToVideoPipeline")
