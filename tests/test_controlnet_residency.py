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


def test_a_model_whose_controlnet_leaves_it_no_room_is_named_in_the_log_and_refused(
        tmp_path: Path, model_cache: Path, controlnet_dir: Path) -> None:
    """Its files' headers fit the budget, so it is placed and loaded; what its worker keeps beside it (counted from
    its READY on) does not. Its jobs are refused with the figures, and the log says why once."""
    import shutil

    from diffusiond.daemon.residency.sizes import model_weights
    from diffusiond.daemon.residency.units import format_bytes
    from diffusiond.pipelines.tiny import ensure_tiny

    folder = tmp_path / "big"
    shutil.copytree(ensure_tiny(), folder)
    alone = model_weights(folder, "float32").bytes_at("float32")
    from diffusers import ControlNetModel

    cn = _bytes(ControlNetModel.from_pretrained(str(controlnet_dir)))
    budget = alone + cn // 2
    args = ["--model", f"big={folder}", "--controlnet", f"edges={controlnet_dir}", "--device-memory", str(budget),
            "--no-persist"]

    async def job() -> tuple[int, dict]:  # type: ignore[type-arg]
        async with http(d.socket) as s, s.post("/v1/jobs", json={"prompt": "x", "model": "big", "width": 64,
                                                                 "height": 64, "steps": 1}) as r:
            return r.status, await r.json()

    (tmp_path / "d").mkdir()
    with shared_daemon(tmp_path / "d", args, model_cache) as d:
        status, body = asyncio.run(job())
        log = d.log()
    assert status == 400 and body["error"]["code"] == "model_too_large", body
    said = (f"model big holds {format_bytes(alone + cn)} on cpu once loaded (its files' headers counted "
            f"{format_bytes(alone)}), more than the budget of {format_bytes(budget)} there")
    assert log.count(said) == 1, log
