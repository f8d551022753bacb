"""Refusals that name the real reason, against one real daemon serving three families: ``tiny``
(SD 1.5), ``tiny-flux`` and ``xl`` (a tiny SDXL built in code, sdxlkit.py), with the ``ink`` LoRA
(tiny's UNet and CLIP text encoder, lorakit.py) and the ``style`` IP-Adapter (tiny's).

- ``ink`` on tiny-flux: diffusers drops its UNet part and loads its text-encoder part into FLUX's
  own CLIP encoder, so the adapter "fitted" and served something else than it was trained to; it is
  refused, naming the part that does not apply. A text-encoder-only LoRA still fits there.
- ``ink`` and ``style`` on xl: torch's size-mismatch dump (one line per tensor) and diffusers'
  advice to developers became the whole 400; the reason is one line, with a count of the rest.
- An edit's size taken from its image is rounded down to the model's multiple (16 on FLUX), as it
  was to 8, instead of a 400 naming ``size``, a field the request never sent.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from daemonkit import Daemon, get, http, shared_daemon, submit, until, wait_job
from sdxlkit import build_sdxl

from diffusiond.pipelines.errors import PipelineError, fit_reason

FAST = {"width": 64, "height": 64, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, lora_files: dict[str, Path],
           ip_adapter_file: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("fit-refusals")
    args = ["--model", "tiny", "--model", "tiny-flux", "--model", f"xl={build_sdxl(root / 'xl')}", "--workers", "1",
            "--job-timeout", "300", "--lora", f"ink={lora_files['ink']}", "--ip-adapter", f"style={ip_adapter_file}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d


async def registry(s: aiohttp.ClientSession, path: str, name: str) -> dict[str, Any]:
    """``name``'s entry once every model has loaded and said whether it fits."""
    async def settled() -> dict[str, Any] | None:
        entry = next(e for e in (await get(s, path))[1]["data"] if e["name"] == name)
        return entry if len(entry["models"]) + len(entry["unfit"]) == 3 else None

    found: dict[str, Any] = await until(settled, 120, f"every model's verdict on {name}")
    return found


async def refusal(s: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post("/v1/jobs", json={**FAST, **body}) as r:
        answer = await r.json()
    assert r.status == 400, answer
    error: dict[str, Any] = answer["error"]
    return error


def png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (40, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


async def test_an_sd_lora_is_refused_on_flux_naming_the_unet_part_that_would_be_dropped(
        daemon: Daemon, lora_files: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    async with http(daemon.socket) as s:
        ink = await registry(s, "/v1/loras", "ink")
        assert ink["models"] == ["tiny"]
        why = ink["unfit"]["tiny-flux"]
        assert "denoiser part" in why and "'unet'" in why and "FluxTransformer2DModel" in why, why
        assert "only its text_encoder part would load" in why, why
        error = await refusal(s, {"model": "tiny-flux", "loras": [{"name": "ink"}]})
        assert error["field"] == "loras" and "does not fit model 'tiny-flux'" in error["message"], error
        assert "denoiser part" in error["message"], error
        # the same adapter's text-encoder part alone is a LoRA for the encoder, which FLUX's CLIP takes
        weights = load_file(str(lora_files["ink"] / "pytorch_lora_weights.safetensors"))
        save_file({k: v for k, v in weights.items() if k.startswith("text_encoder.")}, str(tmp_path / "te.safetensors"))
        async with s.post("/v1/loras", json={"name": "ink-te", "path": str(tmp_path / "te.safetensors")}) as r:
            added = await r.json()
        assert r.status == 201, added
        assert {"tiny", "tiny-flux"} <= set(added["models"]), added
        job = await wait_job(s, (await submit(s, {**FAST, "model": "tiny-flux", "loras": [{"name": "ink-te"}]}))["id"])
        assert job["status"] == "succeeded", job


async def test_adapters_that_do_not_fit_sdxl_are_refused_in_one_line(daemon: Daemon) -> None:
    async with http(daemon.socket) as s:
        lora = (await registry(s, "/v1/loras", "ink"))["unfit"]["xl"]
        ip = (await registry(s, "/v1/ip-adapters", "style"))["unfit"]["xl"]
        lora_error = await refusal(s, {"model": "xl", "loras": [{"name": "ink"}]})
        ip_error = await refusal(s, {"model": "xl", "ip_adapter": [{"name": "style", "image": base64.b64encode(
            png(48)).decode()}]})
    for why in (lora, ip, lora_error["message"], ip_error["message"]):
        assert "\n" not in why and "  " not in why and len(why) < 600, why
        assert "If you want to" not in why and "github.com" not in why, why  # diffusers' advice to developers
    assert "size mismatch for" in lora and lora.endswith("more tensors") and "torch.Size([4, 32])" in lora, lora
    assert "to_k_ip" in ip, ip


async def test_an_edit_takes_its_size_from_the_image_rounded_to_the_models_multiple(daemon: Daemon) -> None:
    async with http(daemon.socket) as s:
        body = {**FAST, "model": "tiny-flux", "image": base64.b64encode(png(72)).decode(), "strength": 0.9}
        del body["width"], body["height"]
        job = await wait_job(s, (await submit(s, body))["id"])
        assert job["status"] == "succeeded", job
        assert (job["request"]["width"], job["request"]["height"]) == (64, 64)  # 72 is no multiple of 16

        async def form_edit(**fields: str) -> tuple[int, dict[str, Any]]:
            form = aiohttp.FormData(default_to_multipart=True)
            for k, v in {"prompt": FAST["prompt"], "model": "tiny-flux", "num_inference_steps": "2", **fields}.items():
                form.add_field(k, v)
            form.add_field("image", png(72), filename="in.png", content_type="image/png")
            async with s.post("/v1/images/edits", data=form) as r:
                return r.status, await r.json()

        status, answer = await form_edit()
        assert status == 200, answer
        from PIL import Image

        assert Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))).size == (64, 64)
        status, answer = await form_edit(size="72x72")  # a size sent is the user's to fix, and named
        assert status == 400 and answer["error"]["field"] == "size", answer
        assert "multiple of 16" in answer["error"]["message"] and "64 or 80" in answer["error"]["message"], answer


def test_a_fit_reason_keeps_the_first_mismatch_and_counts_the_rest() -> None:
    small, large = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2)), torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Linear(5, 4))
    try:
        small.load_state_dict(large.state_dict())
    except RuntimeError as exc:
        dump = exc
    assert str(dump).count("size mismatch") == 4  # torch's own message, one line per tensor
    assert fit_reason(dump) == ("RuntimeError: Error(s) in loading state_dict for Sequential: size mismatch for "
                                "0.weight: copying a param with shape torch.Size([5, 4]) from checkpoint, the shape "
                                "in current model is torch.Size([3, 2]) ... and 3 more tensors")
    assert fit_reason(PipelineError("its rank 8 is above 4")) == "its rank 8 is above 4"  # ours: as written
