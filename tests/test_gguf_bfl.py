"""GGUF files as users download them (issue 28): FLUX under the original BFL tensor names.

city96's flux1-dev-Q8_0.gguf and its siblings keep BFL's names and layouts (``double_blocks.N.img_attn.qkv``
with q, k and v fused into one quantized tensor, ``single_blocks.N.linear1`` fusing them with the MLP's input),
sometimes under ComfyUI's ``model.diffusion_model.`` prefix; diffusers converts them on load. The tiny FLUX
transformer is written under those names (fluxkit.write_gguf_bfl) and beside it under diffusers' names
(fluxkit.write_gguf), and each path a user takes is checked to treat both the same: the weights loaded, a
daemon's generation, and ``diffusiond fit``'s sizes and block split.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from daemonkit import first_output, get, http
from fluxkit import build_flux, tiny_transformer, write_gguf, write_gguf_bfl
from PIL import Image

from conftest import ROOT

pytest.importorskip("gguf")

NAMES = ("diffusers", "bfl", "comfy")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The base folder, and one transformer's weights as a GGUF file under each naming."""
    root = tmp_path_factory.mktemp("bfl")
    flux = build_flux(root / "flux")
    module = tiny_transformer()
    paths = {name: root / f"{name}.gguf" for name in NAMES}
    write_gguf(module, paths["diffusers"])
    write_gguf_bfl(module, paths["bfl"])
    write_gguf_bfl(module, paths["comfy"], prefix="model.diffusion_model.")
    return flux, paths


def _transformer(path: Path, flux: Path) -> torch.nn.Module:
    from diffusiond.pipelines.loaders import load_gguf

    pipeline = load_gguf(path, name="t", device=torch.device("cpu"), dtype=torch.float32, options={"base": str(flux)})
    return pipeline._pipe.transformer  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize("naming", ["bfl", "comfy"])
def test_bfl_names_load_as_the_source_weights_still_quantized(files: tuple[Path, dict[str, Path]], naming: str
                                                              ) -> None:
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    flux, paths = files
    got = dict(_transformer(paths[naming], flux).named_parameters())
    same = dict(_transformer(paths["diffusers"], flux).named_parameters())
    source = tiny_transformer().state_dict()
    assert got.keys() == same.keys() == source.keys()
    for key, tensor in got.items():
        assert getattr(tensor, "quant_type", None) == getattr(same[key], "quant_type", None), key
        assert torch.equal(tensor.data, same[key].data), key
        weight = dequantize_gguf_tensor(tensor) if hasattr(tensor, "quant_type") else tensor.data
        want = source[key]
        assert weight.shape == want.shape, key
        assert (weight.float() - want).abs().max() <= want.abs().max() / 127 + 1e-7, key  # Q8_0's rounding
    # the fused qkv and linear1 were split while quantized: each projection is a Q8_0 tensor of its own
    for key in ("transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.add_v_proj.weight",
                "single_transformer_blocks.1.attn.to_k.weight", "single_transformer_blocks.1.proj_mlp.weight"):
        assert getattr(got[key].quant_type, "name", None) == "Q8_0", key


def test_a_daemon_serves_a_bfl_named_gguf_as_its_diffusers_named_twin(daemon_factory,  # type: ignore[no-untyped-def]
                                                                     files: tuple[Path, dict[str, Path]]) -> None:
    flux, paths = files
    args = [a for name in NAMES for a in ("--model", f"{name}={paths[name]},base={flux}")]
    d = daemon_factory(*args, "--job-timeout", "120")

    async def go() -> tuple[dict, dict[str, bytes]]:  # type: ignore[type-arg]
        async with http(d.socket) as s:
            _, models = await get(s, "/v1/models")
            images = {name: await first_output(s, {"prompt": "a fox", "model": name, "steps": 2, "seed": 7,
                                                   "width": 64, "height": 64}) for name in NAMES}
            return models, images

    models, images = asyncio.run(go())
    assert {m["id"]: m["approximations"] for m in models["data"]} == {
        name: ["gguf-Q8_0(transformer, dequantized per layer to float32)"] for name in NAMES}
    pixels = {}
    for name, png in images.items():
        with Image.open(io.BytesIO(png)) as img:
            pixels[name] = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert pixels["diffusers"].std() > 0  # an image, not a blank
    for name in ("bfl", "comfy"):
        assert np.abs(pixels[name] - pixels["diffusers"]).max() <= 1, name


def test_fit_sizes_a_bfl_named_gguf_as_its_diffusers_named_twin(files: tuple[Path, dict[str, Path]]) -> None:
    from diffusiond.daemon.residency.fit import gguf_tensors, group_bytes

    flux, paths = files

    def cli(name: str) -> dict:  # type: ignore[type-arg]
        done = subprocess.run([sys.executable, "-m", "diffusiond", "fit", f"{paths[name]},base={flux}", "--json",
                               "--working", "0", "--dtype", "float32"],
                              capture_output=True, text=True, cwd=ROOT.parent, timeout=60)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        return {k: v for k, v in report.items() if k != "spec"}

    want = cli("diffusers")
    assert "group" in [c["name"] for c in want["configurations"]]
    whole = sum(t.stored for t in gguf_tensors(paths["diffusers"]))
    blocks = group_bytes("transformer", gguf_tensors(paths["diffusers"]), "float32")
    assert blocks != whole  # split into blocks: what stays on the device is the rest and two blocks
    for name in ("bfl", "comfy"):
        assert cli(name) == want, name
        assert group_bytes("transformer", gguf_tensors(paths[name]), "float32") == blocks, name
