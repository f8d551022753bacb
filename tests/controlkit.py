"""ControlNets for the tests, built in code from the ``tiny`` model's UNet (no download).

``ControlNetModel.from_unet`` copies tiny's encoder; its zero convolutions (the residual outputs,
and the last one of the picture's embedding) start at zero, as in training, so such a ControlNet
would change nothing, or nothing that depends on the picture: they are filled with
small random values here, so the control image really steers the output. Saved with
``save_pretrained`` (safetensors), the folder layout a user downloads, and loaded back by the
daemon through ``--controlnet NAME=PATH``.
"""

from __future__ import annotations

from pathlib import Path


def build_controlnet(out: Path, *, seed: int) -> Path:
    """Write a diffusers ControlNet folder for tiny into ``out``; returns it. Its conditioning embedding
    halves the picture once: tiny's VAE passes pixels through at half size (a real SD VAE's 8 takes four)."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    from diffusiond.pipelines.tiny import ensure_tiny

    unet = UNet2DConditionModel.from_pretrained(str(ensure_tiny() / "unet"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cn = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
        zero = [*cn.controlnet_down_blocks, cn.controlnet_mid_block, cn.controlnet_cond_embedding.conv_out]
        for conv in zero:
            torch.nn.init.normal_(conv.weight, std=0.05)
            torch.nn.init.normal_(conv.bias, std=0.05)
    cn.save_pretrained(str(out), safe_serialization=True)
    return out
