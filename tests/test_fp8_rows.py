"""``fp8=rowwise`` (issues 28 and 31): the denoiser's linear layers multiply in fp8, scaled per row.

torch's fp8 product (``torch._scaled_mm``) runs on the CPU too, so the layer's arithmetic and the option end to
end are checked here on a tiny FLUX pipeline loaded through the folder loader a real model uses; the speed it is
for is the GPU's (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fluxkit import build_flux

from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.compile import CompiledPipeline, compilations
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.fp8_rows import Fp8RowwiseLinear

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
    assert name.startswith("fp8-rowwise(") and f": {len(converted)} linear layers)" in name and converted
    assert not any("norm" in n or n == "proj_out" for n in converted)  # diffusers' skip list, as fp8 storage
    assert type(transformer.proj_out) is torch.nn.Linear and transformer.proj_out.weight.dtype == torch.float32
    want, got = run(exact), run(fp8)
    assert not torch.equal(got, want)  # an approximation, hence its name
    psnr = 10 * torch.log10(1 / torch.mean((got.float() - want.float()) ** 2))
    assert psnr > 25, f"fp8 rowwise moved the picture beyond rounding: PSNR {psnr:.1f} dB"


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


@pytest.mark.parametrize(("options", "words"), [
    ({"fp8": "2"}, r"fp8='2': use fp8=1 \(torchao\) or fp8=rowwise"),
    ({"fp8": "rowwise", "offload": "stream"}, "offload=stream with fp8=rowwise is refused"),
])
def test_what_cannot_work_is_refused_at_load_naming_the_value(flux: Path, options: dict[str, str], words: str) -> None:
    with pytest.raises(PipelineError, match=words):
        load_pipeline(str(flux), device="cpu", dtype="float32", options=options)
