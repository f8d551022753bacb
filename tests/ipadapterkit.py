"""An IP-Adapter for the tests, built in code for the ``tiny`` model (no download).

Its two parts, in the layout h94/IP-Adapter ships (``models/``): a weights file in diffusers'
``load_ip_adapter`` format (``image_proj.*``: the ``ImageProjection`` linear from the encoder's
embedding to four tokens of tiny's cross-attention width, and its norm; ``ip_adapter.N.to_k_ip`` /
``.to_v_ip``: a key and value projection for each cross-attention processor of tiny's UNet, numbered
as diffusers' ``_convert_ip_adapter_attn_to_diffusers`` counts them, 1, 3, 5, ...) and, beside it,
``image_encoder/``: a tiny ``CLIPVisionModelWithProjection`` written by ``save_pretrained``.
Random weights, large enough that the reference image visibly steers tiny's output.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np


def png(seed: int, side: int = 48) -> str:
    """A reference picture (random pixels from ``seed``) as base64 PNG text, as a request carries it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def build_ip_adapter(out: Path, *, seed: int, projection_dim: int = 16) -> Path:
    """Write ``out/ip-adapter_tiny.safetensors`` and ``out/image_encoder/``; returns the weights file."""
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from diffusiond.pipelines.tiny import ensure_tiny

    unet = UNet2DConditionModel.from_pretrained(str(ensure_tiny() / "unet"))
    cfg = unet.config
    cross = cfg.cross_attention_dim
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8, projection_dim=projection_dim))
        tensors = {"image_proj.proj.weight": torch.randn(4 * cross, projection_dim) * 0.5,
                   "image_proj.proj.bias": torch.randn(4 * cross) * 0.1,
                   "image_proj.norm.weight": torch.ones(cross), "image_proj.norm.bias": torch.zeros(cross)}
        key_id = 1
        for name in unet.attn_processors:
            if name.endswith("attn1.processor"):
                continue
            if name.startswith("mid_block"):
                hidden = cfg.block_out_channels[-1]
            elif name.startswith("up_blocks"):
                hidden = list(reversed(cfg.block_out_channels))[int(name[len("up_blocks.")])]
            else:
                hidden = cfg.block_out_channels[int(name[len("down_blocks.")])]
            for proj in ("to_k_ip", "to_v_ip"):
                tensors[f"ip_adapter.{key_id}.{proj}.weight"] = torch.randn(hidden, cross) * 0.5
            key_id += 2
    encoder.save_pretrained(str(out / "image_encoder"), safe_serialization=True)
    weights = out / "ip-adapter_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights))
    return weights
