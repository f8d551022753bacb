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
from typing import Any


def png(seed: int, side: int = 64) -> str:
    """A base64 PNG of 8x8-pixel random colour blocks: a control picture whose every pixel matters."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.kron(blocks, np.ones((8, 8, 1), dtype=np.uint8))).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _given(config: Any) -> dict[str, Any]:
    """A model's config to build another from: without diffusers' list of the values left at their
    defaults, which ``from_config`` would otherwise put back over the ones given here."""
    return {k: v for k, v in config.items() if k != "_use_default_values"}


def mask_png(side: int = 64) -> str:
    """A base64 greyscale PNG mask without alpha: white (the centre square, half the side) is repainted."""
    import numpy as np
    from PIL import Image

    a = np.zeros((side, side), np.uint8)
    a[side // 4: 3 * side // 4, side // 4: 3 * side // 4] = 255
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def build_controlnet(out: Path, *, seed: int, pipeline: Path | None = None, union: bool = False) -> Path:
    """Write a diffusers ControlNet folder into ``out`` for the UNet pipeline in folder ``pipeline``
    (default: tiny); returns it. Its conditioning embedding halves the picture once: tiny's VAE and
    the tiny SDXL's are 2x (a real 8x VAE takes three halvings). ``union``: a ``ControlNetUnionModel``
    (SDXL's, 6 control modes) whose mode transformer is as wide as the UNet's first block, as it must be."""
    import torch
    from diffusers import ControlNetModel, ControlNetUnionModel, UNet2DConditionModel

    from diffusiond.pipelines.tiny import ensure_tiny

    unet = UNet2DConditionModel.from_pretrained(str((pipeline or ensure_tiny()) / "unet"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if union:
            width = unet.config.block_out_channels[0]
            cn = ControlNetUnionModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
            copied = cn.state_dict()
            cn = ControlNetUnionModel.from_config({**_given(cn.config), "num_trans_channel": width,
                                                   "num_proj_channel": width, "num_trans_head": 2})
            own = cn.state_dict()
            cn.load_state_dict({k: v for k, v in copied.items() if k in own and own[k].shape == v.shape}, strict=False)
        else:
            cn = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
        zero = [*cn.controlnet_down_blocks, cn.controlnet_mid_block, cn.controlnet_cond_embedding.conv_out,
                *([cn.spatial_ch_projs] if union else [])]
        for conv in zero:
            torch.nn.init.normal_(conv.weight, std=0.05)
            torch.nn.init.normal_(conv.bias, std=0.05)
    cn.save_pretrained(str(out), safe_serialization=True)
    return out


def build_flux_controlnet(out: Path, *, seed: int, pipeline: Path | None = None, num_mode: int | None = None) -> Path:
    """A FluxControlNetModel folder for the FLUX pipeline in folder ``pipeline`` (default: tiny-flux),
    in InstantX's layout (no hint block: the pipeline puts the picture through the model's VAE and
    packs it like the latents), one double- and one single-stream block copied from the transformer.
    ``num_mode``: a union one (InstantX's union layout), its mode embedding random as trained ones are not zero."""
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
        if num_mode is not None:
            copied = cn.state_dict()
            cn = FluxControlNetModel.from_config({**_given(cn.config), "num_mode": num_mode})
            cn.load_state_dict(copied, strict=False)
        for linear in [*cn.controlnet_blocks, *cn.controlnet_single_blocks, cn.controlnet_x_embedder]:
            torch.nn.init.normal_(linear.weight, std=0.05)
            torch.nn.init.normal_(linear.bias, std=0.05)
    cn.save_pretrained(str(out), safe_serialization=True)
    return out
