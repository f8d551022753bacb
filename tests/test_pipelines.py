"""Pipelines: the embedded tiny model, the diffusers adapter, the registry's spec resolution, synthetic.

Everything runs on CPU with real diffusers code and no network: tiny is built once per session
into a temporary cache (the ``model_cache`` fixture) and loaded back through the local-folder path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from diffusiond import protocol
from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec
from diffusiond.pipelines import Interrupted, Pipeline, PipelineError, Task, load_pipeline
from diffusiond.pipelines.base import generators
from diffusiond.pipelines.diffusers_pipeline import SCHEDULERS, DiffusersPipeline, task_for_class
from diffusiond.pipelines.synthetic import SyntheticPipeline
from diffusiond.pipelines.tiny import TINY_VERSION, ensure_tiny

P64 = BatchParams(width=64, height=64, steps=2, guidance=5.0)


def req(seed: int, prompt: str = "a red fox in the snow", negative: str | None = None) -> RequestSpec:
    return RequestSpec(request_id=f"r{seed}-{prompt[:8]}", prompt=prompt, seed=seed, negative_prompt=negative)


def always(_step: int, _total: int) -> bool:
    return True


def to_u8(x: torch.Tensor) -> torch.Tensor:
    """The worker's conversion; comparisons happen on what a client would receive."""
    return (x * 255).round().clamp(0, 255).to(torch.uint8)


def run(pipe: Pipeline, requests: Sequence[RequestSpec], params: BatchParams = P64) -> list[torch.Tensor]:
    return pipe.run(params, requests, always)


@pytest.fixture(scope="session")
def tiny(model_cache: Path) -> DiffusersPipeline:
    pipe = load_pipeline("tiny")
    assert isinstance(pipe, DiffusersPipeline)
    return pipe


@pytest.fixture(scope="session")
def tiny_components(tiny: DiffusersPipeline) -> dict[str, object]:
    return dict(tiny.pipe.components)


# --- tiny ---------------------------------------------------------------------------------------


def test_tiny_is_built_once_as_safetensors_in_the_cache(tiny: DiffusersPipeline, model_cache: Path) -> None:
    folder = ensure_tiny(model_cache)
    assert folder == model_cache / "models" / TINY_VERSION
    assert (folder / "model_index.json").is_file()
    weights = [p.name for p in folder.rglob("*") if p.suffix in {".safetensors", ".bin", ".ckpt", ".pt"}]
    assert weights and all(w.endswith(".safetensors") for w in weights)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "build leftovers in the cache"
    assert isinstance(tiny, Pipeline)
    assert (tiny.name, tiny.task, tiny.dtype) == ("tiny", Task.TEXT_TO_IMAGE, torch.float32)
    assert tiny.device == torch.device("cpu")
    # Declared at construction: the tiny model's quick defaults over what the adapter infers.
    assert tiny.capabilities == Capabilities(
        task="text-to-image", width=128, height=128, steps=4, guidance=5.0, flow_scheduler=False,
        edits=("image-to-image", "inpainting"), previews=True,  # an SD 1.5 layout: the SD 1.5 factors
    )


def test_tiny_build_that_loses_the_rename_race_uses_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusiond.pipelines.tiny as tiny_module

    final = tmp_path / "models" / TINY_VERSION

    def build_while_another_process_wins(out: Path) -> None:
        (out / "model_index.json").write_text("{}")  # our (losing) build
        final.mkdir(parents=True)
        (final / "model_index.json").write_text('{"winner": true}')
        (final / "unet").mkdir()

    monkeypatch.setattr(tiny_module, "_build", build_while_another_process_wins)
    assert ensure_tiny(tmp_path) == final
    assert (final / "model_index.json").read_text() == '{"winner": true}'
    assert sorted(p.name for p in final.parent.iterdir()) == [TINY_VERSION], "the losing build was not removed"


def test_tiny_batch_of_two(tiny: DiffusersPipeline) -> None:
    out = run(tiny, [req(1), req(2, "a lighthouse, oil painting")])
    assert len(out) == 2
    for image in out:
        assert image.shape == (3, 64, 64)
        assert image.dtype == torch.float32 and image.device == tiny.device
        assert 0.0 <= image.min().item() <= image.max().item() <= 1.0
        assert image.std().item() > 0.02, "output is flat; the model should give varied noise"
    assert not torch.equal(to_u8(out[0]), to_u8(out[1]))


def test_any_prompt_tokenizes(tiny: DiffusersPipeline) -> None:
    prompts = ["", "ünïcödé 日本語 🐱 <|endoftext|> \t\n", "x" * 500]
    out = run(tiny, [req(i, p) for i, p in enumerate(prompts)])
    assert [o.shape for o in out] == [(3, 64, 64)] * 3


def test_same_request_twice_is_bit_identical(tiny: DiffusersPipeline) -> None:
    assert torch.equal(run(tiny, [req(7)])[0], run(tiny, [req(7)])[0])


def test_different_seeds_differ(tiny: DiffusersPipeline) -> None:
    a, b = run(tiny, [req(1)])[0], run(tiny, [req(2)])[0]
    assert (to_u8(a) != to_u8(b)).float().mean().item() > 0.5


def test_same_seed_same_noise_alone_or_in_a_batch() -> None:
    """What the per-request generators guarantee exactly: the starting latents."""
    from diffusers.utils.torch_utils import randn_tensor

    batch = [req(100, "x"), req(42), req(200, "y")]
    alone = randn_tensor((1, 4, 32, 32), generator=generators([req(42)]), dtype=torch.float32)
    batched = randn_tensor((3, 4, 32, 32), generator=generators(batch), dtype=torch.float32)
    assert torch.equal(alone[0], batched[1])


@pytest.mark.parametrize("scheduler", [None, "ddim"])
def test_same_seed_same_image_alone_or_in_a_batch(tiny: DiffusersPipeline, scheduler: str | None) -> None:
    """Equal up to float rounding, not bit for bit, and this is measured, not assumed.

    The noise is identical (test above), but CPU kernels pick different code paths for different
    batch sizes: MKL runs a 1-row Linear (the time embedding of a batch of 1) as GEMV and larger
    ones as GEMM, and oneDNN picks a different convolution algorithm per batch size (the VAE's
    1x1 post_quant_conv differs first). Each sums in another order, so floats differ by ~1e-6
    (1e-5 with DDIM) and a value sitting on a rounding boundary lands one uint8 step away.
    Measured on tiny: about 3 in 150k values (euler), 40 in 150k (ddim), never more than 1 step.
    GPUs behave alike (cuBLAS/cuDNN heuristics depend on shapes); bitwise equality would need
    batch-invariant kernels.
    """
    params = BatchParams(width=64, height=64, steps=2, guidance=5.0, scheduler=scheduler)
    alone = to_u8(run(tiny, [req(42)], params)[0]).int()
    batched = to_u8(run(tiny, [req(100, "x"), req(42), req(200, "y")], params)[1]).int()
    diff = (alone - batched).abs()
    assert diff.max().item() <= 1
    assert (diff > 0).sum().item() <= alone.numel() // 500  # at most 0.2% of values, one step each


def test_negative_prompt_is_used(tiny: DiffusersPipeline) -> None:
    plain = run(tiny, [req(3)])[0]
    negative = run(tiny, [req(3, negative="blurry, low quality")])[0]
    assert not torch.equal(to_u8(plain), to_u8(negative))


def test_on_step_sees_every_step(tiny: DiffusersPipeline) -> None:
    seen: list[tuple[int, int]] = []
    params = BatchParams(width=64, height=64, steps=3, guidance=5.0)
    tiny.run(params, [req(1)], lambda s, n: seen.append((s, n)) or True)
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_on_step_false_interrupts_at_that_step(tiny: DiffusersPipeline) -> None:
    seen: list[int] = []

    def stop_at_2(step: int, total: int) -> bool:
        seen.append(step)
        return step < 2

    with pytest.raises(Interrupted) as info:
        tiny.run(BatchParams(width=64, height=64, steps=5, guidance=5.0), [req(1), req(2)], stop_at_2)
    assert (info.value.step, info.value.total) == (2, 5)
    assert seen == [1, 2]
    assert len(run(tiny, [req(1)])) == 1  # the pipeline is usable afterwards


def test_scheduler_classes_are_for_exactly_the_protocols_names() -> None:
    assert tuple(SCHEDULERS) == protocol.SCHEDULERS


@pytest.mark.parametrize("name", sorted(set(SCHEDULERS) - protocol.FLOW_SCHEDULERS))
def test_each_sd_scheduler_runs_on_tiny(tiny: DiffusersPipeline, name: str) -> None:
    params = BatchParams(width=64, height=64, steps=2, guidance=5.0, scheduler=name)
    image = run(tiny, [req(5)], params)[0]
    assert image.shape == (3, 64, 64) and 0.0 <= image.min().item() <= image.max().item() <= 1.0
    assert type(tiny.pipe.scheduler).__name__ == SCHEDULERS[name]
    run(tiny, [req(5)], params)
    assert tiny.pipe.scheduler is tiny._scheduler(name), "one scheduler object per name"


def test_flow_match_and_unknown_schedulers_are_refused(tiny: DiffusersPipeline) -> None:
    with pytest.raises(PipelineError, match="flow-match"):
        run(tiny, [req(1)], BatchParams(width=64, height=64, steps=2, guidance=5.0, scheduler="flow-match"))
    with pytest.raises(PipelineError, match=r"'heun'.*euler-a.*dpm\+\+"):
        run(tiny, [req(1)], BatchParams(width=64, height=64, steps=2, guidance=5.0, scheduler="heun"))


def test_num_frames_refused_for_an_image_model(tiny: DiffusersPipeline) -> None:
    with pytest.raises(PipelineError, match="num_frames"):
        run(tiny, [req(1)], BatchParams(width=64, height=64, steps=2, guidance=5.0, num_frames=4))


def test_bad_size_is_a_pipeline_error(tiny: DiffusersPipeline) -> None:
    with pytest.raises(PipelineError, match="tiny"):
        run(tiny, [req(1)], BatchParams(width=63, height=64, steps=2, guidance=5.0))


def test_sleep_and_wake(tiny: DiffusersPipeline) -> None:
    tiny.sleep()
    try:
        with pytest.raises(PipelineError, match="asleep"):
            run(tiny, [req(1)])
    finally:
        tiny.wake()
    assert len(run(tiny, [req(1)])) == 1


# --- registry -----------------------------------------------------------------------------------


def test_folder_from_diffusers_save_pretrained_loads(tiny_components: dict[str, object], tmp_path: Path) -> None:
    from diffusers import StableDiffusionPipeline

    StableDiffusionPipeline(**tiny_components).save_pretrained(str(tmp_path / "mine"), safe_serialization=True)
    pipe = load_pipeline(str(tmp_path / "mine"))
    assert pipe.name == "mine" and pipe.task is Task.TEXT_TO_IMAGE
    # Nothing overrides a plain folder's defaults: the native size (UNet sample 32 x VAE factor 2), and the
    # steps and guidance StableDiffusionPipeline.__call__ declares (SD's published 50 at 7.5; call_defaults.py).
    assert pipe.capabilities == Capabilities(task="text-to-image", width=64, height=64, steps=50, guidance=7.5,
                                             flow_scheduler=False, edits=("image-to-image", "inpainting"),
                                             previews=True)
    assert run(pipe, [req(1)])[0].shape == (3, 64, 64)
    # the edit pipelines come from from_pipe: the same modules, no second copy of any weight
    shared = {id(m) for m in pipe.pipe.components.values() if isinstance(m, torch.nn.Module)}
    for edit_pipe in pipe._edit_pipes.values():
        modules = {id(m) for m in edit_pipe.components.values() if isinstance(m, torch.nn.Module)}
        assert modules and modules <= shared, type(edit_pipe).__name__


def test_img2img_folder_serves_image_to_image_only(tiny_components: dict[str, object], tmp_path: Path) -> None:
    from diffusers import StableDiffusionImg2ImgPipeline

    StableDiffusionImg2ImgPipeline(**tiny_components).save_pretrained(str(tmp_path / "i2i"), safe_serialization=True)
    pipe = load_pipeline(str(tmp_path / "i2i"))
    assert pipe.capabilities.task == "image-to-image" and pipe.capabilities.edits == ("image-to-image",)
    with pytest.raises(PipelineError, match="needs an input image"):
        run(pipe, [req(1)])


def test_task_for_class() -> None:
    import diffusers

    assert task_for_class(diffusers.StableDiffusionPipeline) is Task.TEXT_TO_IMAGE
    assert task_for_class(diffusers.WanPipeline) is Task.TEXT_TO_VIDEO
    assert task_for_class(diffusers.AnimateDiffPipeline) is Task.TEXT_TO_VIDEO
    assert task_for_class(diffusers.StableDiffusionInpaintPipeline) is Task.INPAINTING
    assert task_for_class(diffusers.StableDiffusionXLImg2ImgPipeline) is Task.IMAGE_TO_IMAGE
    # a folder naming one of these as its class does that task only (a request sends an image)
    assert task_for_class(diffusers.WanImageToVideoPipeline) is Task.IMAGE_TO_VIDEO
    assert task_for_class(diffusers.LTXImageToVideoPipeline) is Task.IMAGE_TO_VIDEO
    assert task_for_class(diffusers.FluxKontextPipeline) is Task.INSTRUCTION_EDIT
    assert task_for_class(diffusers.QwenImageEditPipeline) is Task.INSTRUCTION_EDIT
    assert task_for_class(diffusers.QwenImageEditPlusPipeline) is Task.INSTRUCTION_EDIT  # several images (issue 30)
    with pytest.raises(PipelineError, match=r"QwenImageEditInpaintPipeline is not served yet: .*serve Qwen-Image-Edit"):
        task_for_class(diffusers.QwenImageEditInpaintPipeline)  # refused at load
    assert task_for_class(diffusers.FluxKontextInpaintPipeline) is Task.INPAINTING  # first match wins
    for refused in ("StableDiffusionControlNetPipeline", "StableDiffusionUpscalePipeline"):
        with pytest.raises(PipelineError, match=refused):
            task_for_class(getattr(diffusers, refused))


def test_folder_without_model_index(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match=r"model_index\.json"):
        load_pipeline(str(tmp_path))


def test_unknown_spec_names_it_and_the_accepted_forms() -> None:
    with pytest.raises(PipelineError) as info:
        load_pipeline("no such model!")
    assert "'no such model!'" in str(info.value) and "tiny" in str(info.value) and "synthetic" in str(info.value)


def test_bad_dtype_and_unknown_option() -> None:
    with pytest.raises(PipelineError, match="float64"):
        load_pipeline("synthetic", dtype="float64")
    with pytest.raises(PipelineError, match="cpu_ofload"):
        load_pipeline("synthetic", options={"cpu_ofload": "1"})


def test_missing_hub_id_fails_fast_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers  # noqa: F401  (imported before the clock starts: a cold import is slow on a busy box)
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(PipelineError) as info:
        load_pipeline("nobody-here/no-such-model-diffusiond-test")
    assert time.monotonic() - start < 30  # no network retries: a hang guard, not a speed claim
    message = str(info.value)
    assert "nobody-here/no-such-model-diffusiond-test" in message and constants.HF_HUB_CACHE in message
    assert "download" in message


def test_single_file_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import save_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PipelineError, match="does not exist"):
        load_pipeline(str(tmp_path / "absent.safetensors"))
    (tmp_path / "old.ckpt").write_bytes(b"not loaded")
    with pytest.raises(PipelineError, match="pickle"):
        load_pipeline(str(tmp_path / "old.ckpt"))
    save_file({"junk": torch.zeros(2)}, str(tmp_path / "junk.safetensors"))
    with pytest.raises(PipelineError, match=r"junk\.safetensors"):
        load_pipeline(str(tmp_path / "junk.safetensors"))


# --- synthetic ----------------------------------------------------------------------------------


def test_synthetic_shapes_and_determinism() -> None:
    pipe = load_pipeline("synthetic:compute_ms=2")
    assert isinstance(pipe, SyntheticPipeline) and isinstance(pipe, Pipeline)
    assert pipe.task is Task.TEXT_TO_IMAGE and pipe.compute_ms == 2.0 and pipe.matmuls_per_batch() >= 1
    assert pipe.capabilities == Capabilities(task="text-to-image", width=512, height=512, steps=4, guidance=1.0)
    params = BatchParams(width=40, height=24, steps=3, guidance=1.0)
    alone = run(pipe, [req(9)], params)[0]
    batch = run(pipe, [req(1), req(9), req(2)], params)
    assert alone.shape == (3, 24, 40) and alone.dtype == torch.float32
    assert 0.0 <= alone.min().item() <= alone.max().item() <= 1.0
    assert torch.equal(alone, batch[1]) and not torch.equal(batch[0], batch[2])
    video = run(pipe, [req(9)], BatchParams(width=16, height=8, steps=1, guidance=1.0, num_frames=5))[0]
    assert video.shape == (5, 3, 8, 16) and video.dtype == torch.float32


def test_synthetic_options_steps_and_interrupt() -> None:
    pipe = load_pipeline("synthetic:compute_ms=0,task=video", name="bench")
    assert (pipe.name, pipe.task) == ("bench", Task.TEXT_TO_VIDEO)
    assert pipe.capabilities == Capabilities(
        task="text-to-video", width=512, height=512, steps=4, guidance=1.0, num_frames=16, fps=16
    )
    seen: list[tuple[int, int]] = []
    with pytest.raises(Interrupted) as info:
        pipe.run(P64, [req(1)], lambda s, n: seen.append((s, n)) or s < 1)
    assert seen == [(1, 2)] and info.value.step == 1
    pipe.sleep()
    pipe.wake()
    assert len(run(pipe, [req(1)])) == 1
    for bad in ("synthetic:compute_ms=abc", "synthetic:task=audio", "synthetic:oops"):
        with pytest.raises(PipelineError):
            load_pipeline(bad)


def test_synthetic_runs_compute_ms_worth_of_work_at_its_calibrated_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that advances 0.5 ms per matmul stands in for the device, so the units of the
    calibration and of the work per batch are checked exactly, with no timing in the test."""
    import diffusiond.pipelines.synthetic as synthetic

    pipe = load_pipeline("synthetic:compute_ms=60")
    clock = [0.0]
    calls = [0]

    def matmul() -> None:
        clock[0] += 0.0005
        calls[0] += 1

    monkeypatch.setattr(synthetic.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(pipe, "_matmul", matmul)
    pipe.ms_per_matmul = pipe._calibrate()
    assert pipe.ms_per_matmul == pytest.approx(0.5)
    assert pipe.matmuls_per_batch() == 120  # 60 ms at 0.5 ms each
    calls[0] = 0
    run(pipe, [req(1)], BatchParams(width=8, height=8, steps=4, guidance=1.0))
    assert calls[0] == 120  # spread over the 4 steps, all of it run
    assert load_pipeline("synthetic:compute_ms=0").matmuls_per_batch() == 0


@pytest.mark.parametrize("spec", ["tiny", "tiny-flux"])
def test_a_model_loaded_in_half_precision_stays_there_with_its_edit_pipelines(spec: str, model_cache: Path) -> None:
    """diffusers' from_pipe casts the modules it shares to float32 unless told otherwise: the sibling
    pipelines of edits must not turn a float16 model float32 (twice its memory, float32 kernels)."""
    from diffusiond.pipelines.base import weight_bytes

    half = load_pipeline(spec, device="cpu", dtype="bfloat16")
    full = load_pipeline(spec, device="cpu", dtype="float32")
    assert isinstance(half, DiffusersPipeline) and half.capabilities.edits, "the model has edit pipelines"
    dtypes = {t.dtype for m in half.pipe.components.values() if isinstance(m, torch.nn.Module)
              for t in m.parameters()}
    assert dtypes == {torch.bfloat16}
    assert weight_bytes(half) < 0.51 * weight_bytes(full)  # half, but for integer buffers (position ids)


def test_edit_pipelines_are_built_on_the_weights_in_place(model_cache: Path) -> None:
    """Building a sibling must not copy the weights: a cast to float32 and back, per sibling, was most
    of a GPU worker's start (~22 s of an SD 1.5 cold start). A module kept in another dtype than the
    rest (Wan keeps some in float32) keeps it."""
    import diffusers

    from diffusiond.pipelines.edit_pipes import sibling
    from diffusiond.pipelines.tiny import ensure_tiny

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(ensure_tiny(), dtype=torch.bfloat16)
    kept = pipe.vae.post_quant_conv.to(torch.float32)  # a small part in float32, as Wan keeps some
    tensors = [t for m in (pipe.unet, pipe.text_encoder) for t in m.parameters()]
    where = [t.data_ptr() for t in tensors]
    sibling(diffusers.StableDiffusionImg2ImgPipeline, pipe)
    assert [t.data_ptr() for t in tensors] == where, "the bfloat16 weights were copied"
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    assert {t.dtype for t in kept.parameters()} == {torch.float32}
