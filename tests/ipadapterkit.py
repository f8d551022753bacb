"""IP-Adapters for the tests, built in code for the ``tiny`` and ``tiny-flux`` models (no download).

Its two parts, in the layout h94/IP-Adapter ships (``models/``): a weights file in diffusers'
``load_ip_adapter`` format (``image_proj.*``: the ``ImageProjection`` linear from the encoder's
embedding to four tokens of tiny's cross-attention width, and its norm; ``ip_adapter.N.to_k_ip`` /
``.to_v_ip``: a key and value projection for each cross-attention processor of tiny's UNet, numbered
as diffusers' ``_convert_ip_adapter_attn_to_diffusers`` counts them, 1, 3, 5, ...) and, beside it,
``image_encoder/``: a tiny ``CLIPVisionModelWithProjection`` written by ``save_pretrained``.
Random weights, large enough that the reference image visibly steers tiny's output. The FLUX one
(``build_flux_ip_adapter``) is XLabs' layout, the one FluxPipeline's ``load_ip_adapter`` reads.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from daemonkit import first_output


def png(seed: int, side: int = 48) -> str:
    """A reference picture (random pixels from ``seed``) as base64 PNG text, as a request carries it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def entry(name: str, seed: int, scale: float = 1.0) -> dict[str, Any]:
    """One ``ip_adapter`` entry: adapter ``name`` with ``png(seed)`` as its picture."""
    return {"name": name, "image": png(seed), "scale": scale}


async def output(s: aiohttp.ClientSession, body: dict[str, Any], *entries: dict[str, Any], **extra: Any) -> bytes:
    """The first output of ``body`` with ``extra`` fields and ``entries`` as its ``ip_adapter`` (none: no field)."""
    return await first_output(s, {**body, **extra, **({"ip_adapter": list(entries)} if entries else {})})


def build_ip_adapter(out: Path, *, seed: int, projection_dim: int = 16) -> Path:
    """Write ``out/ip-adapter_tiny.safetensors`` and ``out/image_encoder/``; returns the weights file."""
    import torch
    from diffusers import UNet2DConditionModel

    from diffusiond.pipelines.tiny import ensure_tiny

    unet = UNet2DConditionModel.from_pretrained(str(ensure_tiny() / "unet"))
    cfg = unet.config
    cross = cfg.cross_attention_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = _encoder(projection_dim)
        tensors = _projection("image_proj", cross, projection_dim)
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
    return _save(out, "ip-adapter_tiny.safetensors", encoder, tensors)


def build_flux_ip_adapter(out: Path, *, seed: int, projection_dim: int = 16) -> Path:
    """Write ``out/ip-adapter_tiny_flux.safetensors`` in XLabs' layout (flux-ip-adapter.safetensors'
    names: ``ip_adapter_proj_model.*``, the projection to four tokens of tiny-flux's joint attention
    width; ``double_blocks.N.processor.ip_adapter_double_stream_{k,v}_proj``, a key and value
    projection with biases for each double-stream block) and ``out/image_encoder/``."""
    import torch

    from diffusiond.pipelines.tiny_flux import TRANSFORMER

    cross = int(TRANSFORMER["joint_attention_dim"])
    inner = int(TRANSFORMER["num_attention_heads"]) * int(TRANSFORMER["attention_head_dim"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = _encoder(projection_dim)
        tensors = _projection("ip_adapter_proj_model", cross, projection_dim)
        for block in range(int(TRANSFORMER["num_layers"])):
            for proj in ("k", "v"):
                at = f"double_blocks.{block}.processor.ip_adapter_double_stream_{proj}_proj"
                tensors[f"{at}.weight"] = torch.randn(inner, cross) * 0.5
                tensors[f"{at}.bias"] = torch.randn(inner) * 0.1
    return _save(out, "ip-adapter_tiny_flux.safetensors", encoder, tensors)


def _encoder(projection_dim: int) -> Any:
    """A tiny CLIP vision encoder (32-pixel pictures, 8-pixel patches) with random weights."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    return CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=8, projection_dim=projection_dim))


def _projection(prefix: str, cross: int, projection_dim: int) -> dict[str, Any]:
    """The ``ImageProjection`` tensors: the encoder's embedding to four tokens ``cross`` wide, and their norm."""
    import torch

    return {f"{prefix}.proj.weight": torch.randn(4 * cross, projection_dim) * 0.5,
            f"{prefix}.proj.bias": torch.randn(4 * cross) * 0.1,
            f"{prefix}.norm.weight": torch.ones(cross), f"{prefix}.norm.bias": torch.zeros(cross)}


def _save(out: Path, filename: str, encoder: Any, tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    encoder.save_pretrained(str(out / "image_encoder"), safe_serialization=True)
    weights = out / filename
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights))
    return weights
