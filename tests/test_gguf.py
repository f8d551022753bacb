"""GGUF transformers served by a real daemon (issue 28): ``--model flux=FILE.gguf,base=FOLDER`` on a CPU.

The transformer is a tiny FLUX one written as GGUF (tests/fluxkit.py), the rest of the pipeline a tiny
FluxPipeline folder built in the test. diffusers dequantizes each layer's weight as it runs, with plain torch
ops, so its GGUF path runs on a CPU; the test generates an image and checks that the quantization is named
wherever an output is described: the model's entry, the job, and the PNG's own metadata.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import pytest
from daemonkit import get, http, submit, wait_job
from fluxkit import build_flux, tiny_transformer, write_gguf
from PIL import Image

from conftest import ROOT

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux(tmp_path_factory.mktemp("flux") / "flux")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_gguf_transformer_generates_and_names_its_quantization(daemon_factory, flux: Path, qtype: str) -> None:  # type: ignore[no-untyped-def]
    path = flux.parent / f"flux-{qtype}.gguf"
    write_gguf(tiny_transformer(), path, qtype)
    d = daemon_factory("--model", f"flux={path},base={flux}", "--job-timeout", "120")

    async def go() -> tuple[dict, dict, bytes]:  # type: ignore[type-arg]
        async with http(d.socket) as s:
            _, models = await get(s, "/v1/models")
            job = await wait_job(s, (await submit(s, {"prompt": "a fox", "model": "flux", "steps": 2,
                                                      "width": 64, "height": 64}))["id"])
            async with s.get(job["outputs"][0]["url"]) as r:
                return models["data"][0], job, await r.read()

    entry, job, png = asyncio.run(go())
    name = f"gguf-{qtype}(transformer, dequantized per layer to float32)"
    assert entry["approximations"] == [name] and entry["offload"] == "none"
    assert job["status"] == "succeeded", job
    assert job["approximations"] == [name]
    with Image.open(io.BytesIO(png)) as img:
        assert img.size == (64, 64) and name in img.info["approximations"]


def test_a_gguf_without_its_base_or_offloaded_on_cpu_is_refused_at_start(flux: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_gguf(tiny_transformer(), path)

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--socket", str(tmp_path / "s"), *args],
                              capture_output=True, text=True, cwd=ROOT.parent, timeout=60)

    cpu = serve("--model", f"f={path},base={flux}", "--offload", "group")
    assert cpu.returncode == 2 and "offload=group needs an accelerator device" in cpu.stderr
    missing = serve("--model", f"f={path},base={tmp_path / 'nowhere'}")
    assert missing.returncode == 2 and "nowhere does not exist" in missing.stderr


def test_a_gguf_without_a_base_says_how_to_name_one(tmp_path: Path) -> None:
    from diffusiond.pipelines import PipelineError
    from diffusiond.pipelines.registry import load_pipeline

    path = tmp_path / "t.gguf"
    write_gguf(tiny_transformer(), path)
    with pytest.raises(PipelineError, match="holds only the transformer: name the rest of the pipeline with base="):
        load_pipeline(str(path))
