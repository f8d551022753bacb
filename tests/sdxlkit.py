"""A tiny SDXL pipeline built in code, for the tests that need the SDXL family's own code paths.

SDXL differs from SD 1.5 where the adapters over it differ: two CLIP text encoders whose hidden
states are concatenated (the second one projected, its pooled output fed to the UNet), and the
UNet's ``text_time`` added conditioning (the original and target sizes and the crop, embedded with
the pooled text). Those are kept; everything else is as small as diffusers' own tests make it.
The VAE has two levels (a 2x one, like ``tiny``'s), so a 64x64 picture is a 32x32 latent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEXT_WIDTH = 32  # each encoder's; the UNet's cross-attention takes both, concatenated
TIME_EMBED = 8  # the added size/crop conditioning: 6 numbers embedded at this width each
UNET: dict[str, Any] = {
    "block_out_channels": (32, 64), "layers_per_block": 1, "sample_size": 32, "in_channels": 4, "out_channels": 4,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"), "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "attention_head_dim": (2, 4), "use_linear_projection": True, "addition_embed_type": "text_time",
    "addition_time_embed_dim": TIME_EMBED, "transformer_layers_per_block": (1, 1), "norm_num_groups": 32,
    "projection_class_embeddings_input_dim": 6 * TIME_EMBED + TEXT_WIDTH, "cross_attention_dim": 2 * TEXT_WIDTH,
}  # fmt: skip


def build_sdxl(out: Path) -> Path:
    """A tiny ``StableDiffusionXLPipeline`` saved (safetensors) in ``out``; 64x64 in 2 steps is well
    under a second on a CPU."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from diffusiond.pipelines.gen_tokenizers import clip_tokenizer

    tok = clip_tokenizer(1024, max_length=77)

    def text_config() -> Any:
        return CLIPTextConfig(vocab_size=len(tok), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=77, projection_dim=TEXT_WIDTH,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(**UNET)
        torch.manual_seed(0)
        clip = CLIPTextModel(text_config())
        torch.manual_seed(1)
        clip2 = CLIPTextModelWithProjection(text_config())
        torch.manual_seed(0)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32),
                            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                            layers_per_block=1, norm_num_groups=32, sample_size=64, force_upcast=False)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       timestep_spacing="leading", steps_offset=1)
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=clip, text_encoder_2=clip2, tokenizer=tok, tokenizer_2=tok,
                                     unet=unet, scheduler=scheduler)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out
