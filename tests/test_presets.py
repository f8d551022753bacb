"""``random:<preset>``: real architectures at their published sizes, with random weights.

Full-size presets are never built here (gigabytes, minutes on 2 cores): their architectures are
instantiated on the ``meta`` device, which allocates nothing, and each component's parameter count
is compared with the published figure. The build/save/load machinery runs on scaled-down copies
of the tables. The generated tokenizers are built at their real vocabulary sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec
from diffusiond.pipelines import PipelineError, Task, load_pipeline
from diffusiond.pipelines import presets as presets_module
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.preset_tables import CLIP_L, PRESETS, T5_XXL, UMT5_XXL, Net, Preset, Tok, folder_name
from diffusiond.pipelines.presets import NOTICE, build_part, parameter_counts
from diffusiond.pipelines.spec import ACCEPTED_FORMS

# Published weight counts, per component (or per "a+b" group where the release counts them together).
# Sources: the model cards and papers (SD 1.5 UNet 859.52M, SDXL UNet 2.567B, OpenCLIP bigG text tower
# 694.7M, CLIP ViT-L/14 text tower 123.06M (123.65M with its 768x768 projection, as SD 3 uses it), SD VAE
# 83.65M, FLUX.1-dev transformer "12B" = 11.90B, T5-XXL encoder 4.762B, SD 3.5 Large "8.1B"); for
# SD 3.5 Medium, KerasHub's preset total of 3,371,793,763 for the MMDiT-X, both CLIP towers and the VAE;
# and the released files' sizes: Wan 2.1 (transformer 2.84 GB in bf16 = 1.42B, umT5-XXL encoder 11.36 GB in
# bf16 = 5.68B, VAE 508 MB in fp32 = 127M), Wan2.2_VAE.pth (2.82 GB in fp32 = 705M; the TI2V model is
# "5B") and ltx-video-2b-v0.9.safetensors (transformer and VAE, 9.37 GB in fp32 = 2.3425B); Qwen-Image's
# "20.4B" transformer and the Qwen2.5-VL-7B card's 8.29B (its VAE is Wan 2.1's architecture); LTX-2's "19B"
# transformer (the Lightricks/LTX-2 repository: "14B video and 5B audio parameters") and gemma-3-12b-it's
# 12,187,325,040 weights (its release's safetensors).
PUBLISHED: dict[str, dict[str, float]] = {
    "sd15": {"unet": 859.52e6, "text_encoder": 123.06e6, "vae": 83.65e6},
    "sdxl": {"unet": 2.567e9, "text_encoder": 123.06e6, "text_encoder_2": 694.7e6, "vae": 83.65e6},
    "flux-dev": {"transformer": 11.90e9, "text_encoder": 123.06e6, "text_encoder_2": 4.762e9, "vae": 83.82e6},
    "flux-kontext": {"transformer": 11.90e9, "text_encoder": 123.06e6, "text_encoder_2": 4.762e9, "vae": 83.82e6},
    "wan-1.3b": {"transformer": 1.42e9, "text_encoder": 5.68e9, "vae": 127e6},
    "sd3.5-medium": {"transformer+text_encoder+text_encoder_2+vae": 3_371_793_763, "text_encoder": 123.65e6,
                     "text_encoder_2": 694.7e6, "text_encoder_3": 4.762e9, "vae": 83.82e6},
    "sd3.5-large": {"transformer": 8.1e9, "text_encoder": 123.65e6, "text_encoder_2": 694.7e6,
                    "text_encoder_3": 4.762e9, "vae": 83.82e6},
    "wan2.2-5b": {"transformer": 5.0e9, "text_encoder": 5.68e9, "vae": 705e6},
    "ltx-2b": {"transformer+vae": 9.37e9 / 4, "text_encoder": 4.762e9},
    "qwen-image": {"transformer": 20.4e9, "text_encoder": 8.29e9, "vae": 127e6},
    "qwen-image-edit": {"transformer": 20.4e9, "text_encoder": 8.29e9, "vae": 127e6},  # "built upon" Qwen-Image
    "qwen-image-edit-plus": {"transformer": 20.4e9, "text_encoder": 8.29e9, "vae": 127e6},  # Edit's, Plus class
    "ltx-2": {"transformer": 19e9, "text_encoder": 12_187_325_040},
}  # fmt: skip
# Components with no published figure to check against here: their configs are diffusers' defaults (docs/models.md).
UNPUBLISHED: dict[str, set[str]] = {"ltx-2": {"connectors", "vae", "audio_vae", "vocoder"}}
PROMPTS = ["a photo of an astronaut riding a horse", "", "ünïcödé 日本語 🐱 <|endoftext|> </s> \t\n", "x" * 2000]


def req(seed: int, prompt: str = "a red fox") -> RequestSpec:
    return RequestSpec(request_id=f"p{seed}", prompt=prompt, seed=seed)


def always(_step: int, _total: int) -> bool:
    return True


@functools.cache
def tokenizer(part: Tok) -> Any:
    return build_part(part)


def test_every_preset_is_checked_here_and_listed_in_the_accepted_forms() -> None:
    assert set(PUBLISHED) == set(PRESETS)
    for key in PRESETS:
        assert f"random:{key}" in ACCEPTED_FORMS


@pytest.mark.parametrize("key", list(PRESETS))
def test_architecture_matches_the_published_size(key: str) -> None:
    counts = parameter_counts(PRESETS[key])
    checked = {part for group in PUBLISHED[key] for part in group.split("+")}
    assert checked | UNPUBLISHED.get(key, set()) == set(counts), "every model component has a published figure"
    for group, published in PUBLISHED[key].items():
        count = sum(counts[part] for part in group.split("+"))
        assert count == pytest.approx(published, rel=0.01), (key, group, count)


def test_ltx2_runs_the_releases_rope_and_decoder_in_a_cache_folder_of_its_own() -> None:
    """Where diffusers' LTX-2 conversion script configures the release otherwise than the classes' defaults (issue
    30): rope "split" in the transformer and the connectors, a video decoder not causal in time. The change has its
    own revision, so a cached LTX-2 of the old tables is rebuilt and the other presets' caches are kept."""
    parts = PRESETS["ltx-2"].parts
    configs = {k: p.config for k, p in parts.items() if isinstance(p, Net)}
    assert configs["transformer"]["rope_type"] == configs["connectors"]["rope_type"] == "split"
    assert configs["vae"]["decoder_causal"] is False
    assert (folder_name(PRESETS["ltx-2"]), folder_name(PRESETS["sd15"])) == ("random-ltx-2-v1.1", "random-sd15-v1")


@pytest.mark.parametrize("key", list(PRESETS))
def test_generated_tokenizers_have_the_real_vocab_and_take_any_prompt(key: str) -> None:
    preset = PRESETS[key]
    toks = {k: p for k, p in preset.parts.items() if isinstance(p, Tok)}
    assert toks
    for name, part in toks.items():
        tok = tokenizer(part)
        assert len(tok) == part.size
        # The matching text encoder's embedding table covers every id the tokenizer can produce.
        encoder = preset.parts[name.replace("tokenizer", "text_encoder")]
        assert isinstance(encoder, Net)
        rows = encoder.config.get("vocab_size") or encoder.config["text_config"]["vocab_size"]
        assert rows >= part.size
        for prompt in PROMPTS:
            ids = tok(prompt, padding="max_length", max_length=part.max_length, truncation=True).input_ids
            assert len(ids) == part.max_length
            assert all(0 <= i < part.size for i in ids)
        if part.kind == "clip":
            # CLIP pools at the highest id, which must be the end token: real layout, real ids.
            assert (tok.bos_token_id, tok.eos_token_id) == (49406, 49407)
        elif part.kind == "qwen":
            # Qwen2's layout: <|endoftext|> pads and ends; the chat template's markers are single tokens
            assert (tok.pad_token_id, tok.eos_token_id) == (151643, 151643)
            ids = tok("<|im_start|>user<|im_end|>").input_ids
            assert (ids[0], ids[-1]) == (151644, 151645)
        else:
            assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
            if part.kind == "t5":
                assert tok.convert_tokens_to_ids("<extra_id_0>") == part.size - 1


def test_unknown_preset_is_an_error_listing_the_presets() -> None:
    with pytest.raises(PipelineError) as err:
        load_pipeline("random:xyz")
    for key in PRESETS:
        assert f"random:{key}" in str(err.value)


def test_save_option_must_be_0_or_1() -> None:
    with pytest.raises(PipelineError, match="save must be 0 or 1"):
        load_pipeline("random:sd15", options={"save": "no"})


def test_synthetic_names_always_say_random() -> None:
    preset = PRESETS["sd15"]
    assert presets_module.synthetic_name(None, preset) == "random:sd15"
    assert presets_module.synthetic_name("random:sd15", preset) == "random:sd15"
    assert presets_module.synthetic_name("sd15", preset) == "sd15 (random weights)"


# --- the machinery, on scaled-down tables ------------------------------------------------------

SMALL_CLIP = {**CLIP_L, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "projection_dim": 32}  # fmt: skip
SMALL_SD = dataclasses.replace(
    PRESETS["sd15"],
    name="test-sd15",
    parts={
        **PRESETS["sd15"].parts,
        "unet": Net("UNet2DConditionModel", {
            "sample_size": 32, "block_out_channels": (32, 64), "layers_per_block": 1, "cross_attention_dim": 32,
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"), "attention_head_dim": 8,
            "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "norm_num_groups": 32}),
        "vae": Net("AutoencoderKL", {
            "block_out_channels": (32, 64), "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2, "layers_per_block": 1, "norm_num_groups": 32}),
        "text_encoder": Net("CLIPTextModel", SMALL_CLIP),
    },
    defaults={"width": 64, "height": 64, "steps": 2, "guidance": 7.5},
)  # fmt: skip
SMALL_WAN = dataclasses.replace(
    PRESETS["wan-1.3b"],
    name="test-wan",
    parts={
        **PRESETS["wan-1.3b"].parts,
        "transformer": Net("WanTransformer3DModel", {
            "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 16,
            "out_channels": 16, "text_dim": 32, "freq_dim": 256, "ffn_dim": 32, "num_layers": 2,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32}),
        "vae": Net("AutoencoderKLWan", {
            "base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
            "temperal_downsample": [False, True, True]}),
        "text_encoder": Net("UMT5EncoderModel", {
            **UMT5_XXL, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2,
            "relative_attention_num_buckets": 8}),
    },
    defaults={"width": 32, "height": 32, "steps": 2, "guidance": 5.0, "num_frames": 5, "fps": 16},
)  # fmt: skip


SMALL_T5 = {**T5_XXL, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2,
            "relative_attention_num_buckets": 8}  # fmt: skip


def _smaller(key: str, defaults: dict[str, Any], **nets: Net) -> Preset:
    """``key``'s preset with ``nets`` in place of its big models: its pipeline, VAE family and rules kept."""
    return dataclasses.replace(PRESETS[key], name=f"test-{key}", parts={**PRESETS[key].parts, **nets},
                               defaults=defaults)  # fmt: skip


def _config(key: str, part: str, **changes: Any) -> dict[str, Any]:
    net = PRESETS[key].parts[part]
    assert isinstance(net, Net)
    return {**net.config, **changes}


# The newer families at test size: SD 3.5 (three text encoders, an MMDiT with dual attention), Wan 2.2
# (the 48-channel VAE at 16x, expanded timesteps) and LTX-Video (a 128-channel VAE at 32x, 8k+1 frames).
SMALL_NEW = {
    "sd3.5-medium": _smaller(
        "sd3.5-medium", {"width": 64, "height": 64, "steps": 2, "guidance": 4.5},
        transformer=Net("SD3Transformer2DModel", _config(
            "sd3.5-medium", "transformer", sample_size=32, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=32,
            dual_attention_layers=(0,))),
        vae=Net("AutoencoderKL", _config(
            "sd3.5-medium", "vae", block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1)),
        text_encoder=Net("CLIPTextModelWithProjection", SMALL_CLIP),
        text_encoder_2=Net("CLIPTextModelWithProjection", SMALL_CLIP),
        text_encoder_3=Net("T5EncoderModel", SMALL_T5),
    ),
    "wan2.2-5b": _smaller(
        "wan2.2-5b", {"width": 64, "height": 64, "steps": 2, "guidance": 5.0, "num_frames": 5, "fps": 24},
        transformer=Net("WanTransformer3DModel", _config(
            "wan2.2-5b", "transformer", num_attention_heads=2, attention_head_dim=12, text_dim=32, ffn_dim=32,
            num_layers=2, rope_max_seq_len=32)),
        vae=Net("AutoencoderKLWan", _config(
            "wan2.2-5b", "vae", base_dim=12, decoder_base_dim=12, dim_mult=[1, 1, 1, 1], num_res_blocks=1)),
        text_encoder=Net("UMT5EncoderModel", {**UMT5_XXL, **{k: v for k, v in SMALL_T5.items() if k != "vocab_size"}}),
    ),
    "ltx-2b": _smaller(
        "ltx-2b", {"width": 64, "height": 64, "steps": 2, "guidance": 3.0, "num_frames": 9, "fps": 25},
        transformer=Net("LTXVideoTransformer3DModel", _config(
            "ltx-2b", "transformer", num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            num_layers=1, caption_channels=32)),
        vae=Net("AutoencoderKLLTXVideo", _config(
            "ltx-2b", "vae", block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
            layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5)),
        text_encoder=Net("T5EncoderModel", SMALL_T5),
    ),
    "ltx-2": _smaller(  # tests/ltx2kit.py's widths
        "ltx-2", {"width": 64, "height": 64, "steps": 2, "guidance": 3.0, "num_frames": 9, "fps": 24},
        transformer=Net("LTX2VideoTransformer3DModel", {
            **_config("ltx-2", "transformer"),
            "in_channels": 128, "out_channels": 128, "num_attention_heads": 2, "attention_head_dim": 8,
            "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4, "audio_num_attention_heads": 2,
            "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8, "num_layers": 2, "caption_channels": 32}),
        connectors=Net("LTX2TextConnectors", {
            **_config("ltx-2", "connectors"),
            "caption_channels": 32, "text_proj_in_factor": 3, "video_connector_num_attention_heads": 4,
            "video_connector_attention_head_dim": 8, "video_connector_num_layers": 1,
            "video_connector_num_learnable_registers": None, "audio_connector_num_attention_heads": 4,
            "audio_connector_attention_head_dim": 8, "audio_connector_num_layers": 1,
            "audio_connector_num_learnable_registers": None}),
        vae=Net("AutoencoderKLLTX2Video", {
            **_config("ltx-2", "vae"), "latent_channels": 128, "block_out_channels": (8, 16, 32, 64),
            "decoder_block_out_channels": (8, 16, 32), "layers_per_block": (1,) * 5,
            "decoder_layers_per_block": (1,) * 4}),
        audio_vae=Net("AutoencoderKLLTX2Audio", {
            "base_channels": 4, "ch_mult": (1,), "num_res_blocks": 1, "latent_channels": 2, "mel_bins": 8}),
        vocoder=Net("LTX2Vocoder", {
            "in_channels": 16, "hidden_channels": 16, "upsample_kernel_sizes": [8, 8, 20],
            "upsample_factors": [4, 4, 10],
            "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]], "output_sampling_rate": 16000}),
        text_encoder=Net("Gemma3ForConditionalGeneration", {
            **_config("ltx-2", "text_encoder"),
            "text_config": {"vocab_size": 262208, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 64},
            "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
            "mm_tokens_per_image": 4}),
    ),
    "qwen-image": _smaller(
        "qwen-image", {"width": 64, "height": 64, "steps": 2, "guidance": 4.0},
        transformer=Net("QwenImageTransformer2DModel", _config(
            "qwen-image", "transformer", num_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(4, 6, 6))),
        vae=Net("AutoencoderKLQwenImage", _config("qwen-image", "vae", base_dim=8, dim_mult=[1, 1, 1, 1],
                                                 num_res_blocks=1)),
        text_encoder=Net("Qwen2_5_VLForConditionalGeneration", {
            **_config("qwen-image", "text_encoder"),
            "text_config": {**_config("qwen-image", "text_encoder")["text_config"], "hidden_size": 32,
                            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
            "vision_config": {**_config("qwen-image", "text_encoder")["vision_config"], "depth": 1,
                              "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                              "fullatt_block_indexes": [0]}}),
    ),
}  # fmt: skip


@pytest.fixture
def small_presets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The scaled-down presets, registered by name, building into a cache of their own."""
    for preset in (SMALL_SD, SMALL_WAN, *SMALL_NEW.values()):
        monkeypatch.setitem(PRESETS, preset.name, preset)
    monkeypatch.setenv("DIFFUSIOND_CACHE", str(tmp_path))
    return tmp_path


def test_preset_builds_saves_and_loads_back_labelled_synthetic(
    small_presets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=presets_module.__name__):
        pipe = load_pipeline("random:test-sd15")
    assert isinstance(pipe, DiffusersPipeline)
    assert NOTICE in caplog.text and NOTICE == "random weights: outputs are noise; for benchmarks only"
    assert (pipe.name, pipe.task) == ("random:test-sd15", Task.TEXT_TO_IMAGE)
    assert pipe.capabilities == Capabilities(
        task="text-to-image", **SMALL_SD.defaults, flow_scheduler=False, synthetic_weights=True, previews=True,
        edits=("image-to-image", "inpainting"),  # an SD pipeline: from_pipe makes both (main's edits)
    )
    folder = small_presets / "models" / "random-test-sd15-v1"
    assert (folder / "model_index.json").is_file()
    assert sorted(p.name for p in (folder / "unet").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert [p.name for p in (small_presets / "models").iterdir()] == [folder.name], "no build leftovers"
    assert len(pipe.pipe.tokenizer) == 49408
    (image,) = pipe.run(BatchParams(width=64, height=64, steps=2, guidance=7.5), [req(1)], always)
    assert image.shape == (3, 64, 64) and 0.0 <= image.min().item() <= image.max().item() <= 1.0
    # A second load finds the cache: same weights, no rebuild.
    again = load_pipeline("random:test-sd15", name="bench")
    assert again.name == "bench (random weights)"
    assert torch.equal(again.pipe.unet.conv_in.weight, pipe.pipe.unet.conv_in.weight)  # type: ignore[attr-defined]


def test_preset_with_save_0_is_served_as_built(small_presets: Path) -> None:
    pipe = load_pipeline("random:test-wan", options={"save": "0"})
    assert isinstance(pipe, DiffusersPipeline)
    assert pipe.task is Task.TEXT_TO_VIDEO
    assert not (small_presets / "models").exists(), "save=0 writes nothing"
    assert pipe.capabilities == Capabilities(
        task="text-to-video", **SMALL_WAN.defaults, num_frames_step=4, flow_scheduler=True, synthetic_weights=True,
        size_step=16, min_size=16,
        previews=True,  # Wan's 16-channel latents: the Wan 2.1 factors
    )
    shown: list[tuple[int, int, tuple[int, ...]]] = []
    wants = msgspec.structs.replace(req(2), preview_every=1, preview_max_side=16)
    (video,) = pipe.run(BatchParams(width=32, height=32, steps=2, guidance=5.0, num_frames=5), [wants], always,
                        lambda step, total, pics: shown.extend((step, k, tuple(p.shape)) for k, p in pics))
    assert video.shape == (5, 3, 32, 32)
    assert shown == [(1, 0, (16, 16, 3))]  # its first frame (uint8 HWC), after step 1 of 2
    with pytest.raises(PipelineError, match=r"4k\+1 frames .*use 5 or 9"):
        pipe.run(BatchParams(width=32, height=32, steps=2, guidance=5.0, num_frames=6), [req(2)], always)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is not None, reason="accelerate is installed")
def test_wan_with_save_needs_accelerate_and_says_so(small_presets: Path) -> None:
    with pytest.raises(PipelineError, match="accelerate"):
        load_pipeline("random:test-wan")


def test_building_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    presets_module.build_pipeline(SMALL_SD, "cpu", torch.float32)
    assert torch.equal(torch.rand(3), expected)


def test_preset_tables_are_frozen_data() -> None:
    assert all(isinstance(p, Preset) for p in PRESETS.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["sd15"].name = "x"  # type: ignore[misc]


# (task, frame step, size step, smallest side, previews) each newer family declares: what admission checks requests
# against. The smallest side is one size step but for LTX-2, whose decoder pads by reflection (2 latent pixels).
NEW_FAMILY_RULES = {
    "sd3.5-medium": (Task.TEXT_TO_IMAGE, 1, 8, 8, False),  # no published preview factors for SD 3's latents here
    "wan2.2-5b": (Task.TEXT_TO_VIDEO, 4, 32, 32, False),  # 48 channels: Wan 2.1's 16-channel factors do not fit
    "ltx-2b": (Task.TEXT_TO_VIDEO, 8, 32, 32, True),
    # its real 128 latent channels, LTX-Video's count: LTX-Video's factors would pass that check but do not fit
    "ltx-2": (Task.TEXT_TO_VIDEO, 8, 32, 64, False),
    "qwen-image": (Task.TEXT_TO_IMAGE, 1, 16, 16, False),  # no preview factors here for its (Wan 2.1-like) latents
}


@pytest.mark.parametrize("key", list(SMALL_NEW))
def test_newer_families_build_save_load_back_and_generate(key: str, small_presets: Path) -> None:
    preset = SMALL_NEW[key]
    pipe = load_pipeline(f"random:{preset.name}")
    assert isinstance(pipe, DiffusersPipeline) and type(pipe.pipe).__name__ == PRESETS[key].pipeline
    caps = pipe.capabilities
    assert (pipe.task, caps.num_frames_step, caps.size_step, caps.min_size, caps.previews) == NEW_FAMILY_RULES[key]
    assert caps.synthetic_weights and caps.flow_scheduler
    d = preset.defaults
    params = BatchParams(width=d["width"], height=d["height"], steps=2, guidance=d["guidance"],
                         num_frames=d.get("num_frames"))  # fmt: skip
    (out,) = pipe.run(params, [req(3)], always)
    frames = (d["num_frames"],) if "num_frames" in d else ()
    assert tuple(out.shape) == (*frames, 3, 64, 64)
    assert 0.0 <= out.min().item() <= out.max().item() <= 1.0
