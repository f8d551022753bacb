"""``quant=COMPONENT:METHOD`` (issue 28): weights stored in fewer bits, per component, named in every output.

``fp8-storage`` (diffusers' layerwise casting) runs on a CPU, so it is exercised here end to end: on the
embedded ``tiny`` (a UNet) through the folder loader a real model uses, on a tiny FLUX pipeline with its T5
encoder quantized too, and by a real daemon whose jobs name it. The methods that need CUDA or a package the
suite does not install (bitsandbytes, torchao) are checked for their refusals, which a user on a CPU or
without the package meets first.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from daemonkit import get, http, submit, wait_job
from fluxkit import build_flux

from conftest import ROOT
from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.base import weight_bytes
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.quant import parse_quant
from diffusiond.pipelines.spec import parse_spec

PARAMS = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)


def run(pipe: object) -> torch.Tensor:
    with torch.inference_mode():
        return pipe.run(PARAMS, [m.RequestSpec(request_id="1", prompt="a red fox", seed=1)],  # type: ignore[attr-defined]
                        lambda _s, _t: True)[0]


def test_the_option_keeps_the_issues_commas_in_a_spec_and_refuses_what_it_cannot_read() -> None:
    spec = parse_spec("tiny,quant=transformer:nf4,text_encoder_2:int8,vae_tiling=1")
    assert spec.options == {"quant": "transformer:nf4,text_encoder_2:int8", "vae_tiling": "1"}
    assert parse_quant(spec.options["quant"]) == {"transformer": "nf4", "text_encoder_2": "int8"}
    for text, words in (("transformer", "COMPONENT:METHOD"), ("transformer:int3", "known: fp8-storage"),
                        ("unet:int8,unet:nf4", "given twice"), ("", "empty"), ("a b:int8", "COMPONENT:METHOD")):
        with pytest.raises(PipelineError, match=words):
            parse_quant(text)
    with pytest.raises(PipelineError, match="bad option 'text_encoder_2:int8'"):  # only quant takes the commas
        parse_spec("tiny,vae_tiling=1,text_encoder_2:int8")


def test_fp8_storage_keeps_the_unet_in_one_byte_per_weight_and_still_makes_the_picture(model_cache: Path) -> None:
    plain = load_pipeline("tiny", device="cpu", dtype="float32")
    quant = load_pipeline("tiny", device="cpu", dtype="float32", options={"quant": "unet:fp8-storage"})
    unet = quant.pipe.unet  # type: ignore[attr-defined]
    dtypes = {p.dtype for n, p in unet.named_parameters() if p.ndim > 1 and "norm" not in n}
    assert torch.float8_e4m3fn in dtypes
    assert weight_bytes(quant) < weight_bytes(plain)
    assert quant.capabilities.approximations == ("fp8-storage(unet, computed in float32)",)
    assert plain.capabilities.approximations == ()
    want, got = run(plain), run(quant)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert not torch.equal(got, want)  # an approximation: it differs, which is why it is named
    psnr = 10 * torch.log10(1 / torch.mean((got.float() - want.float()) ** 2))
    assert psnr > 10, f"fp8 storage changed the picture beyond rounding: PSNR {psnr:.1f} dB"


def test_fp8_storage_of_a_flux_transformer_and_its_t5_encoder(tmp_path: Path) -> None:
    folder = build_flux(tmp_path / "flux")
    pipe = load_pipeline(str(folder), device="cpu", dtype="float32",
                         options={"quant": "transformer:fp8-storage,text_encoder_2:fp8-storage"})
    assert pipe.capabilities.approximations == ("fp8-storage(transformer, computed in float32)",
                                                "fp8-storage(text_encoder_2, computed in float32)")
    t5 = pipe.pipe.text_encoder_2  # type: ignore[attr-defined]
    assert any(p.dtype == torch.float8_e4m3fn for p in t5.parameters())
    assert torch.isfinite(run(pipe)).all()


@pytest.mark.parametrize(("quant", "words"), [
    ("unet:nf4", "bitsandbytes runs on CUDA GPUs only"),
    ("unet:fp8", "needs a CUDA GPU with fp8 matrix units"),
    ("transformer:fp8-storage", "has no model component 'transformer'; its model components: text_encoder, unet, vae"),
])
def test_what_cannot_work_is_refused_at_load_naming_the_value(model_cache: Path, quant: str, words: str) -> None:
    with pytest.raises(PipelineError, match=words):
        load_pipeline("tiny", device="cpu", dtype="float32", options={"quant": quant})


def test_a_daemon_names_the_quantization_in_the_model_and_every_job(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny,quant=unet:fp8-storage", "--job-timeout", "120")

    async def go() -> tuple[dict, dict]:  # type: ignore[type-arg]
        async with http(d.socket) as s:
            _, models = await get(s, "/v1/models")
            job = await wait_job(s, (await submit(s, {"prompt": "a fox", "steps": 2, "width": 64, "height": 64}))["id"])
            return models["data"][0], job

    entry, job = asyncio.run(go())
    name = "fp8-storage(unet, computed in float32)"
    assert entry["approximations"] == [name]
    assert job["status"] == "succeeded", job
    assert job["approximations"] == [name]
    ps = subprocess.run([sys.executable, "-m", "diffusiond", "ps", "--socket", str(d.socket)], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ps.returncode == 0, ps.stderr
    header, row = ps.stdout.splitlines()[:2]
    assert header.split()[-2:] == ["offload", "approximations"]
    assert row.split()[0] == "tiny" and row.split()[-2:] == ["none", "fp8-storage(unet)"], ps.stdout


def test_a_typo_in_quant_stops_the_daemon_at_start_with_the_reason(tmp_path: Path, model_cache: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--socket", str(tmp_path / "s"),
                          "--model", "tiny,quant=unet:fp9"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "unet:fp9 is not a method" in out.stderr and "Traceback" not in out.stderr


def test_a_lora_on_an_fp8_stored_model_computes_in_the_models_dtype(tmp_path: Path, model_cache: Path) -> None:
    """peft would make the adapter's matrices float8 like the layer it wraps, and diffusers would copy the
    file's values into them, rounded to e4m3; they are made in float32 instead, so the
    adapter holds exactly the file's values and does what it does on the unquantized model, to rounding."""
    from lorakit import build_lora
    from safetensors.torch import load_file

    from diffusiond.pipelines.hotswap import adapters_for

    lora = build_lora(tmp_path / "ink", seed=11, rank=4, text_encoder=True)
    file = load_file(str(lora / "pytorch_lora_weights.safetensors"))
    assert {k.split(".")[0] for k in file} == {"unet", "text_encoder"}
    out = {}
    for label, options in (("plain", {}), ("fp8", {"quant": "unet:fp8-storage,text_encoder:fp8-storage"})):
        pipe = load_pipeline("tiny", device="cpu", dtype="float32", options=options)
        adapters = adapters_for(pipe, {}, 2)
        assert adapters is not None and adapters.register("ink", str(lora)) == ""
        for key, value in file.items():
            held = adapters._parameter(adapters.pipe.components, key, "ink")
            assert held.dtype == torch.float32 and torch.equal(held, value), f"{label}: {key} is not the file's"
        base = run(pipe)
        adapters.activate((m.LoraRef("ink", 1.0),))
        out[label] = run(pipe)
        assert not torch.equal(out[label], base)  # the adapter changed the picture
    psnr = 10 * torch.log10(1 / torch.mean((out["fp8"] - out["plain"]) ** 2))
    assert psnr > 10, f"the adapter on fp8 storage is not the adapter: PSNR {psnr:.1f} dB"


def test_a_lora_on_an_fp8_stored_bfloat16_model_holds_the_files_values_in_bfloat16(tmp_path: Path,
                                                                                    model_cache: Path) -> None:
    """The adapter is made in the dtype its layer computes in, whatever the model's dtype: the file's float32
    values rounded once, to bfloat16, as on the unquantized model, and never through e4m3."""
    from lorakit import build_lora
    from safetensors.torch import load_file

    from diffusiond.pipelines.hotswap import adapters_for

    lora = build_lora(tmp_path / "ink", seed=12, rank=4, text_encoder=True)
    file = load_file(str(lora / "pytorch_lora_weights.safetensors"))
    pipe = load_pipeline("tiny", device="cpu", dtype="bfloat16",
                         options={"quant": "unet:fp8-storage,text_encoder:fp8-storage"})
    adapters = adapters_for(pipe, {}, 2)
    assert adapters is not None and adapters.register("ink", str(lora)) == ""
    for key, value in file.items():
        held = adapters._parameter(adapters.pipe.components, key, "ink")
        assert held.dtype == torch.bfloat16 and torch.equal(held, value.to(torch.bfloat16)), key


def test_a_peft_that_cannot_be_steered_still_gets_a_computing_adapter_and_a_warning(
        tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Should a peft release rename what lora_dtypes steers, the adapter is still lifted out of float8 (no
    matmul takes it) and the log says its values were rounded, rather than the LoRA failing or silently
    differing."""
    from lorakit import build_lora

    from diffusiond.pipelines import lora_dtypes
    from diffusiond.pipelines.hotswap import adapters_for

    monkeypatch.setattr(lora_dtypes, "_PATCHED", "_a_method_peft_does_not_have")
    lora = build_lora(tmp_path / "dots", seed=13, rank=4, text_encoder=False)
    pipe = load_pipeline("tiny", device="cpu", dtype="float32", options={"quant": "unet:fp8-storage"})
    adapters = adapters_for(pipe, {}, 2)
    assert adapters is not None and adapters.register("dots", str(lora)) == ""
    held = [p for n, p in pipe.pipe.unet.named_parameters() if ".lora_" in n]
    assert held and all(p.dtype == torch.float32 for p in held)
    assert any("rounded to e4m3" in r.getMessage() for r in caplog.records), caplog.text
