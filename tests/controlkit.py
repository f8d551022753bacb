"""ControlNets for the tests, built in code from their model's own denoiser (no download).

``ControlNetModel.from_unet`` copies a UNet's encoder (``tiny``'s, or the tiny SDXL's of sdxlkit.py,
``text_time`` conditioning and all); ``FluxControlNetModel.from_transformer`` copies the first blocks
of a FLUX transformer (``tiny-flux``'s). Their zero layers (the residual outputs, and the last one of
the picture's embedding) start at zero, as in training, so such a ControlNet would change nothing,
or nothing that depends on the picture: they are filled with small random values here, so the
control image really steers the output. Saved with ``save_pretrained`` (safetensors), the folder
layout a user downloads, and loaded back by the daemon through ``--controlnet NAME=PATH``.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path


def png(seed: int, side: int = 64) -> str:
    """A base64 PNG of 8x8-pixel random colour blocks: a control picture whose every pixel matters."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.kron(blocks, np.ones((8, 8, 1), dtype=np.uint8))).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def mask_png(side: int = 64) -> str:
    """A base64 greyscale PNG mask without alpha: white (the centre square, half the side) is repainted."""
    import numpy as np
    from PIL import Image

    a = np.zeros((side, side), np.uint8)
    a[side // 4: 3 * side // 4, side // 4: 3 * side // 4] = 255
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def build_controlnet(out: Path, *, seed: int, pipeline: Path | None = None) -> Path:
    """Write a diffusers ControlNet folder into ``out`` for the UNet pipeline in folder ``pipeline``
    (default: tiny); returns it. Its conditioning embedding halves the picture once: tiny's VAE and
    the tiny SDXL's are 2x (a real 8x VAE takes three halvings)."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    from diffusiond.pipelines.tiny import ensure_tiny

    unet = UNet2DConditionModel.from_pretrained(str((pipeline or ensure_tiny()) / "unet"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cn = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
        zero = [*cn.controlnet_down_blocks, cn.controlnet_mid_block, cn.controlnet_cond_embedding.conv_out]
        for conv in zero:
            torch.nn.init.normal_(conv.weight, std=0.05)
            torch.nn.init.normal_(conv.bias, std=0.05)
    cn.save_pretrained(str(out), safe_serialization=True)
    return out


def build_flux_controlnet(out: Path, *, seed: int, pipeline: Path | None = None) -> Path:
    """A FluxControlNetModel folder for the FLUX pipeline in folder ``pipeline`` (default: tiny-flux),
    in InstantX's layout (no hint block: the pipeline puts the picture through the model's VAE and
    packs it like the latents), one double- and one single-stream block copied from the transformer."""
    import torch
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    from diffusiond.pipelines.tiny_flux import ensure_tiny_flux

    transformer = FluxTransformer2DModel.from_pretrained(str((pipeline or ensure_tiny_flux()) / "transformer"))
    c = transformer.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cn = FluxControlNetModel.from_transformer(transformer, num_layers=1, num_single_layers=1,
                                                  attention_head_dim=c.attention_head_dim,
                                                  num_attention_heads=c.num_attention_heads)
        for linear in [*cn.controlnet_blocks, *cn.controlnet_single_blocks, cn.controlnet_x_embedder]:
            torch.nn.init.normal_(linear.weight, std=0.05)
            torch.nn.init.normal_(linear.bias, std=0.05)
    cn.save_pretrained(str(out), safe_serialization=True)
    return out
