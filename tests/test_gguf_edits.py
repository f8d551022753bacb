"""A GGUF model edits and takes ControlNets like its unquantized folder (report 28 #3, #4): a real daemon on a CPU.

The sibling pipelines (image-to-image, inpainting, each ControlNet's) share the model's modules through
diffusers' ``from_pipe``, whose closing cast a quantized module refuses: the GGUF FLUX lost both edits
(``edits: -``, and a 400 with no reason) and a ControlNet job failed mid-compute on diffusers' raw
"Casting a quantized model to a new dtype is unsupported". The transformer here is tests/fluxkit.py's,
written as Q8_0; the ControlNet is built from that same tiny FLUX.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controlkit import build_flux_controlnet, mask_png, png
from daemonkit import first_output, get, http, shared_daemon
from fluxkit import build_flux, tiny_transformer, write_gguf

pytest.importorskip("gguf")

FAST = {"model": "q8", "width": 64, "height": 64, "steps": 2, "prompt": "a fox", "seed": 3, "output_format": "npy",
        "output_dtype": "float32"}


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("gguf-edits")
    flux = build_flux(root / "flux")
    write_gguf(tiny_transformer(), root / "flux-Q8_0.gguf", "Q8_0")
    cn = build_flux_controlnet(root / "cn", seed=4, pipeline=flux)
    args = ["--model", f"q8={root / 'flux-Q8_0.gguf'},base={flux}", "--controlnet", f"lines={cn}",
            "--workers", "1", "--job-timeout", "300"]
    with shared_daemon(root, args, model_cache) as d:
        yield d.socket


async def run(s: aiohttp.ClientSession, **extra: Any) -> bytes:
    return await first_output(s, {**FAST, **extra})


async def test_a_gguf_model_lists_its_edits_and_its_controlnet(sock: Path) -> None:
    async with http(sock) as s:
        _, models = await get(s, "/v1/models")
        _, controlnets = await get(s, "/v1/controlnets")
    entry = models["data"][0]
    assert entry["edits"] == ["image-to-image", "inpainting"], entry
    assert controlnets["data"][0]["models"] == ["q8"], controlnets


async def test_a_gguf_model_runs_image_to_image_inpainting_and_a_controlnet(sock: Path) -> None:
    async with http(sock) as s:
        plain = await run(s)
        img2img = await run(s, image=png(12), strength=0.7)
        inpaint = await run(s, image=png(12), mask=mask_png())
        steered = await run(s, control=[{"name": "lines", "image": png(1)}])
        zero = await run(s, control=[{"name": "lines", "image": png(1), "scale": 0.0}])
    assert len({plain, img2img, inpaint, steered}) == 4, "an edit or the control changed nothing"
    assert zero == plain, "the ControlNet pipeline at scale 0 is not the model's own"
