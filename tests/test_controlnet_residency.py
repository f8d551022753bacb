"""A model's size, as residency counts it, includes what its worker keeps beside it (report 30 #4).

ControlNets, IP-Adapter image encoders and upscalers are loaded once per worker onto the model's device and
follow it to host memory and back, so they are part of what the model holds: ``device_bytes`` (and the
``--device-memory`` budget) counted the pipeline alone, and at real size a 6.6 GB FLUX union ControlNet sat
outside the budget. The expected figure is read off each module loaded here the way its own library loads it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from daemonkit import get, http, shared_daemon

from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.base import weight_bytes


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def test_device_bytes_count_controlnets_ip_adapter_encoders_and_upscalers(
        tmp_path: Path, model_cache: Path, controlnet_dir: Path, ip_adapter_file: Path, upscaler_file: Path) -> None:
    from diffusers import ControlNetModel
    from transformers import CLIPVisionModelWithProjection

    from diffusiond.pipelines.upscalers import load

    args = ["--model", "tiny", "--controlnet", f"edges={controlnet_dir}", "--ip-adapter", f"style={ip_adapter_file}",
            "--upscaler", f"esr={upscaler_file}"]

    async def models() -> dict:  # type: ignore[type-arg]
        async with http(d.socket) as s:
            return (await get(s, "/v1/models"))[1]["data"][0]  # type: ignore[no-any-return]

    with shared_daemon(tmp_path, args, model_cache) as d:
        entry = asyncio.run(models())
    dtype = getattr(torch, entry["dtype"])
    model = weight_bytes(load_pipeline("tiny", device="cpu", dtype=entry["dtype"]))
    extras = [_bytes(ControlNetModel.from_pretrained(str(controlnet_dir), torch_dtype=dtype)),
              _bytes(CLIPVisionModelWithProjection.from_pretrained(str(ip_adapter_file.parent / "image_encoder"),
                                                                   torch_dtype=dtype)),
              _bytes(load(str(upscaler_file)).model)]
    assert entry["residency"] == "device"
    assert entry["device_bytes"] == model + sum(extras), (entry["device_bytes"], model, extras)
