"""``random:<preset>``: real diffusers architectures at their published sizes, with random weights.

Benchmarking the daemon on a GPU needs the compute, memory and output sizes of real models, and
nothing can be downloaded. A preset is the published model's shape written down as data (each
component's class and config numbers, the tokenizer's vocabulary size), built in code on the
target device in the target dtype (a 12B transformer initialised on an H200 takes seconds; on two
CPU cores it would take minutes) with a generated tokenizer of the real vocabulary size. It is
then saved as safetensors into ``<cache>/models/random-<preset>-v1`` and loaded back through the
ordinary folder loader, so benchmarks measure the path real models take. Saving tens of GB can
be slow: option ``save=0`` skips the round trip and serves the pipeline as built.

The outputs are noise. Everything a user sees says so: the pipeline's name, its
``capabilities.synthetic_weights``, and a warning logged at every load.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from diffusiond.pipelines.base import PipelineError, RequestDefaults
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.gen_tokenizers import clip_tokenizer, t5_tokenizer
from diffusiond.pipelines.loaders import load_folder
from diffusiond.pipelines.modelcache import ensure_built

log = logging.getLogger(__name__)

# Bump when a table below changes: an old cache folder is then ignored.
PRESET_VERSION = "v1"
NOTICE = "random weights: outputs are noise; for benchmarks only"


@dataclass(frozen=True)
class Net:
    """A model: a diffusers or transformers class name and its published config."""

    cls: str
    config: Mapping[str, Any]


@dataclass(frozen=True)
class Tok:
    """A generated tokenizer: ``size`` is ``len(tokenizer)`` of the published one."""

    kind: Literal["clip", "t5"]
    size: int
    max_length: int
    extra_ids: int = 0  # t5: sentinel tokens, included in ``size``
    pad: str | None = None  # clip: SDXL's second tokenizer pads with "!"


@dataclass(frozen=True)
class Sched:
    cls: str
    config: Mapping[str, Any]


Part = Net | Tok | Sched | None


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

CLIP_TOKENIZER = Tok("clip", 49408, 77)

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
            parts={
                "transformer": Net("FluxTransformer2DModel", FLUX_DEV_TRANSFORMER),
                "vae": Net("AutoencoderKL", FLUX_VAE),
                "text_encoder": Net("CLIPTextModel", CLIP_L),
                "text_encoder_2": Net("T5EncoderModel", T5_XXL),
                "tokenizer": CLIP_TOKENIZER,
                "tokenizer_2": Tok("t5", 32100, 512, extra_ids=100),
                "scheduler": Sched("FlowMatchEulerDiscreteScheduler", FLUX_SCHEDULER),
                "image_encoder": None,
                "feature_extractor": None,
            },
            defaults={"width": 1024, "height": 1024, "steps": 28, "guidance": 3.5},
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
    )
}


# --- building ------------------------------------------------------------------------------------


def get_preset(key: str) -> Preset:
    """The preset named ``key``; an unknown name is an error that lists the known ones."""
    preset = PRESETS.get(key.strip())
    if preset is None:
        known = ", ".join(f"random:{k}" for k in PRESETS)
        raise PipelineError(f"unknown preset 'random:{key}'; presets: {known}")
    return preset


def folder_name(preset: Preset) -> str:
    return f"random-{preset.name}-{PRESET_VERSION}"


def _class(name: str) -> type[Any]:
    import diffusers
    import transformers

    cls = getattr(diffusers, name, None) or getattr(transformers, name, None)
    if not isinstance(cls, type):
        raise PipelineError(f"neither diffusers nor transformers has a class {name!r} (too old a version?)")
    return cls


@contextmanager
def _init_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters on ``device`` in ``dtype`` directly: no float32 copy, no host-side init."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_part(part: Part, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> Any:
    """One component; on ``meta`` a model costs no memory (for counting parameters)."""
    if part is None:
        return None
    if isinstance(part, Tok):
        if part.kind == "clip":
            pad = {"pad_token": part.pad} if part.pad else {}
            return clip_tokenizer(part.size, max_length=part.max_length, **pad)
        return t5_tokenizer(part.size - part.extra_ids, extra_ids=part.extra_ids, max_length=part.max_length)
    cls = _class(part.cls)
    if isinstance(part, Sched):
        return cls.from_config(dict(part.config))
    with _init_on(torch.device(device), dtype):
        config_class = getattr(cls, "config_class", None)
        if config_class is not None and cls.__module__.startswith("transformers"):
            model = cls(config_class(**part.config))
        else:
            model = cls(**part.config)
    return model.eval()


def parameter_counts(preset: Preset) -> dict[str, int]:
    """Parameters per model component, counted on the meta device (no memory, well under a second)."""
    counts: dict[str, int] = {}
    for key, part in preset.parts.items():
        if isinstance(part, Net):
            counts[key] = sum(p.numel() for p in build_part(part, "meta").parameters())
    return counts


def build_pipeline(preset: Preset, device: torch.device | str, dtype: torch.dtype) -> Any:
    """The diffusers pipeline with random weights, each model initialised on ``device``."""
    dev = torch.device(device)
    components: dict[str, Any] = {}
    rng_devices = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):  # leave the caller's RNG state alone
        for seed, (key, part) in enumerate(preset.parts.items()):
            torch.manual_seed(seed)
            components[key] = build_part(part, dev, dtype)
    return _class(preset.pipeline)(**components, **preset.pipeline_kwargs)


def _save(preset: Preset, out: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Build on the device, save as safetensors, and free the device before the load."""
    pipe = build_pipeline(preset, device, dtype)
    pipe.save_pretrained(str(out), safe_serialization=True)
    del pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synthetic_name(name: str | None, preset: Preset) -> str:
    """A name that says "random" wherever it is shown, whatever the config called the model."""
    if not name:
        return f"random:{preset.name}"
    return name if "random" in name.lower() else f"{name} (random weights)"


def load_preset(
    key: str,
    *,
    name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    options: Mapping[str, str],
    cache_dir: Path | None = None,
) -> DiffusersPipeline:
    """Build (or find in the cache) ``random:<key>`` and wrap it like any loaded model."""
    preset = get_preset(key)
    save = options.get("save", "1")
    if save not in {"0", "1"}:
        raise PipelineError(f"option save must be 0 or 1, not {save!r}")
    label = synthetic_name(name, preset)
    log.warning("%s (%s shapes): %s", label, preset.source, NOTICE)
    if save == "0":
        return DiffusersPipeline(
            build_pipeline(preset, device, dtype), name=label, device=device, dtype=dtype, options=options,
            defaults=preset.defaults, synthetic_weights=True,
        )  # fmt: skip
    if preset.needs_accelerate and importlib.util.find_spec("accelerate") is None:
        raise PipelineError(
            f"random:{preset.name} loads back through from_pretrained, which for {preset.pipeline} needs the "
            "accelerate package: install it, or set option save=0 to use the model as built"
        )
    folder = ensure_built(folder_name(preset), lambda out: _save(preset, out, device, dtype), cache_dir)
    return load_folder(
        folder, name=label, device=device, dtype=dtype, options=options, defaults=preset.defaults,
        synthetic_weights=True,
    )  # fmt: skip
