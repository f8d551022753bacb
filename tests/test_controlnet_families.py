"""ControlNets on the SDXL and FLUX families, end to end: one real daemon serving both.

test_controlnet.py covers the request field on ``tiny`` (SD 1.5), test_controlnet_edits.py with
its edits; here each family's own diffusers pipelines run, for text-to-image and the two edits
(``StableDiffusionXLControlNetPipeline`` with its added size conditioning, ``FluxControlNetPipeline``
with the picture VAE-encoded and packed, their image-to-image and inpainting siblings). The models and ControlNets are
built in code (sdxlkit.py, controlkit.py), saved as folders and served the way a user's are:
``--model xl=FOLDER``, the embedded ``tiny-flux``, ``--controlnet NAME=FOLDER``. Two fit no
model: ``edges`` is tiny's (SD 1.5), ``flux-16`` one for fluxkit.py's FLUX (tiny-flux's width, 4
latent channels where tiny-flux has 16). ``xl-union`` (a ``ControlNetUnionModel``, 6 modes) and
``flux-union`` (a ``FluxControlNetModel`` with 3 modes, served with ``modes=canny:tile:depth``) are union
ControlNets: a request picks the mode, by number, or by name where serve named them.
Outputs are compared as raw ``npy`` bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controlkit import build_controlnet, build_flux_controlnet, mask_png, png
from daemonkit import first_output, get, http, shared_daemon
from sdxlkit import build_sdxl

# model -> its two ControlNets; 64x64 is the smallest size both take (FLUX packs 8x latents 2x2)
FAMILIES = {"xl": ("xl-lines", "xl-blobs"), "tiny-flux": ("flux-lines", "flux-blobs")}
FAST = {"width": 64, "height": 64, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7, "output_format": "npy",
        "output_dtype": "float32"}


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, controlnet_dir: Path) -> Iterator[Path]:
    from diffusers import FluxControlNetModel
    from fluxkit import TRANSFORMER as FLUXKIT_TRANSFORMER

    root = tmp_path_factory.mktemp("control-families")
    sdxl = build_sdxl(root / "xl")
    args = ["--model", f"xl={sdxl}", "--model", "tiny-flux", "--workers", "1", "--job-timeout", "300",
            "--batch-wait-ms", "300", "--controlnet", f"edges={controlnet_dir}",
            "--controlnet", f"xl-union={build_controlnet(root / 'xl-union', seed=7, pipeline=sdxl, union=True)}",
            "--controlnet",
            f"flux-union={build_flux_controlnet(root / 'flux-union', seed=8, num_mode=3)},modes=canny:tile:depth"]
    FluxControlNetModel(**{**FLUXKIT_TRANSFORMER, "num_layers": 1, "num_single_layers": 1}).save_pretrained(
        root / "flux-16")
    args += ["--controlnet", f"flux-16={root / 'flux-16'}"]
    for seed, name in enumerate(FAMILIES["xl"], start=3):
        args += ["--controlnet", f"{name}={build_controlnet(root / name, seed=seed, pipeline=sdxl)}"]
    for seed, name in enumerate(FAMILIES["tiny-flux"], start=5):
        args += ["--controlnet", f"{name}={build_flux_controlnet(root / name, seed=seed)}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d.socket


async def run(s: aiohttp.ClientSession, model: str, control: list[dict[str, Any]] | None = None,
              **extra: Any) -> bytes:
    body: dict[str, Any] = {**FAST, "model": model, **extra}
    if control is not None:
        body["control"] = control
    return await first_output(s, body)


@pytest.mark.parametrize("model", FAMILIES)
async def test_control_steers_and_scale_zero_is_the_plain_output_bit_for_bit(sock: Path, model: str) -> None:
    """Scale 0 multiplies every residual by 0, and FLUX's ControlNet pipeline draws the model's own
    noise (controlnet.py's ``_Rewind``): bit for bit the plain job, though it ran the other pipeline."""
    name = FAMILIES[model][0]
    async with http(sock) as s:
        plain = await run(s, model)
        steered = await run(s, model, [{"name": name, "image": png(1)}])
        other = await run(s, model, [{"name": name, "image": png(2)}])
        late = await run(s, model, [{"name": name, "image": png(1), "start": 0.5}])
        zero = await run(s, model, [{"name": name, "image": png(1), "scale": 0.0}])
    assert steered != plain, "the control changed nothing"
    assert other != steered, "another control image gave the same output"
    assert late not in (plain, steered), "the step range changed nothing"
    assert zero == plain


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("edit", [{"image": png(12), "strength": 0.7}, {"image": png(12), "mask": mask_png()}],
                         ids=["img2img", "inpaint"])
async def test_control_steers_an_edit_and_scale_zero_is_the_plain_edit_bit_for_bit(sock: Path, model: str,
                                                                                   edit: dict[str, Any]) -> None:
    """The family's ControlNet edit pipelines (``StableDiffusionXLControlNetImg2ImgPipeline``,
    ``FluxControlNetInpaintPipeline``, ...); FLUX's encodes the control picture from the seed's generator
    first, and is wound back to draw as the plain edit does (controlnet.py's ``_Rewind``)."""
    name = FAMILIES[model][0]
    async with http(sock) as s:
        plain = await run(s, model, **edit)
        steered = await run(s, model, [{"name": name, "image": png(1)}], **edit)
        zero = await run(s, model, [{"name": name, "image": png(1), "scale": 0.0}], **edit)
    assert steered != plain, "the control changed nothing"
    assert zero == plain


@pytest.mark.parametrize("model", FAMILIES)
async def test_two_controlnets_of_a_family_run_together(sock: Path, model: str) -> None:
    """diffusers' multi model (``MultiControlNetModel``, ``FluxMultiControlNetModel``), a scale and
    step range each; both at scale 0 are the plain output again."""
    lines, blobs = FAMILIES[model]
    async with http(sock) as s:
        plain = await run(s, model)
        one = await run(s, model, [{"name": lines, "image": png(1)}])
        both = await run(s, model, [{"name": lines, "image": png(1)}, {"name": blobs, "image": png(2), "end": 0.5}])
        zeros = await run(s, model, [{"name": lines, "image": png(1), "scale": 0.0},
                                     {"name": blobs, "image": png(2), "scale": 0.0}])
    assert both not in (plain, one), "the second ControlNet changed nothing"
    assert zeros == plain


async def refused(s: aiohttp.ClientSession, model: str, control: Any) -> tuple[int, dict[str, Any]]:
    async with s.post("/v1/jobs", json={**FAST, "model": model, "control": control}) as r:
        return r.status, (await r.json())["error"]


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize(("entry", "field", "words"), [
    ({"name": "sketch", "image": "x"}, "control[0].name", "known: edges, flux-16, flux-blobs"),
    ({"image": "bm90IGFuIGltYWdl"}, "control[0].image", "not an image"),
])
async def test_an_unknown_name_and_a_bad_image_are_400s_naming_the_field(sock: Path, model: str, entry: dict[str, Any],
                                                                          field: str, words: str) -> None:
    async with http(sock) as s:
        status, error = await refused(s, model, [{"name": FAMILIES[model][0], **entry}])
    assert (status, error["field"]) == (400, field), error
    assert words in error["message"]


@pytest.mark.parametrize(("model", "other"), [("xl", "flux-lines"), ("tiny-flux", "xl-lines"), ("xl", "edges"),
                                            ("tiny-flux", "flux-16"), ("tiny-flux", "xl-union"), ("xl", "flux-union")])
async def test_a_controlnet_of_another_family_is_a_400(sock: Path, model: str, other: str) -> None:
    async with http(sock) as s:
        status, error = await refused(s, model, [{"name": other, "image": png(1)}])
    assert (status, error["field"]) == (400, "control[0].name"), error
    assert f"does not fit model {model!r}" in error["message"]


async def test_controlnets_endpoint_says_which_family_each_fits(sock: Path) -> None:
    async with http(sock) as s:
        status, body = await get(s, "/v1/controlnets")
    assert status == 200
    entries = {e["name"]: e for e in body["data"]}
    for model, other in (("xl", "tiny-flux"), ("tiny-flux", "xl")):
        for name in FAMILIES[model]:
            assert entries[name]["models"] == [model] and set(entries[name]["unfit"]) == {other}, entries[name]
    for name in ("edges", "flux-16"):
        assert entries[name]["models"] == [] and set(entries[name]["unfit"]) == {"xl", "tiny-flux"}, entries[name]
    assert entries["xl-union"]["models"] == ["xl"] and entries["flux-union"]["models"] == ["tiny-flux"]
    assert (entries["flux-union"]["num_modes"], entries["flux-union"]["modes"]) == (3, ["canny", "tile", "depth"])
    assert (entries["xl-union"]["num_modes"], entries["xl-union"]["modes"]) == (6, None)  # served without names
    assert (entries["xl-lines"]["num_modes"], entries["xl-lines"]["modes"]) == (0, None)
    assert "in_channels is 16" in entries["flux-16"]["unfit"]["tiny-flux"]  # the same width: found by its input
    assert "FluxControlNetModel" in entries["flux-lines"]["unfit"]["xl"]
    assert "ControlNetModel" in entries["xl-lines"]["unfit"]["tiny-flux"]
    assert "cross_attention_dim" in entries["edges"]["unfit"]["xl"]  # SD 1.5's text width, not SDXL's


async def test_flux_scale_zero_is_plain_with_a_stochastic_sampler_too(sock: Path) -> None:
    """flow-sde draws each step's noise from the request's generator after the initial noise: the
    control picture's VAE sample must not come between them."""
    async with http(sock) as s:
        plain = await run(s, "tiny-flux", scheduler="flow-sde")
        zero = await run(s, "tiny-flux", [{"name": "flux-lines", "image": png(1), "scale": 0.0}], scheduler="flow-sde")
    assert zero == plain


UNIONS = {"xl": "xl-union", "tiny-flux": "flux-union"}


def union(model: str, mode: Any, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": UNIONS[model], "image": png(1), "mode": mode, **extra}]


@pytest.mark.parametrize("model", UNIONS)
async def test_a_union_controlnets_mode_steers_and_modes_keep_apart(sock: Path, model: str) -> None:
    """The mode reaches the model (SDXL's ``control_type`` one-hot, FLUX's mode embedding): two modes,
    two outputs, each what it gives alone when both are sent at once; scale 0 is still the plain output."""
    async with http(sock) as s:
        plain = await run(s, model)
        solo = [await run(s, model, union(model, mode)) for mode in (0, 1)]
        together = await asyncio.gather(*(run(s, model, union(model, mode)) for mode in (0, 1)))
        zero = await run(s, model, union(model, 1, scale=0.0))
        edit = {"image": png(12), "strength": 0.7}
        plain_edit = await run(s, model, **edit)
        zero_edit = await run(s, model, union(model, 1, scale=0.0), **edit)
        steered_edit = await run(s, model, union(model, 1), **edit)
        job = (await get(s, "/v1/jobs?limit=1"))[1]["data"][0]
        # two pictures in one forward: FLUX's edit pipelines gave the mode one row for both (it failed mid-compute)
        pair = await run(s, model, union(model, 1), n=2, **edit)
    assert solo[0] != solo[1], "the mode changed nothing"
    assert plain not in solo
    assert list(together) == solo
    assert zero == plain
    assert zero_edit == plain_edit and steered_edit != plain_edit
    assert pair not in (plain_edit, steered_edit)
    assert job["request"]["control"][0]["mode"] == 1


@pytest.mark.parametrize(("model", "control", "field", "words"), [
    ("xl", [{"name": "xl-lines", "image": png(1), "mode": 0}], "control[0].mode", "single control mode"),
    ("xl", [{"name": "xl-union", "image": png(1)}], "control[0].mode", "0 to 5"),
    ("xl", [{"name": "xl-union", "image": png(1), "mode": 6}], "control[0].mode", "from 0 to 5"),
    ("tiny-flux", [{"name": "flux-union", "image": png(1), "mode": -1}], "control[0].mode", "from 0 to 2"),
    ("xl", [{"name": "xl-union", "image": png(1), "mode": "canny"}], "control[0].mode", "names no modes"),
    ("tiny-flux", [{"name": "flux-union", "image": png(1), "mode": "dpth"}], "control[0].mode",
     "its modes are canny, tile, depth"),
    ("tiny-flux", [{"name": "flux-union", "image": png(1)}], "control[0].mode", "3 control modes: canny, tile, depth"),
    ("tiny-flux", [{"name": "flux-lines", "image": png(1), "mode": "tile"}], "control[0].mode", "single control mode"),
    ("xl", [{"name": "xl-union", "image": png(1), "mode": 0}, {"name": "xl-lines", "image": png(2)}], "control",
     "other union ControlNets only"),
])
async def test_a_bad_mode_is_a_400_naming_it(sock: Path, model: str, control: Any, field: str, words: str) -> None:
    async with http(sock) as s:
        status, error = await refused(s, model, control)
    assert (status, error["field"]) == (400, field), error
    assert words in error["message"], error


async def test_a_named_mode_is_its_number(sock: Path) -> None:
    """``modes=canny:tile:depth`` at serve: ``"tile"`` is mode 1, the same output bit for bit, and the
    job's request shows the number, as for a request that gave it."""
    async with http(sock) as s:
        number, named = await asyncio.gather(run(s, "tiny-flux", union("tiny-flux", 1)),
                                             run(s, "tiny-flux", union("tiny-flux", "tile")))
        job = (await get(s, "/v1/jobs?limit=1"))[1]["data"][0]
    assert named == number
    assert job["request"]["control"][0]["mode"] == 1
