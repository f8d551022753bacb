"""The model option ``attention=NAME`` (pipelines/attention.py) on the CPU, with tiny-flux (a real
``FluxTransformer2DModel``, whose attention goes through diffusers' dispatcher).

The backends that run on a CPU are ``native`` (the default path), ``_native_math``, ``_native_flash``
(torch's CPU flash kernel, the one the default picks there: bit-equal) and ``flex``. ``_native_math``
is the one that computes in another order: measured on tiny-flux at 64x64 in 2 steps it differs from
the default by 1e-6 in float32 before the 8-bit encode, so the PNGs agree to 1 level at most. The CUDA
kernels and the packaged ones (flash-attn, sageattention, xformers) are measured by
``scripts/gpu_round3.sh attention``; here only their refusals are.
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import http, shared_daemon, submit, wait_job
from PIL import Image

from conftest import ROOT
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import check_options

BODY = {"prompt": "a red fox", "width": 64, "height": 64, "steps": 2, "seed": 11, "output_format": "png"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Any]:
    args = ["--model", "plain=tiny-flux", "--model", "math=tiny-flux,attention=_native_math", "--workers", "1"]
    with shared_daemon(tmp_path_factory.mktemp("attention"), args, model_cache) as d:
        yield d


async def generate(d: Any, model: str) -> tuple[dict[str, Any], np.ndarray, dict[str, str]]:
    async with http(d.socket) as s:
        job = await wait_job(s, (await submit(s, {**BODY, "model": model}))["id"], timeout=300)
        assert job["status"] == "succeeded", job
        async with s.get(job["outputs"][0]["url"]) as r:
            with Image.open(io.BytesIO(await r.read())) as img:
                return job, np.asarray(img.convert("RGB")).astype(np.int16), dict(img.text)  # type: ignore[attr-defined]


async def test_an_exact_backend_is_named_everywhere_and_matches_the_default_within_rounding(daemon: Any) -> None:
    plain, default, plain_meta = await generate(daemon, "plain")
    math, other, meta = await generate(daemon, "math")
    async with http(daemon.socket) as s, s.get("/v1/models") as r:
        models = {m["id"]: m for m in (await r.json())["data"]}
    assert np.abs(default - other).max() <= 1  # another order of float operations, the same attention
    assert math["attention"] == meta["attention"] == models["math"]["attention"] == "_native_math"
    # an exact kernel is no approximation: nothing listed where quantized weights and caches are
    assert math["approximations"] == models["math"]["approximations"] == [] and "approximations" not in meta
    assert plain["attention"] is None and models["plain"]["attention"] is None and "attention" not in plain_meta


def test_models_and_ps_show_the_backend_of_a_model_off_the_default(daemon: Any) -> None:
    """An ``attention`` column, before the approximations, where a model runs another backend (``-`` for
    one on the default path); left out of a daemon whose models all run the default (tests/test_quant.py)."""
    for command in ("models", "ps"):
        out = subprocess.run([sys.executable, "-m", "diffusiond", command, "--socket", str(daemon.socket)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        header, *rows = out.stdout.splitlines()
        assert header.split()[-2:] == ["attention", "approximations"], out.stdout
        by_name = {r.split()[0]: r.split() for r in rows}
        assert by_name["math"][-2:] == ["_native_math", "-"] and by_name["plain"][-2:] == ["-", "-"], out.stdout


def test_a_backend_that_cannot_run_here_stops_the_start_naming_why(daemon_factory: Any) -> None:
    d = daemon_factory("--model", "bad=tiny-flux,attention=_native_cudnn", start=False)
    d.spawn()
    assert d.wait(180) != 0
    assert "attention=_native_cudnn runs on CUDA GPUs only, and this model is on cpu" in d.log()


def test_an_unknown_backend_stops_the_start_before_any_worker_listing_the_served_ones(daemon_factory: Any) -> None:
    d = daemon_factory("--model", "tiny-flux,attention=flash-attention", start=False)
    d.spawn()
    assert d.wait(60) == 2
    log = d.log()
    assert "attention='flash-attention' is not a backend diffusiond serves; known: native, _native_math" in log
    assert "_native_cudnn" in log and "sage" in log


@pytest.mark.parametrize(("name", "words"), [
    ("flash_hub", "attention=flash_hub is refused: it downloads its kernel from the Hugging Face Hub"),
    ("_native_npu", "attention=_native_npu is refused: it is for Ascend NPUs"),
    ("", None),
    ("native", None),
])
def test_names_are_checked_without_torch(name: str, words: str | None) -> None:
    if words is None:
        check_options({"attention": name})
        return
    with pytest.raises(PipelineError, match=words):
        check_options({"attention": name})


def load(spec: str, attention: str) -> Any:
    from diffusiond.pipelines.registry import load_pipeline

    return load_pipeline(spec, device="cpu", dtype="float32", options={"attention": attention})


def test_the_denoiser_alone_takes_the_backend_and_the_process_default_stays(model_cache: Path) -> None:
    """diffusers' ``set_attention_backend`` also makes its backend the process-wide default: put back, so
    other models and processors swapped in later run the default path."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    pipe = load("tiny-flux", "_native_math").pipe
    backends = {getattr(m.processor, "_attention_backend", "none") for m in pipe.transformer.modules()
                if hasattr(m, "processor")}
    assert backends == {AttentionBackendName._NATIVE_MATH}
    assert _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE
    native = load("tiny-flux", "native")  # the default path: nothing set at all
    assert native.capabilities.attention == "" and {
        m.processor._attention_backend for m in native.pipe.transformer.modules() if hasattr(m, "processor")} == {None}


def test_a_unet_refuses_the_option_naming_why_but_takes_the_default(model_cache: Path) -> None:
    with pytest.raises(PipelineError) as info:
        load("tiny", "_native_math")
    assert "UNet2DConditionModel" in str(info.value) and "not through diffusers' dispatcher" in str(info.value)
    assert load("tiny", "native").capabilities.attention == ""  # the default path is every model's


@pytest.mark.parametrize(("name", "package", "words"), [
    ("flash", "flash_attn", "Please install `flash-attn>=2.6.3`"),
    ("sage", "sageattention", "Please install `sageattention>=2.1.1`"),
])
def test_a_missing_package_is_named_with_what_to_install(model_cache: Path, name: str, package: str,
                                                         words: str) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(PipelineError, match=f"attention={name}: .*{words}"):
        load("tiny-flux", name)


def test_the_bench_times_each_backend_that_runs_and_lists_the_others_with_why(
        model_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``scripts/gpu_round3.sh attention``'s driver, on the CPU: what the GPU run will print."""
    import json

    from diffusiond.bench.attention import main

    assert main(["--model", "tiny-flux", "--device", "cpu", "--dtype", "float32", "--size", "64x64", "--steps", "2",
                 "--warmup-steps", "1", "--rounds", "1", "--backends", "_native_math,_native_cudnn"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["attention"]: r for r in got["results"]}
    assert list(rows) == ["native", "_native_math"] and rows["native"]["ratio"] == 1.0
    assert rows["native"]["max_diff"] == 0 and 0 < rows["_native_math"]["max_diff"] < 1e-4  # another order of sums
    assert got["skipped"] == {"_native_cudnn": "attention=_native_cudnn runs on CUDA GPUs only, and this model is on "
                                               "cpu"}
