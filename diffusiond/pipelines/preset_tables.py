"""The ``random:<preset>`` tables: each published model's shape written down as data.

A preset names each component's class and its published config numbers, the tokenizer's vocabulary
size and the scheduler's settings, and the model's native request defaults; ``presets`` builds them.
Keeping the data apart from the building lets a new family be added by reading one module, and
tests/test_presets.py checks each table against the published parameter counts on the meta device.
Torch-free (the engine reads a preset's revision: a remembered parameter table is filed under it, issue 29).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from diffusiond.pipelines.errors import PipelineError

if TYPE_CHECKING:
    from diffusiond.pipelines.base import RequestDefaults

# Bump when a table below changes: an old cache folder is then ignored (one preset's: its revision).
PRESET_VERSION = "v1"


@dataclass(frozen=True)
class Net:
    """A model: a diffusers or transformers class name and its published config."""

    cls: str
    config: Mapping[str, Any]


@dataclass(frozen=True)
class Tok:
    """A generated tokenizer: ``size`` is ``len(tokenizer)`` of the published one."""

    kind: Literal["clip", "t5", "qwen", "gemma"]  # gemma: T5's layout (pad 0, eos 1, unk 2) at Gemma's size
    size: int
    max_length: int
    extra_ids: int = 0  # t5: sentinel tokens, included in ``size``
    pad: str | None = None  # clip: SDXL's second tokenizer pads with "!"


@dataclass(frozen=True)
class Proc:
    """Qwen2.5-VL's processor (Qwen-Image-Edit's): a generated tokenizer beside the image processor's settings."""

    tokenizer: Tok
    image: Mapping[str, Any]


@dataclass(frozen=True)
class Sched:
    cls: str
    config: Mapping[str, Any]


Part = Net | Tok | Sched | Proc | None


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # the published model whose shapes these are
    pipeline: str  # diffusers pipeline class
    parts: Mapping[str, Part]
    defaults: RequestDefaults  # the published model's native size, steps, guidance (and frames, fps)
    pipeline_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # from_pretrained of a model with float32-pinned modules (Wan) needs the accelerate package.
    needs_accelerate: bool = False
    # bumped when this preset's tables change: its old cache folder is then ignored, the others' are kept
    revision: int = 0


# --- published configs, as data ------------------------------------------------------------------

# openai/clip-vit-large-patch14 text tower (SD1.5, SDXL's first encoder, Flux's CLIP).
CLIP_L = {
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
    "projection_dim": 768, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}  # fmt: skip
# laion OpenCLIP ViT-bigG/14 text tower with projection (SDXL's second encoder).
CLIP_BIGG = {
    **CLIP_L, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
    "hidden_act": "gelu", "projection_dim": 1280,
}  # fmt: skip
# google/t5-v1_1-xxl encoder (Flux's second encoder); UMT5-XXL (Wan) has the same shape, 8x the vocabulary.
T5_XXL = {
    "vocab_size": 32128, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0,
}  # fmt: skip
UMT5_XXL = {**{k: v for k, v in T5_XXL.items() if k != "tie_word_embeddings"}, "vocab_size": 256384}
# The SD VAE (f8, 4 latent channels); Flux's has 16 channels and no quant convs.
SD_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2, "norm_num_groups": 32, "act_fn": "silu", "sample_size": 512, "scaling_factor": 0.18215,
}  # fmt: skip
SD15_UNET = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280, 1280),
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 768, "attention_head_dim": 8, "norm_num_groups": 32, "norm_eps": 1e-5, "act_fn": "silu",
    "flip_sin_to_cos": True, "freq_shift": 0, "downsample_padding": 1, "mid_block_scale_factor": 1,
}  # fmt: skip
SDXL_UNET = {
    "sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280),
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "transformer_layers_per_block": (1, 2, 10), "attention_head_dim": (5, 10, 20), "cross_attention_dim": 2048,
    "use_linear_projection": True, "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32, "norm_eps": 1e-5, "act_fn": "silu",
    "flip_sin_to_cos": True, "freq_shift": 0, "downsample_padding": 1, "mid_block_scale_factor": 1,
}  # fmt: skip
FLUX_DEV_TRANSFORMER = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
FLUX_VAE = {
    **SD_VAE, "latent_channels": 16, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "use_quant_conv": False, "use_post_quant_conv": False, "force_upcast": True,
}  # fmt: skip
WAN_1_3B_TRANSFORMER = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}  # fmt: skip
# Wan 2.1's causal 3D VAE (f8 in space, f4 in time); the latent statistics are diffusers' defaults.
WAN_VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}  # fmt: skip
SD_BETAS = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
FLUX_SCHEDULER = {
    "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}  # fmt: skip
# Wan 2.1 480p: UniPC on flow sigmas with shift 3.
WAN_SCHEDULER = {
    "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0, "num_train_timesteps": 1000,
    "solver_order": 2, "beta_schedule": "linear",
}  # fmt: skip

# SD 3 / 3.5: MMDiT transformers over a 16-channel f8 VAE, with CLIP-L, OpenCLIP bigG and T5-XXL.
SD35_LARGE_TRANSFORMER = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 38,
    "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
    "pooled_projection_dim": 2048, "pos_embed_max_size": 192, "qk_norm": "rms_norm",
}  # fmt: skip
# 3.5 Medium is the MMDiT-X: dual attention (a second self-attention on the image stream) in layers 0-12.
SD35_MEDIUM_TRANSFORMER = {
    **SD35_LARGE_TRANSFORMER, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
    "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13)),
}  # fmt: skip
SD3_VAE = {**FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
T5_TOKENIZER = Tok("t5", 32100, 512, extra_ids=100)
# Wan 2.2 TI2V-5B: a 48-channel transformer over the Wan 2.2 VAE (16x in space, 4x in time, residual
# blocks); the latent statistics are the published ones (Wan2.2 VAE, as diffusers' converter writes them).
WAN22_5B_TRANSFORMER = {
    "patch_size": (1, 2, 2), "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
    "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}  # fmt: skip
WAN22_VAE = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12,
    "patch_size": 2, "scale_factor_temporal": 4, "scale_factor_spatial": 16,
    "latents_mean": [
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
        0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
        -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    "latents_std": [
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
        0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
        0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
}  # fmt: skip
# TI2V-5B at 720p: UniPC on flow sigmas with shift 5.
WAN22_SCHEDULER = {**WAN_SCHEDULER, "flow_shift": 5.0}
# LTX-Video 2B (0.9.x): a 128-channel transformer at patch 1 over LTX's f32x8 video VAE, T5-XXL text.
LTX_2B_TRANSFORMER = {
    "in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 32,
    "attention_head_dim": 64, "cross_attention_dim": 2048, "num_layers": 28, "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 4096,
    "attention_bias": True, "attention_out_bias": True,
}  # fmt: skip
LTX_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": (4, 3, 3, 3, 4), "spatio_temporal_scaling": (True, True, True, False),
    "decoder_block_out_channels": (128, 256, 512, 512), "decoder_layers_per_block": (4, 3, 3, 3, 4),
    "decoder_spatio_temporal_scaling": (True, True, True, False), "patch_size": 4, "patch_size_t": 1,
    "encoder_causal": True, "decoder_causal": False,
}  # fmt: skip
LTX_SCHEDULER = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False, "base_shift": 0.95, "max_shift": 2.05,
    "base_image_seq_len": 1024, "max_image_seq_len": 4096, "shift_terminal": 0.1,
}  # fmt: skip

# Qwen-Image: a 20B MMDiT (diffusers' defaults are its config) over the Wan 2.1-style 16-channel VAE, with
# Qwen2.5-VL-7B as its text encoder (the whole vision-language model, as the release ships it).
QWEN_IMAGE_TRANSFORMER = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
QWEN25_VL_7B = {
    "text_config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
    },
    "vocab_size": 152064, "tie_word_embeddings": False, "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652,
}  # fmt: skip
QWEN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2}
QWEN_SCHEDULER = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential",
}  # fmt: skip
# Qwen2.5-VL-7B-Instruct's image processor (the release's processor/preprocessor_config.json): pictures of 4 to
# 16,384 merged 28x28 patches.
QWEN25_VL_IMAGES = {"min_pixels": 3136, "max_pixels": 12845056}
QWEN_IMAGE_PARTS: Mapping[str, Part] = {
    "transformer": Net("QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER),
    "vae": Net("AutoencoderKLQwenImage", QWEN_VAE),
    "text_encoder": Net("Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B),
    "tokenizer": Tok("qwen", 151665, 32768),
    "scheduler": Sched("FlowMatchEulerDiscreteScheduler", QWEN_SCHEDULER),
}

CLIP_TOKENIZER = Tok("clip", 49408, 77)

# LTX-2 (issue 30): diffusers' own defaults for the LTX-2 classes, which their docstrings give as the released
# model's (the real config.json files cannot be read here), but where the configs diffusers' LTX-2 conversion script
# writes for the release (its version "2.0", what Lightricks/LTX-2's diffusers folders were made with) differ: rope
# "split" (not "interleaved") in the transformer and the text connectors, and a video decoder that is not causal in
# time. The video VAE's compression is stated, as the release does (diffusers would count each of its four scaling
# blocks as 2x in space and time: 64x16, not 32x8). Neither changes a parameter count.
LTX2_ROPE = {"rope_type": "split"}
LTX2_VAE = {"spatial_compression_ratio": 32, "temporal_compression_ratio": 8, "decoder_causal": False}
# Gemma 3 12B (google/gemma-3-12b-it's config), the whole vision-language model as LTX-2 loads it.
GEMMA3_12B = {
    "text_config": {
        "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024,
        "max_position_embeddings": 131072, "query_pre_attn_scalar": 256,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    },
    "vision_config": {
        "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
        "image_size": 896, "patch_size": 14, "vision_use_head": False,
    },
    "mm_tokens_per_image": 256,
}  # fmt: skip
LTX2_SCHEDULER = {**LTX_SCHEDULER, "use_dynamic_shifting": True}


# FLUX.1-dev's components; FLUX.1 Kontext-dev is the same architecture under another pipeline.
FLUX_DEV_PARTS: Mapping[str, Part] = {
    "transformer": Net("FluxTransformer2DModel", FLUX_DEV_TRANSFORMER),
    "vae": Net("AutoencoderKL", FLUX_VAE),
    "text_encoder": Net("CLIPTextModel", CLIP_L),
    "text_encoder_2": Net("T5EncoderModel", T5_XXL),
    "tokenizer": CLIP_TOKENIZER,
    "tokenizer_2": T5_TOKENIZER,
    "scheduler": Sched("FlowMatchEulerDiscreteScheduler", FLUX_SCHEDULER),
    "image_encoder": None,
    "feature_extractor": None,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="sd15",
            source="stable-diffusion-v1-5",
            pipeline="StableDiffusionPipeline",
            parts={
                "unet": Net("UNet2DConditionModel", SD15_UNET),
                "vae": Net("AutoencoderKL", SD_VAE),
                "text_encoder": Net("CLIPTextModel", CLIP_L),
                "tokenizer": CLIP_TOKENIZER,
                "scheduler": Sched(
                    "PNDMScheduler",
                    {**SD_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False, "steps_offset": 1},
                ),
                "safety_checker": None,
                "feature_extractor": None,
                "image_encoder": None,
            },
            defaults={"width": 512, "height": 512, "steps": 25, "guidance": 7.5},
            pipeline_kwargs={"requires_safety_checker": False},
        ),
        Preset(
            name="sdxl",
            source="stable-diffusion-xl-base-1.0",
            pipeline="StableDiffusionXLPipeline",
            parts={
                "unet": Net("UNet2DConditionModel", SDXL_UNET),
                "vae": Net("AutoencoderKL", {**SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025}),
                "text_encoder": Net("CLIPTextModel", CLIP_L),
                "text_encoder_2": Net("CLIPTextModelWithProjection", CLIP_BIGG),
                "tokenizer": CLIP_TOKENIZER,
                "tokenizer_2": Tok("clip", 49408, 77, pad="!"),
                "scheduler": Sched(
                    "EulerDiscreteScheduler",
                    {**SD_BETAS, "steps_offset": 1, "timestep_spacing": "leading", "interpolation_type": "linear"},
                ),
                "image_encoder": None,
                "feature_extractor": None,
            },
            defaults={"width": 1024, "height": 1024, "steps": 30, "guidance": 5.0},
            pipeline_kwargs={"force_zeros_for_empty_prompt": True, "add_watermarker": False},
        ),
        Preset(
            name="flux-dev",
            source="FLUX.1-dev",
            pipeline="FluxPipeline",
            parts=FLUX_DEV_PARTS,
            defaults={"width": 1024, "height": 1024, "steps": 28, "guidance": 3.5},
        ),
        Preset(  # the same 12B transformer, trained for edits by instruction: its pipeline takes an image
            name="flux-kontext",
            source="FLUX.1-Kontext-dev",
            pipeline="FluxKontextPipeline",
            parts=FLUX_DEV_PARTS,
            defaults={"width": 1024, "height": 1024, "steps": 28, "guidance": 2.5},  # the model card's 2.5
        ),
        Preset(
            name="wan-1.3b",
            source="Wan2.1-T2V-1.3B",
            pipeline="WanPipeline",
            parts={
                "transformer": Net("WanTransformer3DModel", WAN_1_3B_TRANSFORMER),
                "vae": Net("AutoencoderKLWan", WAN_VAE),
                "text_encoder": Net("UMT5EncoderModel", UMT5_XXL),
                "tokenizer": Tok("t5", 256300, 512, extra_ids=300),
                "scheduler": Sched("UniPCMultistepScheduler", WAN_SCHEDULER),
                "transformer_2": None,
            },
            defaults={"width": 832, "height": 480, "steps": 50, "guidance": 5.0, "num_frames": 81, "fps": 16},
            needs_accelerate=True,
        ),
        Preset(
            name="sd3.5-medium",
            source="stable-diffusion-3.5-medium",
            pipeline="StableDiffusion3Pipeline",
            parts={
                "transformer": Net("SD3Transformer2DModel", SD35_MEDIUM_TRANSFORMER),
                "vae": Net("AutoencoderKL", SD3_VAE),
                "text_encoder": Net("CLIPTextModelWithProjection", CLIP_L),
                "text_encoder_2": Net("CLIPTextModelWithProjection", CLIP_BIGG),
                "text_encoder_3": Net("T5EncoderModel", T5_XXL),
                "tokenizer": CLIP_TOKENIZER,
                "tokenizer_2": Tok("clip", 49408, 77, pad="!"),
                "tokenizer_3": T5_TOKENIZER,
                "scheduler": Sched("FlowMatchEulerDiscreteScheduler", SD3_SCHEDULER),
                "image_encoder": None,
                "feature_extractor": None,
            },
            defaults={"width": 1024, "height": 1024, "steps": 40, "guidance": 4.5},
        ),
        Preset(
            name="sd3.5-large",
            source="stable-diffusion-3.5-large",
            pipeline="StableDiffusion3Pipeline",
            parts={
                "transformer": Net("SD3Transformer2DModel", SD35_LARGE_TRANSFORMER),
                "vae": Net("AutoencoderKL", SD3_VAE),
                "text_encoder": Net("CLIPTextModelWithProjection", CLIP_L),
                "text_encoder_2": Net("CLIPTextModelWithProjection", CLIP_BIGG),
                "text_encoder_3": Net("T5EncoderModel", T5_XXL),
                "tokenizer": CLIP_TOKENIZER,
                "tokenizer_2": Tok("clip", 49408, 77, pad="!"),
                "tokenizer_3": T5_TOKENIZER,
                "scheduler": Sched("FlowMatchEulerDiscreteScheduler", SD3_SCHEDULER),
                "image_encoder": None,
                "feature_extractor": None,
            },
            defaults={"width": 1024, "height": 1024, "steps": 28, "guidance": 3.5},
        ),
        Preset(
            name="wan2.2-5b",
            source="Wan2.2-TI2V-5B",
            pipeline="WanPipeline",
            parts={
                "transformer": Net("WanTransformer3DModel", WAN22_5B_TRANSFORMER),
                "vae": Net("AutoencoderKLWan", WAN22_VAE),
                "text_encoder": Net("UMT5EncoderModel", UMT5_XXL),
                "tokenizer": Tok("t5", 256300, 512, extra_ids=300),
                "scheduler": Sched("UniPCMultistepScheduler", WAN22_SCHEDULER),
                "transformer_2": None,
            },
            defaults={"width": 1280, "height": 704, "steps": 50, "guidance": 5.0, "num_frames": 121, "fps": 24},
            # one transformer over the whole schedule (no high/low-noise pair), timesteps per latent patch
            pipeline_kwargs={"expand_timesteps": True},
            needs_accelerate=True,
        ),
        Preset(
            name="ltx-2b",
            source="LTX-Video 2B (0.9.x)",
            pipeline="LTXPipeline",
            parts={
                "transformer": Net("LTXVideoTransformer3DModel", LTX_2B_TRANSFORMER),
                "vae": Net("AutoencoderKLLTXVideo", LTX_VAE),
                "text_encoder": Net("T5EncoderModel", T5_XXL),
                "tokenizer": Tok("t5", 32100, 128, extra_ids=100),
                "scheduler": Sched("FlowMatchEulerDiscreteScheduler", LTX_SCHEDULER),
            },
            defaults={"width": 704, "height": 480, "steps": 50, "guidance": 3.0, "num_frames": 161, "fps": 25},
        ),
        Preset(  # video and its sound track; diffusiond serves the video (pipelines/ltx2.py)
            name="ltx-2",
            source="LTX-2 19B",
            pipeline="LTX2Pipeline",
            parts={
                "transformer": Net("LTX2VideoTransformer3DModel", LTX2_ROPE),
                "connectors": Net("LTX2TextConnectors", LTX2_ROPE),
                "vae": Net("AutoencoderKLLTX2Video", LTX2_VAE),
                "audio_vae": Net("AutoencoderKLLTX2Audio", {}),
                "vocoder": Net("LTX2Vocoder", {}),
                "text_encoder": Net("Gemma3ForConditionalGeneration", GEMMA3_12B),
                "tokenizer": Tok("gemma", 262144, 1024),
                "scheduler": Sched("FlowMatchEulerDiscreteScheduler", LTX2_SCHEDULER),
                "processor": None,
                "prompt_enhancer": None,
                "duration_head": None,
            },
            # LTX2Pipeline's own defaults (768x512, 121 frames at 24 fps, 30 steps, guidance 3)
            defaults={"width": 768, "height": 512, "steps": 30, "guidance": 3.0, "num_frames": 121, "fps": 24},
            revision=1,  # the release's rope type and non-causal decoder (LTX2_ROPE, LTX2_VAE)
        ),
        Preset(
            name="qwen-image",
            source="Qwen-Image",
            pipeline="QwenImagePipeline",
            parts=QWEN_IMAGE_PARTS,
            # guidance is Qwen's true CFG scale (against the negative prompt, "" by default)
            defaults={"width": 1328, "height": 1328, "steps": 50, "guidance": 4.0},
        ),
        Preset(  # Qwen-Image's 20B transformer trained for instruction edits; the text encoder also sees the image
            name="qwen-image-edit",
            source="Qwen-Image-Edit",
            pipeline="QwenImageEditPipeline",
            parts={**QWEN_IMAGE_PARTS, "processor": Proc(Tok("qwen", 151665, 32768), QWEN25_VL_IMAGES)},
            # the pipeline's own: 50 steps, true CFG 4.0, outputs of 1024² pixels
            defaults={"width": 1024, "height": 1024, "steps": 50, "guidance": 4.0},
        ),
        Preset(  # the same weights' shapes (Qwen-Image-Edit-2509/2511), whose pipeline takes 1-3 input pictures
            name="qwen-image-edit-plus",
            source="Qwen-Image-Edit-2509",
            pipeline="QwenImageEditPlusPipeline",
            parts={**QWEN_IMAGE_PARTS, "processor": Proc(Tok("qwen", 151665, 32768), QWEN25_VL_IMAGES)},
            defaults={"width": 1024, "height": 1024, "steps": 50, "guidance": 4.0},  # the pipeline's own
        ),
    )
}


def get_preset(key: str) -> Preset:
    """The preset named ``key``; an unknown name is an error that lists the known ones."""
    preset = PRESETS.get(key.strip())
    if preset is None:
        known = ", ".join(f"random:{k}" for k in PRESETS)
        raise PipelineError(f"unknown preset 'random:{key}'; presets: {known}")
    return preset


def folder_name(preset: Preset) -> str:
    """The preset's cache folder: its name carries the tables' version and the preset's revision."""
    return f"random-{preset.name}-{PRESET_VERSION}" + (f".{preset.revision}" if preset.revision else "")
