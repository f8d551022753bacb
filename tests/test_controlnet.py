"""ControlNets per request, end to end: a real daemon on ``tiny`` with ControlNets built in code.

``edges`` and ``blobs`` are ControlNets made from tiny's UNet (controlkit.py), saved with
``save_pretrained`` and served with ``--controlnet NAME=PATH``; a third model (synthetic) has no
ControlNet family. Outputs are compared as raw ``npy`` bytes, so "equal" means bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controlkit import build_controlnet, png
from daemonkit import Daemon, first_output, get, http, shared_daemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SIZE = 64
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy", "output_dtype": "float32"}  # float: tiny's uint8 pictures saturate


@pytest.fixture(scope="module")
def control_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
                   controlnet_dir: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("control-daemon")
    edges, blobs = controlnet_dir, build_controlnet(root / "blobs", seed=2)
    args = ["--model", "tiny", "--model", "plain=synthetic:compute_ms=5", "--workers", "1", "--max-batch", "4",
            "--batch-wait-ms", "400", "--job-timeout", "300",
            "--controlnet", f"edges={edges}", "--controlnet", f"blobs={blobs}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d


@pytest.fixture(scope="module")
def sock(control_daemon: Daemon) -> Path:
    return control_daemon.socket


async def run(s: aiohttp.ClientSession, control: list[dict[str, Any]] | None = None, **extra: Any) -> bytes:
    body = {**FAST, **extra}
    if control is not None:
        body["control"] = control
    return await first_output(s, body)


async def refused(s: aiohttp.ClientSession, control: Any, model: str = "tiny") -> tuple[int, dict[str, Any]]:
    async with s.post("/v1/jobs", json={**FAST, "model": model, "control": control}) as r:
        return r.status, (await r.json())["error"]


async def test_control_steers_the_output_and_scale_zero_is_the_plain_output_bit_for_bit(sock: Path) -> None:
    async with http(sock) as s:
        plain = await run(s)
        edges = await run(s, [{"name": "edges", "image": png(1)}])
        other_image = await run(s, [{"name": "edges", "image": png(2)}])
        zero = await run(s, [{"name": "edges", "image": png(1), "scale": 0.0}])
        both = await run(s, [{"name": "edges", "image": png(1)}, {"name": "blobs", "image": png(2), "end": 0.5}])
        job = (await get(s, "/v1/jobs?limit=1"))[1]["data"][0]
    assert edges != plain, "the control changed nothing"
    assert other_image != edges, "another control image gave the same output"
    assert both not in (plain, edges), "the second ControlNet changed nothing"
    assert zero == plain  # diffusers multiplies the residuals by the scale: 0 adds exact zeros
    assert job["request"]["control"] == [
        {"name": "edges", "scale": 1.0, "start": 0.0, "end": 1.0, "preprocess": "none", "mode": None},
        {"name": "blobs", "scale": 1.0, "start": 0.0, "end": 0.5, "preprocess": "none", "mode": None}]


async def test_different_controls_at_once_are_not_batched_together(sock: Path) -> None:
    """Sent in the same moment to a worker that batches for 400 ms: each output equals its solo run."""
    controls = [[{"name": "edges", "image": png(1)}], [{"name": "edges", "image": png(2)}],
                [{"name": "edges", "image": png(1), "scale": 0.5}], None]
    async with http(sock) as s:
        solo = [await run(s, c) for c in controls]
        together = await asyncio.gather(*(run(s, c) for c in controls))
    assert list(together) == solo
    assert len(set(solo)) == 4


async def test_canny_preprocess_runs_and_differs_from_the_raw_picture(sock: Path) -> None:
    pytest.importorskip("cv2")
    async with http(sock) as s:
        raw = await run(s, [{"name": "edges", "image": png(3)}])
        canny = await run(s, [{"name": "edges", "image": png(3), "preprocess": "canny"}])
    assert canny != raw


async def test_controlnets_endpoint_lists_each_with_the_models_it_fits(sock: Path) -> None:
    async with http(sock) as s:
        status, body = await get(s, "/v1/controlnets")
    assert status == 200
    entries = {e["name"]: e for e in body["data"]}
    assert set(entries) == {"edges", "blobs"}
    assert entries["edges"]["models"] == ["tiny"] and "plain" in entries["edges"]["unfit"]


@pytest.mark.parametrize(("control", "field", "words"), [
    ([{"name": "sketch", "image": "x"}], "control[0].name", "known: blobs, edges"),
    ([{"name": "edges", "image": "bm90IGFuIGltYWdl"}], "control[0].image", "not an image"),
    ([{"name": "edges", "image": "%%%"}], "control[0].image", "base64"),
    ([{"name": "edges"}], "control[0].image", "exactly one"),
    ([{"name": "edges", "image": "x", "scale": 9}], "control[0].scale", "from 0 to"),
    ([{"name": "edges", "image": "x", "start": 0.6, "end": 0.4}], "control[0].start", "below"),
    ([{"name": "edges", "image": "x", "end": 1.5}], "control[0].end", "fraction"),
    ([{"name": "edges", "image": "x", "preprocess": "depth"}], "control[0].preprocess", "canny"),
    ([{"name": "edges", "image": "x"}, {"name": "edges", "image": "x"}], "control[1].name", "twice"),
])
async def test_bad_control_entries_are_400s_naming_the_field(sock: Path, control: Any, field: str,
                                                              words: str) -> None:
    async with http(sock) as s:
        status, error = await refused(s, control)
    assert (status, error["field"]) == (400, field), error
    assert words in error["message"]


async def test_a_controlnet_of_no_fitting_family_is_a_400(sock: Path) -> None:
    async with http(sock) as s:
        status, error = await refused(s, [{"name": "edges", "image": png(1)}], model="plain")
    assert (status, error["field"]) == (400, "control[0].name") and "does not fit model 'plain'" in error["message"]


@pytest.mark.parametrize(("arg", "why"), [
    ("edges=/nonexistent/controlnet", "does not exist"),
    ("edges=relative/folder", "relative"),
    ("edges=/etc/hostname", "not a .safetensors file"),
    ("bad name=/tmp", "must be 1-64 characters"),
    ("edges", "NAME=PATH"),
])
def test_serve_refuses_a_controlnet_path_it_cannot_serve_with_one_line(arg: str, why: str) -> None:
    from diffusiond.daemon.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=why):
        build_config({}, {"controlnet": [arg]})


def union_folder(root: Path, modes: int) -> Path:
    """A union ControlNet's folder as far as the engine reads it at start: its config.json (FLUX's ``num_mode``)."""
    root.mkdir(exist_ok=True)
    (root / "config.json").write_text(f'{{"_class_name": "FluxControlNetModel", "num_mode": {modes}}}')
    return root


@pytest.mark.parametrize(("modes", "why"), [
    ("canny:tile", "names 2 modes, but the ControlNet has 3"),
    ("canny:tile:canny", "'canny' is given twice"),
    ("canny:Tile:depth", "'Tile' is not a mode name"),
    ("canny:2:depth", "not a bare number"),
    ("canny::depth", "'' is not a mode name"),
])
def test_serve_refuses_mode_names_that_do_not_match_the_union_controlnet(tmp_path: Path, modes: str, why: str) -> None:
    from diffusiond.daemon.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=why):
        build_config({}, {"controlnet": [f"u={union_folder(tmp_path / 'u', 3)},modes={modes}"]})
    with pytest.raises(ConfigError, match="single control mode"):
        build_config({}, {"controlnet": [f"u={union_folder(tmp_path / 'one', 0)},modes=canny"]})


def test_mode_names_come_from_the_flag_or_the_toml_table_in_either_form(tmp_path: Path) -> None:
    from diffusiond.daemon.config import ConfigError, build_config

    folder = union_folder(tmp_path / "u,v", 3)  # a comma in the path stays the path's
    flag = build_config({}, {"controlnet": [f"u={folder},modes=canny:tile:depth", f"plain={folder}"]}).controlnets
    assert (flag["u"].path, flag["u"].modes) == (str(folder), ("canny", "tile", "depth"))
    assert flag["plain"].modes == ()
    table = build_config({"controlnets": {"u": {"path": str(folder), "modes": ["canny", "tile", "depth"]},
                                          "v": f"{folder},modes=a:b:c"}}, {}).controlnets
    assert table["u"].modes == ("canny", "tile", "depth") and table["v"].modes == ("a", "b", "c")
    with pytest.raises(ConfigError, match="unknown option 'mode'"):
        build_config({}, {"controlnet": [f"u={folder},mode=a:b:c"]})
    with pytest.raises(ConfigError, match="a table takes path"):
        build_config({"controlnets": {"u": {"path": str(folder), "names": ["a"]}}}, {})


@pytest.fixture(scope="module")
def union_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Union ControlNets as their repositories hold them (save_pretrained: config.json and
    diffusion_pytorch_model.safetensors): a tiny SDXL ``ControlNetUnionModel`` with 4 modes and a tiny FLUX
    ``FluxControlNetModel`` with 3 (only their headers are read: the weights stay random)."""
    from diffusers import ControlNetUnionModel, FluxControlNetModel
    from fluxkit import TRANSFORMER

    root = tmp_path_factory.mktemp("union-files")
    ControlNetUnionModel(
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), layers_per_block=1,
        cross_attention_dim=32, attention_head_dim=(2, 4), addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=80, conditioning_embedding_out_channels=(16, 32), num_control_type=4,
        num_trans_channel=32, num_trans_head=2, num_proj_channel=32).save_pretrained(root / "xl")
    FluxControlNetModel(**{**TRANSFORMER, "num_layers": 1, "num_single_layers": 1, "num_mode": 3}).save_pretrained(
        root / "flux")
    return {"xl": root / "xl", "flux": root / "flux"}


@pytest.mark.parametrize(("family", "what"), [
    ("xl", "an SDXL union ControlNet (ControlNetUnionModel, 4 control modes)"),
    ("flux", "a FLUX union ControlNet (FluxControlNetModel with num_mode, 3 control modes)"),
])
def test_serve_refuses_a_union_controlnet_given_as_one_file_saying_what_to_do(
    tmp_path: Path, union_folders: dict[str, Path], family: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """diffusers 0.42 reads union ControlNets from folders only (``ControlNetUnionModel.from_single_file``
    raises, FLUX ControlNets have none), so the file's header says what it is and serve stops with one line."""
    import shutil

    from diffusiond.cli import main
    from diffusiond.daemon.config import ConfigError, build_config

    folder = union_folders[family]
    weights = folder / "diffusion_pytorch_model.safetensors"
    alone = shutil.copy(weights, tmp_path / "diffusion_pytorch_model_promax.safetensors")  # as people download it
    head = f"ControlNet 'u' ({alone}) is {what}; diffusers reads it from a folder (its config.json and weights), "
    with pytest.raises(ConfigError) as info:
        build_config({}, {"controlnet": [f"u={alone},modes=a:b:c"]})
    assert str(info.value) == (f"{head}not as a single file; put it in a folder as diffusion_pytorch_model.safetensors "
                               "beside the config.json of the repository it came from (the model's page lists both), "
                               "and give that folder: --controlnet u=FOLDER")
    with pytest.raises(ConfigError, match=f"give the folder it lies in: --controlnet u={folder}$"):
        build_config({}, {"controlnet": [f"u={weights}"]})  # the repository downloaded whole
    beside = shutil.copy(weights, folder / "promax.safetensors")  # the folder would read its other weights
    with pytest.raises(ConfigError, match=f"copy this file under that name into a new folder with {folder}/config"):
        build_config({}, {"controlnet": [f"u={beside}"]})
    code = main(["serve", "--model", "synthetic", "--controlnet", f"u={alone}", "--socket", str(tmp_path / "d.sock")])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"diffusiond serve: error: {head}"), lines
    assert not (tmp_path / "d.sock").exists()


def test_a_single_mode_controlnet_file_is_still_served_and_a_broken_one_is_refused(
    tmp_path: Path, controlnet_dir: Path
) -> None:
    """A plain ControlNet's single file passes the start (the worker reads it with ``from_single_file``),
    with no modes; a file whose safetensors header cannot be read stops serve, naming the file."""
    import shutil

    from diffusiond.daemon.config import ConfigError, build_config
    from diffusiond.daemon.core.controls import ControlRegistry

    plain = shutil.copy(controlnet_dir / "diffusion_pytorch_model.safetensors", tmp_path / "edges.safetensors")
    config = build_config({}, {"controlnet": [f"edges={plain}"]})
    assert ControlRegistry(config.controlnets).modes == {"edges": 0}
    (tmp_path / "cut.safetensors").write_bytes(Path(plain).read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"ControlNet 'edges': {tmp_path}/cut.safetensors: truncated"):
        build_config({}, {"controlnet": [f"edges={tmp_path / 'cut.safetensors'}"]})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.none() | st.integers(-3, 5) | st.sampled_from(["canny", "tile", "depth", "dpth", "", "Tile", "1"])
       | st.text(max_size=70), name=st.sampled_from(["u", "bare", "plain"]))
def test_any_mode_is_its_number_or_a_400_naming_it(tmp_path: Path, mode: Any, name: str) -> None:
    """Admission's reading of ``control[k].mode`` (the fuzz family's values reach it only for the one
    ControlNet the fuzz daemons serve, a single-mode one): a number in range (or written as text, as a
    form sends it), a served name, or a 400."""
    from diffusiond.daemon.core.controls import ControlRegistry
    from diffusiond.daemon.edge.controls import check_modes, plan
    from diffusiond.daemon.errors import InvalidRequest
    from diffusiond.daemon.values import ControlNetSetting

    names = ("canny", "tile", "depth")
    registry = ControlRegistry({"u": ControlNetSetting(str(union_folder(tmp_path / "u", 3)), names),
                                "bare": ControlNetSetting(str(union_folder(tmp_path / "bare", 3))),
                                "plain": ControlNetSetting(str(union_folder(tmp_path / "plain", 0)))})
    entries = plan([{"name": name, "image": "x", "mode": mode}])
    try:
        checked = check_modes(entries, registry)
    except InvalidRequest as exc:
        assert exc.field == "control[0].mode", exc
        return
    number = checked[0].mode
    if name == "plain":
        assert number is None and mode is None
    else:
        assert number in (0, 1, 2) and mode in (number, str(number), names[number] if name == "u" else number)


def test_generate_control_flag_reads_name_image_and_scale() -> None:
    from diffusiond.commands.argtypes import control_arg, ip_adapter_arg

    assert control_arg("edges:lines.png") == {"name": "edges", "image": "lines.png"}
    assert control_arg("edges:a:b.png:0.5") == {"name": "edges", "image": "a:b.png", "scale": 0.5}
    assert control_arg("edges:a:b.png") == {"name": "edges", "image": "a:b.png"}
    assert control_arg("union@2:depth.png:0.8") == {"name": "union", "image": "depth.png", "scale": 0.8, "mode": 2}
    assert control_arg("union@soft_edge:e.png") == {"name": "union", "image": "e.png", "mode": "soft_edge"}
    for bad in ("union@:x.png", "union@Depth:x.png", "union@a b:x.png"):
        with pytest.raises(argparse.ArgumentTypeError, match="MODE"):
            control_arg(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="mode"):
        ip_adapter_arg("style@1:ref.png")


def test_client_sends_control_images_as_base64() -> None:
    from diffusiond.client.params import job_body

    body = job_body("x", {"control": [{"name": "edges", "image": b"\x89PNG", "scale": 0.5}]})
    assert body["control"] == [{"name": "edges", "image": base64.b64encode(b"\x89PNG").decode(), "scale": 0.5}]


def test_control_images_joined_to_a_several_picture_edit_keep_its_earlier_pictures() -> None:
    """The buffer rebuilt with a job's control images carries the edit's image, mask and earlier pictures alike:
    the pictures were dropped."""
    import io

    import numpy as np
    from PIL import Image

    from diffusiond.daemon.config import Limits
    from diffusiond.daemon.core.controls import ControlEntry, decode_controls
    from diffusiond.daemon.core.inputs import Source
    from diffusiond.ipc.inputs import InputBuffer, read_controls, read_inputs, read_pictures

    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    earlier = [rng.integers(0, 255, (48, 80, 3), dtype=np.uint8), rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)]
    control = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(control, format="PNG")
    joined = InputBuffer(image, None, pictures=earlier)
    got = decode_controls([ControlEntry("edges", Source("control[0].image", data=control.getvalue()))], width=64,
                          height=64, limits=Limits(), input_dir=None, joined=joined)
    try:
        ref = got.buffer.ref(0)
        assert np.array_equal(read_inputs([got.buffer.fd], ref)[0], image)
        assert [p.tobytes() for p in read_pictures([got.buffer.fd], ref)] == [p.tobytes() for p in earlier]
        assert len(read_controls([got.buffer.fd], ref)) == 1
    finally:
        got.buffer.close()
        joined.close()
