"""A tiny Qwen-Image-Edit pipeline built in code, saved as the folder a user's Qwen/Qwen-Image-Edit download is.

QwenImageEditPipeline: a QwenImageTransformer2DModel, the Wan 2.1-style AutoencoderKLQwenImage, and the whole
Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration, its vision tower included) as text encoder, which reads the
input picture through a Qwen2VLProcessor. The folder has the release's layout: ``processor/`` holds the
tokenizer's files beside ``preprocessor_config.json`` (the image processor's). The vocabulary is the generated
byte-level one at a few hundred tokens (its specials' ids written into the text encoder's config), and the image
processor keeps the input picture to at most ``MAX_PIXELS`` for the vision tower (the release's allows 12.8 MP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffusiond.pipelines.gen_tokenizers import QWEN_SPECIALS, qwen_tokenizer
from diffusiond.pipelines.qwen_edit import release_layout, stills_processor

Z = 4  # latent channels
MAX_PIXELS = 64 * 28 * 28  # what the vision tower sees of the input picture: at most 64 merged patches
TRANSFORMER = {"patch_size": 2, "in_channels": Z * 4, "out_channels": Z, "num_layers": 2, "attention_head_dim": 16,
               "num_attention_heads": 2, "joint_attention_dim": 32, "guidance_embeds": False,
               "axes_dims_rope": (4, 6, 6)}


def _text_encoder(tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                     "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1], "tokens_per_second": 2},
        vocab_size=len(tokenizer), image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config)


def _vae() -> Any:
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=Z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                  temperal_downsample=[False, True, True], latents_mean=[0.0] * Z,
                                  latents_std=[1.0] * Z)


def _transformer() -> Any:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(**TRANSFORMER)


def build_qwen_edit(out: Path, *, plus: bool = False) -> Path:
    """A tiny QwenImageEditPipeline saved (safetensors) in ``out``; ``plus``: a QwenImageEditPlusPipeline (2509/2511,
    several input pictures an edit) of the same parts, as the releases share Qwen-Image-Edit's."""
    import diffusers

    tokenizer = qwen_tokenizer(512, max_length=1024)
    with torch.random.fork_rng(devices=[]):
        parts = {"text_encoder": _text_encoder(tokenizer), "vae": _vae(), "transformer": _transformer()}
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
        shift_terminal=0.02, time_shift_type="exponential")
    processor = stills_processor(tokenizer, {"min_pixels": 4 * 28 * 28, "max_pixels": MAX_PIXELS})
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    pipe = cls(scheduler=scheduler, tokenizer=tokenizer, processor=processor, **parts)
    pipe.save_pretrained(str(out), safe_serialization=True)
    release_layout(out, processor)
    return out
