"""Tiny Wan pipelines built in code, saved as folders a user's Wan checkpoint would be, for issue 30's tests.

Four shapes of the same family, each a few hundred kB: Wan 2.1 text-to-video (WanPipeline, a 16-channel-style
transformer that cannot take an image), Wan 2.2 TI2V (WanPipeline with ``expand_timesteps``: the Wan 2.2 VAE's
patchified, residual layout at 16x, and a transformer whose first latent frame can be the image's), and Wan 2.1
I2V (WanImageToVideoPipeline: mask and image latents beside the noise, and a CLIP vision encoder whose
penultimate hidden states feed the transformer's image cross-attention), and Wan 2.1 VACE (WanVACEPipeline, not
served: its folder and its GGUF stand for what is refused, issue 28). Loading one needs ``accelerate``
(Wan's transformer pins modules to float32), which the test environment has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffusiond.pipelines.gen_tokenizers import t5_tokenizer

Z = 4  # latent channels of the 2.1 VAE
Z22 = 8  # of the 2.2 one
CLIP_SIDE = 32  # the CLIP processor's crop: what the vision encoder sees


def _text(tokenizer: Any) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))


def _transformer(in_channels: int, out_channels: int, head_dim: int = 8, num_layers: int = 2, seed: int = 0,
                 **more: Any) -> Any:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim,
                                 in_channels=in_channels, out_channels=out_channels, text_dim=32, freq_dim=16,
                                 ffn_dim=32, num_layers=num_layers, rope_max_seq_len=32, **more)


def _vae(wan22: bool) -> Any:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    z = Z22 if wan22 else Z
    layout: dict[str, Any] = ({"is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
                               "scale_factor_spatial": 16} if wan22 else {})
    return AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.0] * z, latents_std=[1.0] * z,
                            **layout)


def _scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def build_wan(out: Path, kind: str, **shape: int) -> Path:
    """``kind``: ``t2v`` (Wan 2.1 T2V), ``a14b`` (Wan 2.2 T2V A14B: ``transformer_2``, the low-noise expert, and
    ``boundary_ratio``), ``ti2v`` (Wan 2.2 TI2V), ``i2v`` (Wan 2.1 I2V) or ``vace`` (Wan 2.1 VACE), saved in ``out``;
    ``shape``: the transformer's ``head_dim`` (16 makes it 32 wide, so that its linear layers' rows are whole
    Q8_0 blocks) and ``num_layers``."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    tokenizer = t5_tokenizer(1024, extra_ids=0, max_length=64)
    with torch.random.fork_rng(devices=[]):
        common = {"tokenizer": tokenizer, "text_encoder": _text(tokenizer), "scheduler": _scheduler()}
        if kind == "t2v":
            pipe: Any = WanPipeline(transformer=_transformer(Z, Z, **shape), vae=_vae(False), **common)
        elif kind == "a14b":  # two experts of their own weights, switched where the released T2V A14B switches
            first = _transformer(Z, Z, **shape)
            pipe = WanPipeline(transformer=first, transformer_2=_transformer(Z, Z, seed=1, **shape), vae=_vae(False),
                               boundary_ratio=0.875, **common)
        elif kind == "ti2v":
            pipe = WanPipeline(transformer=_transformer(Z22, Z22, **shape), vae=_vae(True), expand_timesteps=True,
                               **common)
        elif kind == "i2v":
            encoder, processor = clip_vision()
            # noise, then the first-frame mask (one channel per frame of a latent frame) and the image's latents
            # the image embedding is as wide as the transformer (5120 in the 14B, 2 heads of head_dim here)
            transformer = _transformer(Z + 4 + Z, Z, **shape, image_dim=encoder.config.hidden_size,
                                       added_kv_proj_dim=2 * shape.get("head_dim", 8))
            pipe = WanImageToVideoPipeline(transformer=transformer, vae=_vae(False), image_encoder=encoder,
                                           image_processor=processor, **common)
        elif kind == "vace":
            from diffusers import WanVACEPipeline, WanVACETransformer3DModel

            torch.manual_seed(0)
            # one VACE block beside the first of the main ones; its input: the control video's latents twice
            # (inactive and reactive) and the mask folded into the 8x8 pixels of each latent pixel
            transformer = WanVACETransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=shape.get("head_dim", 8),
                in_channels=Z, out_channels=Z, text_dim=32, freq_dim=16, ffn_dim=32,
                num_layers=shape.get("num_layers", 2), rope_max_seq_len=32, vace_layers=[0],
                vace_in_channels=2 * Z + 64)
            pipe = WanVACEPipeline(transformer=transformer, vae=_vae(False), **common)
        else:
            raise ValueError(kind)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def clip_vision() -> tuple[Any, Any]:
    """A tiny CLIPVisionModel and the CLIPImageProcessor of the released I2V folders, at a 32-pixel crop."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=CLIP_SIDE, patch_size=8))
    processor = CLIPImageProcessor(size={"shortest_edge": CLIP_SIDE}, crop_size={"height": CLIP_SIDE,
                                                                                  "width": CLIP_SIDE})
    return encoder, processor


_ORIGINAL: tuple[tuple[str, str], ...] = (
    # diffusers' name part -> the original Wan checkpoint's, applied in order to each name
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),  # Wan 2.1 I2V's CLIP embedding
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"\.add_([kv])_proj\.", r".\1_img."),  # and its image cross-attention
    (r"\.norm_added_k\.", ".norm_k_img."),
    (r"^(vace_blocks\.\d+)\.proj_in\.", r"\1.before_proj."),  # VACE's blocks
    (r"^(vace_blocks\.\d+)\.proj_out\.", r"\1.after_proj."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"\.scale_shift_table$", ".modulation"),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.to_([qkv])\.", r".\1."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"\.norm2\.", ".norm3."),  # diffusers' norm2 is the cross-attention's norm, the original's norm3
)


def original_state_dict(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """A Wan 2.1 / 2.2 transformer's weights (T2V, TI2V, I2V, VACE) under the original Wan checkpoint's names,
    as city96's and QuantStack's Wan GGUFs hold them (``prefix="model.diffusion_model."``: ComfyUI's): the inverse
    of diffusers' ``convert_wan_transformer_to_diffusers``, checked here by running it."""
    import re

    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    sd = {k: v.detach() for k, v in module.state_dict().items()}
    out = {}
    for name, tensor in sd.items():
        original = name
        for pattern, replacement in _ORIGINAL:
            original = re.sub(pattern, replacement, original)
        out[prefix + original] = tensor
    back = convert_wan_transformer_to_diffusers(dict(out))
    if back.keys() != sd.keys():
        raise AssertionError(f"no original Wan name for {sorted(back.keys() ^ sd.keys())}")
    return out
