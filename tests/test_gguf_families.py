"""GGUF transformers beyond FLUX.1 served by a real daemon (issue 28): FLUX Kontext and Wan, on a CPU.

Users download ``flux1-kontext-dev-Q8_0.gguf`` (BFL's tensor names, as FLUX.1's) and serve it with
``base=`` a Kontext folder; the tiny FLUX of tests/fluxkit.py saved as a FluxKontextPipeline folder stands for
it, its transformer written as Q8_0 under diffusers' names and under BFL's. Wan's GGUFs (city96's
``wan2.1-t2v-14b-Q8_0.gguf``, QuantStack's ``Wan2.2-TI2V-5B-Q8_0.gguf``) keep the original Wan checkpoint's
names (``blocks.N.self_attn.q``, ``head.modulation``, a 5-D F32 ``patch_embedding``), sometimes under
ComfyUI's ``model.diffusion_model.`` prefix, which diffusers' ``convert_wan_transformer_to_diffusers`` maps
on load; tests/wankit.py's tiny Wan 2.1 T2V and 2.2 TI2V folders stand for the bases, their transformers
written so, and its Wan 2.1 I2V folder for ``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``, its transformer written as
city96's ``wan2.1-i2v-14b-480p-Q8_0.gguf`` is (the CLIP embedding ``img_emb.proj.N``, the image cross-attention's
``k_img``/``v_img``). Wan VACE is not served: its GGUF is refused naming what is, with its own base and with a
T2V one (which dropped the VACE blocks without a word and served the rest). Each is checked where a user
looks: the model's entry (its task, quantized), a job that runs (an edit that changes the image it is sent, a
video, an animated image), the quantization named on the job, and ``diffusiond fit``'s sizes from the GGUF header.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemonkit import Daemon, get, http, shared_daemon, submit, wait_job
from fluxkit import build_flux, tiny_transformer, write_gguf, write_gguf_bfl, write_tensors
from PIL import Image
from test_edits import blocky
from test_image_tasks import b64
from wankit import Z, _transformer, build_wan, original_state_dict

from conftest import ROOT

pytest.importorskip("gguf")

Q8 = "gguf-Q8_0(transformer, dequantized per layer to float32)"
KONTEXT = ("kontext", "kontext-bfl")
WAN = ("wan", "wan-comfy", "wan22")
VACE = ("vace", "vace-on-t2v")  # a VACE file with its own base, and with a T2V one
WAN_FLOATS = ("time_embedding.", "time_embedder.")  # city96's converter keeps these F32
VIDEO = {"prompt": "a boat", "width": 64, "height": 64, "steps": 2, "num_frames": 5, "seed": 5,
         "output_format": "npy"}


def wan_transformer(folder: Path, cls: str = "WanTransformer3DModel") -> torch.nn.Module:
    import diffusers

    return getattr(diffusers, cls).from_pretrained(str(folder / "transformer"))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model's spec, by the name the daemon serves it under."""
    root = tmp_path_factory.mktemp("gguf-families")
    kontext = build_flux(root / "kontext")
    index = json.loads((kontext / "model_index.json").read_text())
    (kontext / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    write_gguf(tiny_transformer(), root / "kontext.gguf")
    write_gguf_bfl(tiny_transformer(), root / "kontext-bfl.gguf")
    specs = {name: Path(f"{root / name}.gguf,base={kontext}") for name in KONTEXT}
    wan = build_wan(root / "wan-t2v", "t2v", head_dim=16, num_layers=3)  # 32 wide: rows of whole Q8_0 blocks
    wan22 = build_wan(root / "wan-ti2v", "ti2v", head_dim=16)
    module = wan_transformer(wan)
    write_tensors(original_state_dict(module), root / "wan.gguf", "Q8_0", "wan", WAN_FLOATS)
    write_tensors(original_state_dict(module, "model.diffusion_model."), root / "wan-comfy.gguf", "Q8_0", "wan",
                  WAN_FLOATS)
    write_tensors(module.state_dict(), root / "wan-diffusers.gguf", "Q8_0", "wan", WAN_FLOATS)  # fit's twin
    write_tensors(original_state_dict(wan_transformer(wan22)), root / "wan22.gguf", "Q8_0", "wan", WAN_FLOATS)
    specs.update({name: Path(f"{root / name}.gguf,base={wan}") for name in ("wan", "wan-comfy")})
    specs["wan22"] = Path(f"{root / 'wan22'}.gguf,base={wan22}")
    i2v = build_wan(root / "wan-i2v-base", "i2v", head_dim=16)
    write_tensors(original_state_dict(wan_transformer(i2v)), root / "wan-i2v.gguf", "Q8_0", "wan", WAN_FLOATS)
    specs["wan-i2v"] = Path(f"{root / 'wan-i2v'}.gguf,base={i2v}")
    vace = build_wan(root / "wan-vace-base", "vace", head_dim=16)
    write_tensors(original_state_dict(wan_transformer(vace, "WanVACETransformer3DModel")), root / "vace.gguf",
                  "Q8_0", "wan", WAN_FLOATS)
    specs.update({"vace": Path(f"{root / 'vace'}.gguf,base={vace}"),
                  "vace-on-t2v": Path(f"{root / 'vace'}.gguf,base={wan}")})
    return specs


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, files: dict[str, Path]) -> Iterator[Daemon]:
    args = [a for name, spec in files.items() for a in ("--model", f"{name}={spec}")]
    with shared_daemon(tmp_path_factory.mktemp("gguf-families-daemon"), [*args, "--workers", "1",
                                                                         "--job-timeout", "120"], model_cache) as d:
        yield d


async def done(s: Any, body: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The finished job and its first output's bytes."""
    job = await wait_job(s, (await submit(s, body))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return job, await r.read()


def pixels(png: bytes) -> np.ndarray:
    """An image's pixels, once its own metadata is checked to name the quantization."""
    with Image.open(io.BytesIO(png)) as img:
        assert Q8 in img.info["approximations"], img.info
        return np.asarray(img.convert("RGB"), dtype=np.int16)


def test_gguf_kontext_and_wan_list_their_task_and_quantization(daemon: Daemon) -> None:
    async def go() -> dict[str, dict[str, Any]]:
        async with http(daemon.socket) as s:
            _, models = await get(s, "/v1/models")
        return {m["id"]: m for m in models["data"]}

    listed = asyncio.run(go())
    for name in KONTEXT:
        entry = listed[name]
        assert (entry["task"], entry["edits"]) == ("instruction-edit", ["instruction-edit"]), entry
        assert entry["approximations"] == [Q8], entry
    for name in WAN:
        entry = listed[name]
        assert (entry["task"], entry["approximations"]) == ("text-to-video", [Q8]), entry
    assert (listed["wan"]["edits"], listed["wan22"]["edits"]) == ([], ["image-to-video"])  # as their bases
    entry = listed["wan-i2v"]
    assert (entry["task"], entry["edits"], entry["approximations"]) == ("image-to-video", ["image-to-video"], [Q8])


def test_a_gguf_kontext_edits_the_image_it_is_sent_under_either_naming(daemon: Daemon) -> None:
    body = {"prompt": "make it red", "image": b64(1), "width": 64, "height": 64, "steps": 2, "seed": 3}

    async def go() -> dict[str, tuple[dict[str, Any], bytes]]:
        async with http(daemon.socket) as s:
            return {name: await done(s, {**body, "model": name}) for name in KONTEXT}

    got = asyncio.run(go())
    sent = blocky(1, 64).astype(np.int16)
    edited = {name: pixels(png) for name, (_, png) in got.items()}
    for name, (job, _) in got.items():
        assert job["approximations"] == [Q8], job
        assert edited[name].shape == sent.shape and np.abs(edited[name] - sent).mean() > 4, name
    assert np.abs(edited["kontext-bfl"] - edited["kontext"]).max() <= 1  # the same weights, either naming


def test_gguf_wan_makes_videos_and_a_wan22_one_animates_an_image(daemon: Daemon) -> None:
    async def go() -> dict[str, tuple[dict[str, Any], bytes]]:
        async with http(daemon.socket) as s:
            got = {name: await done(s, {**VIDEO, "model": name}) for name in WAN}
            got["wan22-image"] = await done(s, {**VIDEO, "model": "wan22", "image": b64(1)})
            return got

    got = asyncio.run(go())
    videos = {name: np.load(io.BytesIO(data)) for name, (_, data) in got.items()}
    for name, (job, _) in got.items():
        assert job["approximations"] == [Q8], job
        assert videos[name].shape[0] == 5 and videos[name].std() > 0, (name, videos[name].shape)
    assert np.array_equal(videos["wan-comfy"], videos["wan"])  # ComfyUI's prefix changes nothing
    assert not np.array_equal(videos["wan22-image"], videos["wan22"])  # the image is what changed it


def test_a_gguf_wan21_i2v_animates_the_image_it_is_sent(daemon: Daemon) -> None:
    async def go() -> dict[int, tuple[dict[str, Any], bytes]]:
        async with http(daemon.socket) as s:
            return {img: await done(s, {**VIDEO, "model": "wan-i2v", "image": b64(img)}) for img in (1, 2)}

    got = asyncio.run(go())
    videos = {img: np.load(io.BytesIO(data)) for img, (_, data) in got.items()}
    for img, (job, _) in got.items():
        assert job["approximations"] == [Q8], job
        assert videos[img].shape[0] == 5 and videos[img].std() > 0, videos[img].shape
    assert not np.array_equal(videos[1], videos[2])  # the picture (its latents, its CLIP embedding) is what differs


def test_a_wan_vace_gguf_is_refused_naming_the_wan_pipelines_served(daemon: Daemon) -> None:
    """A job for either is answered 503 ``model_load_failed`` with the load's reason, as any model whose
    load fails; the reason says VACE is not served and which Wan pipelines are."""
    async def go() -> dict[str, tuple[int, dict[str, Any]]]:
        got = {}
        async with http(daemon.socket) as s:
            for name in VACE:
                async with s.post("/v1/jobs", json={**VIDEO, "model": name}) as r:
                    got[name] = r.status, await r.json()
        return got

    got = asyncio.run(go())
    served = "the Wan pipelines served are WanPipeline (Wan 2.1 T2V, Wan 2.2 TI2V) and WanImageToVideoPipeline"
    for name, (status, body) in got.items():
        assert (status, body["error"]["code"]) == (503, "model_load_failed"), (name, body)
        assert "Wan VACE pipelines (WanVACEPipeline) are conditioned on a control video" in body["error"]["message"]
        assert served in body["error"]["message"], (name, body)
    # with a T2V base it loaded: diffusers dropped the VACE blocks and the rest served text-to-video
    assert "vace.gguf holds a Wan VACE transformer (vace_blocks.*)" in got["vace-on-t2v"][1]["error"]["message"]


@pytest.mark.parametrize("name", ["wan", "wan-i2v"])
def test_original_wan_names_load_as_the_source_weights_still_quantized(files: dict[str, Path], name: str) -> None:
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from diffusiond.pipelines.loaders import load_gguf

    path, base = str(files[name]).split(",base=")
    pipeline = load_gguf(Path(path), name="w", device=torch.device("cpu"), dtype=torch.float32,
                         options={"base": base})
    got = dict(pipeline._pipe.transformer.named_parameters())  # type: ignore[attr-defined]
    source = wan_transformer(Path(base)).state_dict()
    assert got.keys() == {k for k in source if "rope" not in k}
    for key, tensor in got.items():
        weight = dequantize_gguf_tensor(tensor) if hasattr(tensor, "quant_type") else tensor.data
        assert weight.shape == source[key].shape, key
        assert (weight.float() - source[key]).abs().max() <= source[key].abs().max() / 127 + 1e-7, key
    quantized = ["blocks.1.attn1.to_q.weight", "blocks.0.attn2.to_out.0.weight", "blocks.1.ffn.net.0.proj.weight"]
    if name == "wan-i2v":  # the image cross-attention's projections too
        quantized += ["blocks.0.attn2.add_k_proj.weight", "blocks.1.attn2.add_v_proj.weight"]
    for key in quantized:
        assert getattr(got[key].quant_type, "name", None) == "Q8_0", key


def test_fit_sizes_a_wan_gguf_from_its_header(files: dict[str, Path]) -> None:
    from diffusiond.daemon.residency.fit import gguf_tensors, group_bytes

    def cli(spec: Path) -> dict[str, Any]:
        ran = subprocess.run([sys.executable, "-m", "diffusiond", "fit", str(spec), "--json", "--working", "0",
                              "--dtype", "float32"], capture_output=True, text=True, cwd=ROOT.parent, timeout=60)
        assert ran.returncode == 0, ran.stderr
        return {k: v for k, v in json.loads(ran.stdout).items() if k != "spec"}

    report = cli(files["wan"])
    path = Path(str(files["wan"]).split(",base=")[0])
    tensors = gguf_tensors(path)
    assert report["components"]["transformer"] == sum(t.stored for t in tensors)  # Q8_0 as stored, the rest F32
    assert {"text_encoder", "vae"} <= report["components"].keys()  # the base's other components counted
    assert [c["name"] for c in report["configurations"]] == ["none", "group", "model", "sequential"]
    assert all(c["approximations"] == ["gguf-Q8_0"] for c in report["configurations"])
    assert cli(files["wan-comfy"]) == report
    # group offloading keeps the transformer's blocks apart, the original names' embeddings with the rest
    twin = group_bytes("transformer", gguf_tensors(path.with_name("wan-diffusers.gguf")), "float32")
    for name in ("wan", "wan-comfy"):
        original = gguf_tensors(Path(str(files[name]).split(",base=")[0]))
        assert group_bytes("transformer", original, "float32") == twin < sum(t.stored for t in original), name


@pytest.mark.parametrize(("gguf", "base", "holds"), [("kontext-bfl", "wan", "FLUX"), ("wan-comfy", "kontext", "Wan")])
def test_a_gguf_with_another_familys_base_says_the_base_is_wrong(files: dict[str, Path], gguf: str, base: str,
                                                                 holds: str) -> None:
    from diffusiond.pipelines.errors import PipelineError
    from diffusiond.pipelines.loaders import load_gguf

    path, other = str(files[gguf]).split(",base=")[0], str(files[base]).split(",base=")[1]
    with pytest.raises(PipelineError, match=f"holds a {holds} transformer, but base=.* is a .* pipeline .*: name the "
                                            "pipeline the GGUF file was made from as base="):
        load_gguf(Path(path), name="x", device=torch.device("cpu"), dtype=torch.float32, options={"base": other})


@pytest.mark.parametrize(("gguf", "base", "says"), [
    ("wan-i2v", "wan", r"wan-i2v.gguf holds a Wan 2.1 I2V transformer \(img_emb.\*\), but the transformer of base=.* "
                       "has no image embedding; base= must be a WanImageToVideoPipeline folder"),
    ("wan", "wan-i2v", r"wan.gguf holds a Wan transformer without Wan 2.1 I2V's image embedding .* base= must be the "
                       "pipeline the file was made from"),
    # a TI2V file and a T2V base differ in shapes only: the error names base= as what tells them apart
    ("wan22", "wan", r"wan22.gguf does not fit the transformer of base=.*patch_embedding.weight expected shape.*: "
                     "base= names another size or variant of the family than the GGUF file was made from"),
])
def test_a_wan_gguf_with_another_variants_base_names_base(files: dict[str, Path], gguf: str, base: str,
                                                          says: str) -> None:
    from diffusiond.pipelines.errors import PipelineError
    from diffusiond.pipelines.loaders import load_gguf

    path, other = str(files[gguf]).split(",base=")[0], str(files[base]).split(",base=")[1]
    with pytest.raises(PipelineError, match=says):
        load_gguf(Path(path), name="x", device=torch.device("cpu"), dtype=torch.float32, options={"base": other})


def test_a_wan22_i2v_gguf_on_a_wan21_i2v_base_names_the_base_it_needs(files: dict[str, Path], tmp_path: Path) -> None:
    """A Wan 2.2 I2V A14B file (QuantStack's) has no CLIP embedding but takes the image's latents
    in its input; on a Wan 2.1 I2V base it was told to use a T2V base, which cannot run it."""
    from diffusiond.pipelines.errors import PipelineError
    from diffusiond.pipelines.loaders import load_gguf

    base = str(files["wan-i2v"]).split(",base=")[1]
    module = _transformer(Z + 4 + Z, Z, head_dim=16)  # noise, mask and image latents in; no image_dim
    write_tensors(original_state_dict(module), tmp_path / "i2v22.gguf", "Q8_0", "wan", WAN_FLOATS)
    with pytest.raises(PipelineError, match=r"i2v22.gguf holds a Wan image-to-video transformer without an image "
                                            r"embedding .*Wan 2.2 I2V A14B.*without an image encoder "
                                            r"\(Wan-AI/Wan2.2-I2V-A14B-Diffusers\)"):
        load_gguf(tmp_path / "i2v22.gguf", name="x", device=torch.device("cpu"), dtype=torch.float32,
                  options={"base": base})


def test_a_damaged_base_component_is_not_blamed_on_the_gguf_file(files: dict[str, Path], tmp_path: Path) -> None:
    """A shape error in the base's VAE (its config edited, its weights not) said the GGUF file did
    not fit the base's transformer, and that base= named another variant."""
    import shutil

    from diffusiond.pipelines.errors import PipelineError
    from diffusiond.pipelines.loaders import load_gguf

    path, base = str(files["wan"]).split(",base=")
    damaged = Path(shutil.copytree(base, tmp_path / "base"))
    config = json.loads((damaged / "vae" / "config.json").read_text())
    (damaged / "vae" / "config.json").write_text(json.dumps({**config, "base_dim": 2 * config["base_dim"]}))
    with pytest.raises(PipelineError, match=r"cannot load the other components of base=.* beside the transformer "
                                            r"of wan.gguf: .*the base folder is damaged") as err:
        load_gguf(Path(path), name="x", device=torch.device("cpu"), dtype=torch.float32, options={"base": str(damaged)})
    assert "base= names another size or variant" not in str(err.value)


def test_a_wan_gguf_without_its_patch_embedding_says_what_it_lacks(files: dict[str, Path], tmp_path: Path) -> None:
    """city96's converter writes a Wan file's 5-D tensor in a second step; a file without it left the
    transformer's weight on the meta device, and diffusers said only "Cannot copy out of meta tensor"."""
    from diffusiond.pipelines.errors import PipelineError
    from diffusiond.pipelines.loaders import load_gguf

    base = str(files["wan"]).split(",base=")[1]
    tensors = original_state_dict(wan_transformer(Path(base)))
    del tensors["patch_embedding.weight"]
    write_tensors(tensors, tmp_path / "cut.gguf", "Q8_0", "wan", WAN_FLOATS)
    with pytest.raises(PipelineError, match=r"cut.gguf lacks weights of the base's WanTransformer3DModel \(a Wan "
                                            r"file needs its 5-D patch_embedding.weight"):
        load_gguf(tmp_path / "cut.gguf", name="x", device=torch.device("cpu"), dtype=torch.float32,
                  options={"base": base})
