"""``fp8=rowwise`` (issues 28 and 31): the denoiser's linear layers multiply in fp8, scaled per row.

torch's fp8 product (``torch._scaled_mm``) runs on the CPU too, so the layer's arithmetic and the option end to
end are checked here on a tiny FLUX pipeline loaded through the folder loader a real model uses; the speed it is
for is the GPU's (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from daemonkit import http, submit, wait_job
from fluxkit import build_flux, tiny_transformer, write_gguf

from diffusiond.daemon.residency.fit import fit
from diffusiond.ipc import messages as m
from diffusiond.pipelines import fusion, load_pipeline
from diffusiond.pipelines.compile import CompiledPipeline, compilations
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.fp8_rows import Fp8RowwiseLinear
from diffusiond.pipelines.ip_adapter import IpAdapters
from diffusiond.pipelines.spec import FP8_ROWS_NAME, check_options, check_spec
from diffusiond.pipelines.tiny import ensure_tiny

PARAMS = m.BatchParams(width=64, height=64, steps=2, guidance=3.5)


def run(pipe: object) -> torch.Tensor:
    with torch.inference_mode():
        return pipe.run(PARAMS, [m.RequestSpec(request_id="1", prompt="a red fox", seed=1)],  # type: ignore[attr-defined]
                        lambda _s, _t: True)[0]


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux(tmp_path_factory.mktemp("fp8rows") / "flux")


def test_one_loud_token_does_not_coarsen_the_others() -> None:
    """Per-row scales: a token 10^6 times louder than the rest (an attention sink, a padding token) leaves the other
    tokens' products as close as fp8 rounding allows; under one scale for the whole input they would round to 0."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    x[3] *= 1e6
    layer = Fp8RowwiseLinear(linear)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (1, 32)
    with torch.no_grad():
        want, got = linear(x), layer(x)
    quiet = [i for i in range(8) if i != 3]
    err = (got[quiet] - want[quiet]).norm(dim=1) / want[quiet].norm(dim=1)
    assert float(err.max()) < 0.05, err
    scale = x.abs().max() / 448  # one scale for the whole input: the quiet rows fall below fp8's subnormals
    one = ((x / scale).to(torch.float8_e4m3fn).float() * scale) @ linear.weight.detach().t() + linear.bias.detach()
    one_err = (one[quiet] - want[quiet]).norm(dim=1) / want[quiet].norm(dim=1)
    assert float(one_err.min()) > 0.5, one_err


def test_the_option_converts_the_transformers_linear_layers_names_itself_and_stays_near_the_exact_picture(
        flux: Path) -> None:
    exact = load_pipeline(str(flux), device="cpu", dtype="float32")
    fp8 = load_pipeline(str(flux), device="cpu", dtype="float32", options={"fp8": "rowwise"})
    transformer = fp8.pipe.transformer  # type: ignore[attr-defined]
    converted = [n for n, mod in transformer.named_modules() if isinstance(mod, Fp8RowwiseLinear)]
    (name,) = fp8.capabilities.approximations
    assert name == FP8_ROWS_NAME and converted
    assert not any("norm" in n or "embed" in n or n == "proj_out" for n in converted)  # spec.FP8_ROWS_KEEP
    for kept in (transformer.proj_out, transformer.x_embedder, transformer.context_embedder,
                 transformer.time_text_embed.timestep_embedder.linear_1):  # embedders stay too
        assert type(kept) is torch.nn.Linear and kept.weight.dtype == torch.float32
    want, got = run(exact), run(fp8)
    assert not torch.equal(got, want)  # an approximation, hence its name
    psnr = 10 * torch.log10(1 / torch.mean((got.float() - want.float()) ** 2))
    assert psnr > 25, f"fp8 rowwise moved the picture beyond rounding: PSNR {psnr:.1f} dB"


def test_the_qkv_projections_are_fused_before_quantizing_and_make_the_unfused_picture(
        flux: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attention's query, key and value become one fp8 product, so their common input is quantized once; with
    row scales that changes no number beyond the products' summation order (the same model unfused, here with
    its attentions taken as ones whose processor cannot read a fusion)."""
    fused = load_pipeline(str(flux), device="cpu", dtype="float32", options={"fp8": "rowwise"})
    attentions = [mod for mod in fused.pipe.transformer.modules() if hasattr(mod, "to_qkv")]  # type: ignore[attr-defined]
    assert attentions and all(isinstance(a.to_qkv, Fp8RowwiseLinear) and not hasattr(a, "to_q") for a in attentions)
    monkeypatch.setattr(fusion, "_fuses_in_place", lambda _attn: False)
    apart = load_pipeline(str(flux), device="cpu", dtype="float32", options={"fp8": "rowwise"})
    assert not any(hasattr(mod, "to_qkv") for mod in apart.pipe.transformer.modules())  # type: ignore[attr-defined]
    assert torch.allclose(run(fused), run(apart), atol=1e-4, rtol=0)


def test_a_compiled_model_traces_the_fp8_layers_and_makes_the_same_picture(flux: Path) -> None:
    """``--compile`` with fp8=rowwise: the layers are plain tensors and torch ops, so dynamo traces them (eager
    backend here, as tests/test_compile.py) and the picture is the uncompiled fp8 model's."""
    fp8 = load_pipeline(str(flux), device="cpu", dtype="float32", options={"fp8": "rowwise"})
    want = run(fp8)
    before = compilations()
    compiled = CompiledPipeline(fp8, "default", {"compile_backend": "eager"})
    got = run(compiled)
    assert compilations() > before
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_an_input_without_rows_gives_an_empty_output() -> None:
    layer = Fp8RowwiseLinear(torch.nn.Linear(32, 16))
    assert layer(torch.randn(2, 0, 32)).shape == (2, 0, 16)  # _scaled_mm refuses an empty scale


@pytest.mark.parametrize(("options", "words"), [
    ({"fp8": "2"}, r"fp8='2': use fp8=1 \(torchao\) or fp8=rowwise"),
    ({"fp8": "rowwise", "offload": "stream"}, "offload=stream with fp8=rowwise is refused"),
    ({"fp8": "rowwise", "offload": "sequential"}, "fp8=rowwise with offload=sequential is refused"),
    ({"fp8": "1", "offload": "group"}, "fp8=1 with offload=group is refused: torchao swaps each linear layer's"),
    ({"fp8": "rowwise", "fuse_qkv": "1"}, "fp8=rowwise with fuse_qkv=1 is refused"),
    ({"fp8": "rowwise", "quant": "transformer:fp8-storage"},
     "fp8=rowwise with quant=transformer:fp8-storage is refused: the transformer is quantized already"),
])
def test_what_cannot_work_is_refused_before_a_load_naming_the_values(flux: Path, options: dict[str, str],
                                                                     words: str) -> None:
    """Refused where the daemon checks a model's options at start (``check_options``), so a
    daemon with ``--preload none`` does not start and then fail every job; a load refuses the same."""
    with pytest.raises(PipelineError, match=words):
        check_options(options)
    with pytest.raises(PipelineError, match=words):
        load_pipeline(str(flux), device="cpu", dtype="float32", options=options)


def test_a_gguf_transformer_is_refused_at_start_by_fit_and_at_load(flux: Path, tmp_path: Path) -> None:
    """Nothing plain to convert, so the option is refused where the daemon checks a
    spec at start and by ``fit``, rather than named on every output; a load (the engine checked nothing, say)
    names the quantized layers."""
    pytest.importorskip("gguf")
    path = tmp_path / "t.gguf"
    write_gguf(tiny_transformer(), path)
    for check in (lambda: check_spec(f"{path},base={flux}", {"fp8": "rowwise"}),
                  lambda: fit(f"{path},base={flux},fp8=rowwise", dtype="float32")):
        with pytest.raises(PipelineError, match="fp8=rowwise with a GGUF transformer is refused"):
            check()
    with pytest.raises(PipelineError, match=r"fp8=rowwise: the model.s transformer .*its linear layers are GGUFLinear"):
        load_pipeline(f"{path},base={flux}", device="cpu", dtype="float32", options={"fp8": "rowwise"})
    with pytest.raises(PipelineError, match=r"fp8='2': use fp8=1"):
        fit(f"{flux},fp8=2", dtype="float32")


@pytest.mark.parametrize("kind", ["flux", "unet", "qwen"])
def test_fit_counts_the_fp8_layers_as_loaded_and_lists_only_what_runs_with_them(
        flux: Path, kind: str, tmp_path: Path) -> None:
    """Sized at full width, fp8 did not help a model fit; and the configurations it refuses
    (fp8 storage of the denoiser, offload=stream, offload=sequential) are not offered. A UNet's convolutions
    stay at full width, as loaded (counted at 1 byte, admission let in a model that then overran),
    and Qwen-Image's img_mod and img_in are converted (counted as kept, by BFL FLUX's names)."""
    from qwenkit import build_qwen_edit

    folder = {"flux": lambda: flux, "unet": ensure_tiny, "qwen": lambda: build_qwen_edit(tmp_path / "qwen")}[kind]()
    pipe = load_pipeline(str(folder), device="cpu", dtype="float32", options={"fp8": "rowwise"})
    assert pipe.capabilities.approximations == (FP8_ROWS_NAME,)
    name, denoiser = next((n, c) for n, c in pipe.pipe.components.items()  # type: ignore[attr-defined]
                          if n in ("transformer", "unet"))
    loaded = sum(t.numel() * t.element_size() for t in [*denoiser.parameters(), *denoiser.buffers()])
    scales = sum(b.numel() * 4 for n, b in denoiser.named_buffers() if n.endswith("weight_scale"))
    report = fit(f"{folder},fp8=rowwise", dtype="float32", working=0)
    plain = fit(str(folder), dtype="float32", working=0)
    assert report.components[name] == loaded - scales  # every weight at the width it is loaded at
    rows = {c.name: c for c in report.configurations}
    assert list(rows) == ["none", "group", "model"]
    assert rows["none"].device_bytes < {c.name: c for c in plain.configurations}["none"].device_bytes
    assert all(c.approximations[-1] == f"{FP8_ROWS_NAME} at ~1 byte/weight" for c in rows.values())


def test_a_daemon_admits_the_model_in_a_budget_only_its_fp8_form_fits(flux: Path, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Under a budget between the two sizes, the fp8 model is admitted and makes its picture."""
    small = {c.name: c for c in fit(f"{flux},fp8=rowwise", dtype="float32", working=0).configurations}["none"]
    big = {c.name: c for c in fit(str(flux), dtype="float32", working=0).configurations}["none"]
    budget = (small.device_bytes + big.device_bytes) // 2 + 16384  # + the scales and position ids fit left out
    assert budget < big.device_bytes
    d = daemon_factory("--model", f"fx={flux},fp8=rowwise", "--device", "cpu", "--dtype", "float32",
                       "--device-memory", str(budget), "--preload", "none", "--job-timeout", "120")

    async def go() -> dict:  # type: ignore[type-arg]
        async with http(d.socket) as s:
            job = await submit(s, {"prompt": "a fox", "steps": 2, "width": 64, "height": 64})
            return await wait_job(s, job["id"])

    job = asyncio.run(go())
    assert job["status"] == "succeeded", job
    assert FP8_ROWS_NAME in job["approximations"]


def test_a_daemon_with_a_bad_fp8_value_does_not_start(flux: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--socket", str(tmp_path / "s"), "--model",
                          f"fx={flux},fp8=2", "--device", "cpu", "--preload", "none"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "fp8='2': use fp8=1 (torchao) or fp8=rowwise" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_fused_quantizer_falls_back_to_the_eager_ops_at_any_failure(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A compile failure after the first call (a recompile past dynamo's limit) failed every later
    job. Here the fused kernel (CUDA only) is a stand-in that fails on its second call."""
    from diffusiond.pipelines import fp8_rows

    calls: list[int] = []

    def fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(x.shape[0])
        if len(calls) > 1:
            raise RuntimeError("recompile limit hit")
        return fp8_rows._rows(x)

    monkeypatch.setattr(fp8_rows, "_FUSED", [fused])
    fp8_rows._quantize(torch.randn(1, 32), fuse=True)  # a single row stays eager: a dynamic graph specialises it
    assert calls == []
    x = torch.randn(8, 32)
    want = fp8_rows._rows(x)
    for _ in range(3):
        got = fp8_rows._quantize(x, fuse=True)
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    assert calls == [8, 8] and fp8_rows._FUSED == [None]  # failed once, eager from then on
    assert "the fused quantizer failed (RuntimeError: recompile limit hit)" in caplog.text


def test_adapters_and_weight_updates_are_refused_naming_the_option(flux: Path) -> None:
    """Peft's own refusal named a class the user never chose; the model's option is named instead."""
    from diffusiond.pipelines.hotswap import adapters_for
    from diffusiond.pipelines.loras import unsupported

    pipe = load_pipeline(str(flux), name="fx", device="cpu", dtype="float32", options={"fp8": "rowwise"})
    assert adapters_for(pipe, {}, 2) is None
    assert unsupported(pipe) == ("model fx runs with fp8=rowwise, whose fp8 linear layers take no LoRA layers (peft "
                                 "wraps torch's own): serve it without fp8=rowwise to use adapters")


def test_an_ip_adapter_on_a_unet_model_in_fp8_is_refused_naming_the_option() -> None:
    """Diffusers' UNet IP-Adapter load casts the whole UNet to its dtype, the fp8 weights back to full
    width without their scales, so after the start's fit test every job of the model failed, plain ones too."""
    pipe = load_pipeline("tiny", name="t", device="cpu", dtype="float32", options={"fp8": "rowwise"})
    adapters = IpAdapters(pipe, {"style": ("/nonexistent/ip.safetensors", "/nonexistent/encoder")})
    assert adapters.errors == {"style": "model t runs with fp8=rowwise, and diffusers' IP-Adapter load casts its "
                                        "UNet's fp8 layers back to full width without their scales: serve it without "
                                        "fp8=rowwise to use IP-Adapters"}
    assert any(isinstance(mod, Fp8RowwiseLinear) for mod in pipe.pipe.unet.modules())  # type: ignore[attr-defined]

