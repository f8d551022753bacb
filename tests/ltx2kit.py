"""A tiny LTX-2 pipeline built in code, saved as the folder a user's LTX-2 checkpoint would be, for issue 30.

LTX2Pipeline makes a video and its sound track in one denoising loop: a Gemma 3 text encoder whose every
layer's hidden states feed two text connectors (one per stream), a dual-stream transformer (video tokens and
audio tokens, with cross-attention between them), the LTX-2 video VAE, an audio VAE that decodes mel
spectrograms and a vocoder that turns them into a waveform. Every one of them here is the real diffusers or
transformers class at widths of a few channels, about 1 MB in all; the video VAE keeps the released model's
compression (a 4x4 patchify and three 2x scalings: 32x in space, 8x in time), latent channels (128) and
decoder padding (by reflection), so its frame rule (8k+1), size rules (multiples of 32, at least 64) and previews
(none) are the real ones, and the vocoder upsamples the audio VAE's 100 mel frames a second by 160, so the
waveform's length matches the video's duration at its declared 16 kHz.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffusiond.pipelines.gen_tokenizers import t5_tokenizer

TEXT_WIDTH = 32  # Gemma's hidden size: the connectors' heads x head width must equal it
SAMPLE_RATE = 16000
LATENT = 128  # the released video VAE's latent channels, LTX-Video's too: what tells previews the two apart (issue 30)


def _gemma(vocab: int) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": vocab, "hidden_size": TEXT_WIDTH, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 256,
                     "sliding_window": 64, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3))


def _modules(layers: int) -> dict[str, Any]:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=LATENT, out_channels=LATENT, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
        qk_norm="rms_norm_across_heads", caption_channels=TEXT_WIDTH, rope_double_precision=False, rope_type="split")
    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_WIDTH, text_proj_in_factor=layers + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split")
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        latent_channels=LATENT, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), patch_size=4, patch_size_t=1,
        # as the released config says: diffusers would count every scaling block as 2x in space and in time
        spatial_compression_ratio=32, temporal_compression_ratio=8, decoder_causal=False)
    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, in_channels=2, resolution=32,
        latent_channels=2, mel_bins=8, sample_rate=SAMPLE_RATE, mel_hop_length=160)
    torch.manual_seed(0)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[8, 8, 20],
        upsample_factors=[4, 4, 10], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=SAMPLE_RATE)
    return {"transformer": transformer, "connectors": connectors, "vae": vae, "audio_vae": audio_vae,
            "vocoder": vocoder}


def build_ltx2(out: Path) -> Path:
    """LTX2Pipeline with random weights, saved (safetensors) in ``out``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    tokenizer = t5_tokenizer(1024, extra_ids=0, max_length=64)
    with torch.random.fork_rng(devices=[]):
        text_encoder = _gemma(len(tokenizer))
        parts = _modules(text_encoder.config.text_config.num_hidden_layers)
    # the released scheduler's resolution-dependent shift (LTX-Video's numbers, which LTX-2 keeps)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    pipe = LTX2Pipeline(scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer, **parts)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out
