"""FLUX IP-Adapters, end to end: a real daemon on ``tiny-flux`` (and ``tiny``) with adapters built in code.

``fstyle`` and ``fgrain`` are ipadapterkit.py's FLUX adapters (XLabs' layout; ``fgrain``'s encoder
is 8 wide, ``fstyle``'s 16, so they cannot share one); ``style`` is the SD one, for ``tiny``; and
``edges`` controlkit.py's FLUX ControlNet. Each family's adapters fit its own model only, and the
other pairs are refused at admission with the worker's reason. Outputs are compared as raw float32
``npy`` bytes, so "equal" means bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controlkit import mask_png
from daemonkit import get, http, shared_daemon
from ipadapterkit import build_flux_ip_adapter, entry, output, png

FAST = {"model": "tiny-flux", "width": 64, "height": 64, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy", "output_dtype": "float32"}


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, ip_adapter_file: Path) -> Iterator[Path]:
    from controlkit import build_flux_controlnet

    root = tmp_path_factory.mktemp("ip-flux-daemon")
    fstyle = build_flux_ip_adapter(root / "fstyle", seed=1)
    fgrain = build_flux_ip_adapter(root / "fgrain", seed=2, projection_dim=8)
    edges = build_flux_controlnet(root / "edges", seed=1)
    args = ["--model", "tiny-flux", "--model", "tiny", "--workers", "1", "--job-timeout", "300",
            "--ip-adapter", f"fstyle={fstyle}", "--ip-adapter", f"fgrain={fgrain.parent}",
            "--ip-adapter", f"style={ip_adapter_file}", "--controlnet", f"edges={edges}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d.socket


async def run(s: aiohttp.ClientSession, *entries: dict[str, Any], **extra: Any) -> bytes:
    return await output(s, FAST, *entries, **extra)


async def test_a_flux_reference_steers_tiny_flux_and_scale_zero_is_the_plain_output_bit_for_bit(sock: Path) -> None:
    async with http(sock) as s:
        plain = await run(s)
        styled = await run(s, entry("fstyle", 1))
        other = await run(s, entry("fstyle", 2))
        zero = await run(s, entry("fstyle", 1, 0.0))
        both = await run(s, entry("fstyle", 1), entry("fgrain", 3))
        both_zero = await run(s, entry("fstyle", 1, 0.0), entry("fgrain", 3, 0.0))
        after = await run(s)
    assert len({plain, styled, other, both}) == 4, "a reference or an adapter of the pair changed nothing"
    assert zero == plain  # the IP attention is added to the block's output times the scale: 0 adds exact zeros
    assert both_zero == plain
    assert after == plain  # the adapters came out of the transformer


async def test_a_flux_reference_acts_on_its_controlnet_and_image_to_image_pipelines(sock: Path) -> None:
    control = {"control": [{"name": "edges", "image": png(11, 64)}]}
    edit = {"image": png(12, 64), "strength": 0.7}
    inpaint = {"image": png(12, 64), "mask": mask_png()}
    # FLUX's ControlNet edit pipelines have no ip_adapter_image_embeds argument (a reference with control and
    # an edit used to fail mid-compute on it): the embeddings reach their transformer another way
    kinds = (("control", control), ("img2img", edit), ("control+img2img", {**control, **edit}),
             ("control+inpainting", {**control, **inpaint}))
    async with http(sock) as s:
        outs = {k: [await run(s, *refs, **v) for refs in ([], [entry("fstyle", 1)], [entry("fstyle", 1, 0.0)])]
                for k, v in kinds}
    for k, (plain, styled, zero) in outs.items():
        assert styled != plain, f"the reference changed nothing in {k}"
        assert zero == plain, f"{k} with the reference at scale 0 is not the plain {k} output"


async def test_each_family_takes_only_its_own_adapters(sock: Path) -> None:
    async with http(sock) as s:
        status, listed = await get(s, "/v1/ip-adapters")
        refusals = []
        for model, name in (("tiny", "fstyle"), ("tiny-flux", "style")):
            body = {**FAST, "model": model, "ip_adapter": [entry(name, 1)]}
            async with s.post("/v1/jobs", json=body) as r:
                refusals.append((r.status, (await r.json())["error"]))
        steered = await run(s, entry("style", 1), model="tiny") != await run(s, model="tiny")
    assert status == 200
    entries = {e["name"]: e for e in listed["data"]}
    assert entries["fstyle"]["models"] == entries["fgrain"]["models"] == ["tiny-flux"]
    assert entries["style"]["models"] == ["tiny"]
    assert "FLUX IP-Adapter" in entries["fstyle"]["unfit"]["tiny"]
    assert "SD 1.5 / SDXL IP-Adapter" in entries["style"]["unfit"]["tiny-flux"]
    for (code, error), model in zip(refusals, ("tiny", "tiny-flux"), strict=True):
        assert (code, error.get("field")) == (400, "ip_adapter[0].name"), error
        assert f"does not fit model '{model}'" in error["message"] and "which takes" in error["message"], error
    assert steered  # the SD adapter still serves tiny beside them


def test_an_xlabs_file_reads_as_diffusers_names_it(tmp_path: Path) -> None:
    from diffusiond.pipelines.ip_adapter import for_flux, read_weights

    weights = read_weights(str(build_flux_ip_adapter(tmp_path / "x", seed=1)))
    assert sorted(weights["image_proj"]) == ["norm.bias", "norm.weight", "proj.bias", "proj.weight"]
    assert sorted(weights["ip_adapter"]) == ["0.to_k_ip.bias", "0.to_k_ip.weight", "0.to_v_ip.bias", "0.to_v_ip.weight"]
    assert for_flux(weights)
