"""The embedded ``tiny-video`` model: a real LTX-Video pipeline with random weights, built in code.

What ``tiny`` is for images, this is for video: the daemon's video path (frames through the
worker, the arena, the MP4/GIF/WebP encoders) runs the real diffusers code (T5 tokenizer and
encoder, ``LTXPipeline``, the LTX video transformer, its causal video VAE, a flow-matching
scheduler, ``from_pretrained``) on a CPU with no network. It is about 2 MB, saved once as
safetensors into ``<cache>/models/tiny-video-v1`` and loaded back through the folder loader.

Why LTX: of the diffusers text-to-video pipelines it is the one whose models load without the
optional ``accelerate`` package (Wan's transformer keeps modules in float32, which needs it), and
its VAE compresses like the real model, 32x in space and 8x in time, so a 64x64, 9-frame clip
denoises a 2x2x2 latent and a batch takes well under a second on two cores. The real model's
frame rule holds too: ``num_frames`` must be 8k+1 (1, 9, 17, 25...); others are refused by name.
Outputs are structured noise: the weights are random, the numerics are not faked.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffusiond.pipelines.base import RequestDefaults
from diffusiond.pipelines.gen_tokenizers import t5_tokenizer
from diffusiond.pipelines.modelcache import BUILT_FOLDERS, ensure_built

# Its folder in the cache (a new name there when the architecture or the saved layout changes).
TINY_VIDEO_VERSION = BUILT_FOLDERS["tiny-video"]
# Quick on a CPU; 64 is the smallest side above one latent pixel (LTX sizes are multiples of 32).
DEFAULTS: RequestDefaults = {"width": 64, "height": 64, "steps": 4, "guidance": 3.0, "num_frames": 9, "fps": 8}
# LTX's own default prompt length; the encoder is so small that 128 positions cost nothing.
MAX_TOKENS = 128
# Tokenizer pieces: enough for printable ASCII and every lowercase letter pair; no sentinels.
VOCAB_PIECES = 1024


def ensure_tiny_video(cache_dir: Path | None = None) -> Path:
    """The tiny-video folder under ``<cache_dir or cache_root()>/models``, built on first use."""
    return ensure_built(TINY_VIDEO_VERSION, _build, cache_dir)


def _build(out: Path) -> None:
    """Build the pipeline with fixed seeds and save it (safetensors only) into ``out``."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline
    from diffusers import LTXVideoTransformer3DModel as Transformer
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer(VOCAB_PIECES, extra_ids=0, max_length=MAX_TOKENS)
    with torch.random.fork_rng(devices=[]):  # building must not disturb the caller's global RNG
        torch.manual_seed(0)
        text_encoder = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer),
                d_model=32,
                d_ff=64,
                d_kv=8,
                num_heads=4,
                num_layers=2,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id,
            )
        )
        torch.manual_seed(0)
        transformer = Transformer(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=2,
            caption_channels=32,
        )
        torch.manual_seed(0)
        # LTX's compression with tiny widths: a 4x4 patchify and three 2x space-time scalings
        # give 32x in space and 8x in time, as in the released model.
        vae = AutoencoderKLLTXVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=8,
            block_out_channels=(8, 16, 16, 16),
            decoder_block_out_channels=(8, 16, 16, 16),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            patch_size=4,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        )
    # The released model's scheduler settings (resolution-dependent shift, stretched last sigma).
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=1024,
        base_shift=0.95,
        max_image_seq_len=4096,
        max_shift=2.05,
        shift=1.0,
        shift_terminal=0.1,
        use_dynamic_shifting=True,
    )
    pipe = LTXPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(str(out), safe_serialization=True)
