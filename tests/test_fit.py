"""``diffusiond fit`` and ``offload=auto`` (issue 28): configurations sized from headers, checked against the
tensors a real load makes.

The model is a tiny FLUX pipeline built in the test (tests/fluxkit.py) and GGUF files of its transformer
written with the ``gguf`` package; every figure ``fit`` reads off a header is compared with what torch holds
once the same files are loaded (``pipelines/offload.py`` applies the same rule to the loaded modules).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fluxkit import build_flux, tiny_transformer, write_gguf

from conftest import ROOT
from diffusiond.daemon.config import ConfigError, build_config
from diffusiond.daemon.residency.fit import choose_auto, choose_offload, fit, model_tensors
from diffusiond.daemon.residency.gguf_header import BLOCK, read_gguf
from diffusiond.daemon.residency.sizes import WeightsError
from diffusiond.pipelines import offload
from diffusiond.pipelines.base import weight_bytes

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux(tmp_path_factory.mktemp("flux") / "flux")


@pytest.fixture(scope="module")
def q8(flux: Path) -> tuple[Path, dict[str, int]]:
    path = flux.parent / "flux-Q8_0.gguf"
    return path, write_gguf(tiny_transformer(), path, "Q8_0")


def _loaded(flux: Path, dtype: torch.dtype) -> object:
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(str(flux), torch_dtype=dtype)


def _bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
               if not (t.data_ptr() in seen or seen.add(t.data_ptr())))


def test_the_ggml_block_table_is_the_gguf_packages() -> None:
    for kind, (name, block, nbytes) in BLOCK.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)] == (block, nbytes), name
        assert gguf.GGMLQuantizationType(kind).name == name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_gguf_headers_give_each_tensors_bytes(tmp_path: Path, qtype: str) -> None:
    sizes = write_gguf(tiny_transformer(), tmp_path / "t.gguf", qtype)
    got = read_gguf(tmp_path / "t.gguf")
    assert {k: t.nbytes for k, t in got.items()} == sizes
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    assert {t.name: int(t.n_bytes) for t in reader.tensors} == sizes
    assert {t.kind for t in got.values()} >= {qtype}


def test_a_corrupt_or_truncated_gguf_is_an_error_naming_the_file(tmp_path: Path) -> None:
    write_gguf(tiny_transformer(), tmp_path / "t.gguf")
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"cut\.gguf.*(truncated|past the end)"):
        read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(WeightsError, match=r"bad\.gguf: not a GGUF file"):
        read_gguf(tmp_path / "bad.gguf")
    (tmp_path / "huge.gguf").write_bytes(data[:8] + (2**40).to_bytes(8, "little") + data[16:])
    with pytest.raises(WeightsError, match="claims 1099511627776 tensors, over the limit"):
        read_gguf(tmp_path / "huge.gguf")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fit_on_a_folder_matches_the_loaded_modules(flux: Path, dtype: str) -> None:
    pipe = _loaded(flux, getattr(torch, dtype))
    report = fit(str(flux), dtype=dtype, working=0)
    rows = {c.name: c for c in report.configurations}
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    # the files hold what a module saves: its parameters and persistent buffers (CLIP's position ids are not
    # saved: 616 bytes the header cannot know of, within SLACK)
    assert report.components == {n: _saved(m) for n, m in modules.items()}
    total = sum(report.components.values())
    assert rows["none"].device_bytes == total and 0 <= _bytes_all(pipe) - total <= SLACK
    assert rows["none"].host_bytes == 0
    for mode in ("group", "model", "sequential"):
        assert 0 <= offload.device_bytes(pipe, mode) - rows[mode].device_bytes <= SLACK, mode
        assert rows[mode].host_bytes == total
    assert rows["model"].device_bytes == max(report.components.values())
    transformer = pipe.transformer
    params = sum(p.numel() for p in transformer.parameters())
    assert rows["fp8"].device_bytes == total - _bytes(transformer) + params
    assert rows["fp8"].approximations and not rows["none"].approximations
    order = [c.name for c in report.configurations]
    assert order == ["none", "fp8", "group", "model", "sequential"]  # fastest first
    assert rows["sequential"].device_bytes < rows["group"].device_bytes < total


SLACK = 2 * 77 * 8  # non-persistent buffers (position ids), counted by torch, absent from the files


def _saved(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    return sum(t.numel() * t.element_size() for t in module.state_dict().values()
               if not (t.data_ptr() in seen or seen.add(t.data_ptr())))


def _bytes_all(pipe: object) -> int:
    return sum(_bytes(m) for m in pipe.components.values() if isinstance(m, torch.nn.Module))  # type: ignore[attr-defined]


def test_fit_on_a_gguf_transformer_with_its_base_matches_the_loaded_pipeline(flux: Path, q8: tuple[Path, dict[str, int]]
                                                                             ) -> None:
    from diffusiond.pipelines.registry import load_pipeline

    path, sizes = q8
    report = fit(f"{path},base={flux}", dtype="float32", working=0)
    assert report.components["transformer"] == sum(sizes.values())  # Q8_0 as stored, F32 norms and biases as is
    pipeline = load_pipeline(f"{path},base={flux}", name="q8", dtype="float32")
    rows = {c.name: c for c in report.configurations}
    assert 0 <= weight_bytes(pipeline) - rows["none"].device_bytes <= SLACK
    assert "fp8" not in rows  # already quantized
    assert rows["none"].approximations == ("gguf-Q8_0",)
    assert pipeline.capabilities.approximations == ("gguf-Q8_0(transformer, dequantized per layer to float32)",)
    alone = fit(str(path), dtype="float32", working=0)
    assert list(alone.components) == ["transformer"] and alone.notes  # says the rest is not counted


def test_fit_on_a_single_safetensors_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_transformer().to(torch.bfloat16)
    save_file(model.state_dict(), str(tmp_path / "t.safetensors"))
    report = fit(str(tmp_path / "t.safetensors"), dtype="bfloat16", working=0)
    assert report.components == {"transformer": _bytes(model)}


def test_auto_takes_the_fastest_exact_configuration_that_fits(flux: Path) -> None:
    rows = {c.name: c.device_bytes for c in fit(str(flux), working=0).configurations}
    for budget, want in [(rows["none"], "none"), (rows["none"] - 1, "group"), (rows["group"] - 1, "sequential")]:
        chosen, why = choose_offload(fit(str(flux), budget=budget, working=0))
        assert chosen == want, (budget, why)
    assert rows["fp8"] < rows["none"]  # fp8 would fit at none - 1, yet auto never picks an approximation
    chosen, why = choose_offload(fit(str(flux), budget=10, working=0))
    assert chosen == "sequential" and "nothing fits" in why and "offload=group" in why
    assert choose_auto(str(flux), {}, "bfloat16", on_cpu=True, budget=10)[0] == "none"
    assert choose_auto("tiny", {}, "bfloat16", on_cpu=False, budget=10)[0] == "none"  # not sizable: resident


def test_a_model_nothing_fits_has_its_jobs_refused_naming_every_configuration_tried(flux: Path) -> None:
    config = build_config({}, {"model": [f"f={flux}"], "offload": "auto", "device_memory": "1KB",
                               "device": "cuda:0"})
    unfit = config.models[0].nothing_fits  # what keeper.admit answers every job of it with (model_too_large)
    assert unfit.startswith("nothing fits the --device-memory budget of 1000 B with offload=auto: ")
    for name in ("none", "group", "model", "sequential"):
        assert f"{name} (offload={name}) needs " in unfit
    roomy = build_config({}, {"model": [f"f={flux}"], "offload": "auto", "device_memory": "16GB", "device": "cuda:0"})
    assert roomy.models[0].nothing_fits == "" and roomy.models[0].options["offload"] == "none"


def test_working_memory_counts_beside_the_weights(flux: Path) -> None:
    bare = fit(str(flux), budget=2**30, working=0).configurations[0]
    estimated = fit(str(flux), budget=2**30).configurations[0]  # residency's estimate at 1024x1024
    assert estimated.working_bytes > 3 * 2**30 * 0.9 and not estimated.fits and bare.fits


def test_models_built_in_code_cannot_be_sized_from_headers() -> None:
    with pytest.raises(WeightsError, match="built in code"):
        model_tensors("random:flux-dev")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diffusiond", "fit", *args], capture_output=True, text=True,
                          cwd=ROOT.parent, timeout=60)


def test_the_fit_command_lists_fastest_first_and_fails_when_nothing_fits(flux: Path) -> None:
    ok = _cli(str(flux), "--device-memory", "300KB", "--working", "0")
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:7]] == ["none", "fp8", "group", "model", "sequential"]
    assert "offload=auto would run it with group" in ok.stdout
    as_json = json.loads(_cli(str(flux), "--device-memory", "300KB", "--working", "0", "--json").stdout)
    assert as_json["auto"] == "group" and as_json["fits"] is True
    none = _cli(str(flux), "--device-memory", "1KB", "--working", "0")
    assert none.returncode == 1
    assert "nothing fits 1000 B" in none.stderr and "sequential (offload=sequential) needs" in none.stderr
    on_cpu = json.loads(_cli(str(flux), "--device", "cpu", "--json").stdout)
    assert [c["name"] for c in on_cpu["configurations"]] == ["none", "fp8"]
    bad = _cli("tiny")
    assert bad.returncode == 2 and "built in code" in bad.stderr


def test_offload_settings_and_their_refusals(flux: Path, tmp_path: Path) -> None:
    config = build_config({}, {"model": [f"f={flux}"], "offload": "auto", "device_memory": "1KB"})
    assert config.models[0].options["offload"] == "none" and "CPU" in config.models[0].offload_reason
    with pytest.raises(ConfigError, match="offload=group needs an accelerator device"):
        build_config({}, {"model": [f"f={flux}"], "offload": "group"})
    with pytest.raises(ConfigError, match="--compile with offload=auto is refused"):
        build_config({}, {"model": [f"f={flux}"], "offload": "auto", "compile": "default"})
    with pytest.raises(ConfigError, match="cpu_offload=1 means offload=model, but offload=group"):
        build_config({"models": [{"spec": str(flux), "offload": "group", "options": {"cpu_offload": "1"}}]}, {})
    with pytest.raises(ConfigError, match="offload='fast' is not one of none, model, group, sequential, auto"):
        build_config({"models": [{"spec": str(flux), "offload": "fast"}]}, {})
    toml = build_config({"models": [{"spec": str(flux), "offload": "none"}]}, {})
    assert toml.models[0].options["offload"] == "none"
