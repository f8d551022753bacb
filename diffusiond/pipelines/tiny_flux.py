"""The embedded ``tiny-flux`` model: a real FLUX pipeline with random weights, built in code.

What ``tiny`` is for the SD family, this is for flow matching: the rollout path of issue 29
(``flow-sde`` with its log-probabilities, trajectories of packed latents, live LoRA updates on a
transformer) runs the real diffusers code (``FluxPipeline``, ``FluxTransformer2DModel`` with its
double- and single-stream blocks and rotary embeddings, CLIP and T5 encoders with generated
tokenizers, ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler``, ``from_pretrained``) on a CPU
with no network. The released model's shapes are kept where they decide the code path: 16 latent
channels packed 2x2 into 64-wide tokens, an 8x VAE, three rope axes, a guidance embedding (FLUX.1-dev
is guidance-distilled). It is well under 1 MB, saved once as safetensors into
``<cache>/models/tiny-flux-v1`` and loaded back through the folder loader; a 64x64 image in 4 steps
takes a fraction of a second on a CPU. Outputs are structured noise: the weights are random, the
numerics are not faked.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffusiond.pipelines.base import RequestDefaults
from diffusiond.pipelines.gen_tokenizers import clip_tokenizer, t5_tokenizer
from diffusiond.pipelines.modelcache import BUILT_FOLDERS, ensure_built

# Its folder in the cache (a new name there when the architecture or the saved layout changes).
TINY_FLUX_VERSION = BUILT_FOLDERS["tiny-flux"]
DEFAULTS: RequestDefaults = {"width": 64, "height": 64, "steps": 4, "guidance": 3.5}
# Token counts: CLIP's usual 77; T5's 512 is what FluxPipeline pads every prompt to (its default).
CLIP_TOKENS, T5_TOKENS = 77, 512
VOCAB = 1024  # both tokenizers: every byte (CLIP) or printable character (T5) plus letter n-grams
# The transformer: one double-stream and one single-stream block, two heads of 16; the rope axes
# (4, 6, 6) add up to the head dim as FLUX's (16, 56, 56) add up to its 128.
TRANSFORMER = {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1,
               "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
               "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}
# Attention projections of both block kinds: what a FLUX LoRA (PEFT, diffusers naming) targets.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def ensure_tiny_flux(cache_dir: Path | None = None) -> Path:
    """The tiny-flux folder under ``<cache_dir or cache_root()>/models``, built on first use."""
    return ensure_built(TINY_FLUX_VERSION, _build, cache_dir)


def _build(out: Path) -> None:
    """Build the pipeline with fixed seeds and save it (safetensors only) into ``out``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok = clip_tokenizer(VOCAB, max_length=CLIP_TOKENS)
    t5_tok = t5_tokenizer(VOCAB, extra_ids=0, max_length=T5_TOKENS)
    with torch.random.fork_rng(devices=[]):  # building must not disturb the caller's global RNG
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(**TRANSFORMER)
        torch.manual_seed(0)
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=CLIP_TOKENS, projection_dim=32,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id))
        torch.manual_seed(0)
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id))
        torch.manual_seed(0)
        # FLUX's VAE layout at tiny widths: four levels (8x down), 16 latent channels, FLUX's own
        # scaling and shift factors, so the pipeline's latent arithmetic is the released model's.
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1, norm_num_groups=8, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False)
    # FLUX.1-dev's scheduler config: a resolution-dependent shift of the sigmas.
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
        use_dynamic_shifting=True)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                        tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(str(out), safe_serialization=True)
