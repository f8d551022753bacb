"""``diffusiond fit`` and ``offload=auto`` (issue 28): configurations sized from headers, checked against the
tensors a real load makes.

The model is a tiny FLUX pipeline built in the test (tests/fluxkit.py) and GGUF files of its transformer
written with the ``gguf`` package; every figure ``fit`` reads off a header is compared with what torch holds
once the same files are loaded (``pipelines/offload.py`` applies the same rule to the loaded modules).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fluxkit import build_flux, tiny_transformer, write_gguf

from conftest import ROOT
from diffusiond.daemon.config import ConfigError, build_config
from diffusiond.daemon.residency.fit import choose_auto, choose_offload, device_weights, fit, model_tensors
from diffusiond.daemon.residency.gguf_header import BLOCK, read_gguf
from diffusiond.daemon.residency.sizes import WeightsError
from diffusiond.pipelines import offload
from diffusiond.pipelines.base import weight_bytes
from diffusiond.pipelines.spec import check_options
from diffusiond.pipelines.streaming import BlockStreamer

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
    stream = rows["stream"]  # no budget: the least it runs with, here all three blocks resident (module doc)
    assert stream.resident_blocks is not None
    BlockStreamer(pipe.transformer, "cpu", stream.resident_blocks)
    assert 0 <= offload.device_bytes(pipe, "stream") - stream.device_bytes <= SLACK
    assert rows["model"].device_bytes == max(report.components.values())
    transformer = pipe.transformer
    params = sum(p.numel() for p in transformer.parameters())
    assert rows["fp8"].device_bytes == total - _bytes(transformer) + params
    assert rows["fp8"].approximations and not rows["none"].approximations
    order = [c.name for c in report.configurations]
    assert order == ["none", "fp8", "stream", "group", "model", "sequential"]  # fastest first
    assert rows["sequential"].device_bytes < rows["group"].device_bytes < total


def test_fit_does_not_count_a_safety_checker_the_loader_never_reads(flux: Path, tmp_path: Path) -> None:
    """SD 1.5's folders carry a 1.2 GB safety checker the loader passes as None: counted, a model that fits a budget
    would be refused it."""
    import shutil

    folder = tmp_path / "with-checker"
    shutil.copytree(flux, folder)
    shutil.copytree(folder / "vae", folder / "safety_checker")
    assert fit(str(folder), dtype="float32", working=0).components == \
        fit(str(flux), dtype="float32", working=0).components


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
    assert "fp8" not in rows and "stream" not in rows  # already quantized
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
    assert rows["stream"] < rows["none"]
    # a FluxPipeline folder: the pipeline stream was measured on (auto_skips.py), so auto streams it where it fits
    for budget, want in [(rows["none"], "none"), (rows["none"] - 1, "stream"), (rows["stream"] - 1, "group"),
                         (rows["group"] - 1, "sequential")]:
        chosen, why = choose_offload(fit(str(flux), budget=budget, working=0))
        assert chosen == want, (budget, why)
    listed = {c.name: c for c in fit(str(flux), budget=rows["none"] - 1, working=0).configurations}
    assert listed["stream"].fits and listed["stream"].device_bytes > rows["group"]
    assert rows["fp8"] < rows["none"]  # fp8 would fit at none - 1, yet auto never picks an approximation
    chosen, why = choose_offload(fit(str(flux), budget=10, working=0))
    assert chosen == "sequential" and "nothing fits" in why and "offload=group" in why
    assert choose_auto(str(flux), {}, "bfloat16", on_cpu=True, budget=10)[0] == "none"
    assert choose_auto("tiny", {}, "bfloat16", on_cpu=False, budget=10)[0] == "none"  # not sizable: resident


@pytest.mark.parametrize(("options", "dropped"), [
    ({"quant": "transformer:int8"}, {"fp8", "stream"}),  # offload=stream refuses a quantized denoiser
    ({"quant": "transformer:fp8-storage"}, {"fp8", "stream"}),  # stored in fp8 already
    ({"fp8": "1"}, {"fp8", "stream", "group", "sequential"}),  # torchao's weights come after the hooks
    ({"quant": "text_encoder_2:fp8-storage"}, set()),  # the encoders may be quantized beside either
])  # fmt: skip
def test_fit_lists_no_configuration_the_models_own_options_would_refuse_to_load(
        flux: Path, options: dict[str, str], dropped: set[str]) -> None:
    """Listed, a refused configuration is one ``offload=auto`` (or a user reading ``fit``) would choose and the
    worker would then refuse to load; each listed one passes the load's option check with the model's options."""
    names = {c.name for c in fit(str(flux), working=0, options=options).configurations}
    assert names == {"none", "fp8", "stream", "group", "model", "sequential"} - dropped
    for name in names - {"none", "fp8"}:
        check_options({**options, "offload": name})


def test_fit_lists_neither_stream_nor_fp8_storage_beside_an_unquantized_gguf(flux: Path, tmp_path: Path) -> None:
    """An F16 GGUF transformer counts as plain floats, yet its load refuses both."""
    path = tmp_path / "t.gguf"
    write_gguf(tiny_transformer(), path, "F16")
    names = [c.name for c in fit(f"{path},base={flux}", working=0).configurations]
    assert names == ["none", "group", "model", "sequential"]
    listed = json.loads(_cli(f"{path},base={flux}", "--working", "0", "--json").stdout)  # the command
    assert [c["name"] for c in listed["configurations"]] == names


def test_a_model_nothing_fits_has_its_jobs_refused_naming_every_configuration_tried(flux: Path) -> None:
    config = build_config({}, {"model": [f"f={flux}"], "offload": "auto", "device_memory": "1KB",
                               "device": "cuda:0"})
    unfit = config.models[0].nothing_fits  # what keeper.admit answers every job of it with (model_too_large)
    assert unfit.startswith("nothing fits the --device-memory budget of 1000 B with offload=auto: ")
    for name in ("none", "stream", "group", "model", "sequential"):
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
    ok = _cli(str(flux), "--device-memory", "300KB", "--working", "0", "--dtype", "bfloat16")
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:8]] == ["none", "fp8", "stream", "group", "model", "sequential"]
    assert "offload=auto would run it with group at bfloat16: needs " in ok.stdout
    as_json = json.loads(_cli(str(flux), "--device-memory", "300KB", "--working", "0", "--dtype", "bfloat16",
                              "--json").stdout)
    assert as_json["auto"] == "group" and as_json["fits"] is True
    none = _cli(str(flux), "--device-memory", "1KB", "--working", "0")
    assert none.returncode == 1
    assert "nothing fits 1000 B" in none.stderr and "sequential (offload=sequential) needs" in none.stderr
    on_cpu = json.loads(_cli(str(flux), "--device", "cpu", "--json").stdout)
    assert [c["name"] for c in on_cpu["configurations"]] == ["none", "fp8"]
    bad = _cli("tiny")
    assert bad.returncode == 2 and "built in code" in bad.stderr


def test_the_fit_command_lists_sage_attention_as_an_approximation_of_every_configuration(flux: Path) -> None:
    """``attention=sage`` quantizes Q and K whichever way the model fits; an exact kernel approximates nothing."""
    from diffusiond.pipelines.attention import KERNELS

    sage = json.loads(_cli(f"{flux},attention=sage", "--json").stdout)["configurations"]
    assert sage and all(KERNELS["sage"].quantized in c["approximations"] for c in sage), sage
    assert next(c["approximations"][0] for c in sage if c["name"] == "fp8").startswith("fp8-storage")
    table = _cli(f"{flux},attention=_sage_qk_int8_pv_fp8_cuda")
    assert table.returncode == 0 and "sage-attention(Q and K in int8, P·V in fp8)" in table.stdout.splitlines()[2]
    exact = json.loads(_cli(f"{flux},attention=flash", "--json").stdout)["configurations"]
    assert [c["approximations"] for c in exact if c["name"] == "none"] == [[]]
    bad = _cli(f"{flux},attention=sage_hub")
    assert bad.returncode == 2 and "attention=sage_hub is refused" in bad.stderr


def test_offload_settings_and_their_refusals(flux: Path, tmp_path: Path) -> None:
    config = build_config({}, {"model": [f"f={flux}"], "offload": "auto", "device_memory": "1KB"})
    assert config.models[0].options["offload"] == "none" and "CPU" in config.models[0].offload_reason
    with pytest.raises(ConfigError, match="offload=group needs an accelerator device"):
        build_config({}, {"model": [f"f={flux}"], "offload": "group"})
    with pytest.raises(ConfigError, match="--compile with offload=auto is refused"):
        build_config({}, {"model": [f"f={flux}"], "offload": "auto", "compile": "default"})
    with pytest.raises(ConfigError, match="cpu_offload=1 means offload=model, but offload=group"):
        build_config({"models": [{"spec": str(flux), "offload": "group", "options": {"cpu_offload": "1"}}]}, {})
    with pytest.raises(ConfigError, match="offload='fast' is not one of none, model, group, sequential, stream, auto"):
        build_config({"models": [{"spec": str(flux), "offload": "fast"}]}, {})
    toml = build_config({"models": [{"spec": str(flux), "offload": "none"}]}, {})
    assert toml.models[0].options["offload"] == "none"


# offload=stream: how many blocks stay, from the headers, against a hand computation from the real tensors ------
@pytest.fixture(scope="module")
def deep_flux(flux: Path) -> Path:
    """The tiny FLUX folder with a transformer of 3 double- and 4 single-stream blocks: with a ring of 3 slots,
    streaming pays only from the fourth block streamed on, so a budget has several counts to choose from."""
    from diffusers import FluxTransformer2DModel
    from fluxkit import TRANSFORMER

    out = flux.parent / "deep-flux"
    if not out.exists():
        shutil.copytree(flux, out)
        torch.manual_seed(1)
        FluxTransformer2DModel(**{**TRANSFORMER, "num_layers": 3, "num_single_layers": 4}).save_pretrained(
            str(out / "transformer"), safe_serialization=True)
    return out


def _stream_row(folder: Path, budget: int | None, working: int | None = 0) -> Any:
    return next(c for c in fit(str(folder), dtype="float32", budget=budget, working=working).configurations
                if c.name == "stream")


# the blocks laid end to end in name order (single_... then transformer_...), the streamed spread over them
S, T = "single_transformer_blocks.", "transformer_blocks."
STREAMED = {0: [S + "0", S + "1", S + "2", S + "3", T + "0", T + "1", T + "2"],
            1: [S + "0", S + "1", S + "2", T + "0", T + "1", T + "2"],
            2: [S + "0", S + "2", S + "3", T + "0", T + "2"],
            3: [S + "0", S + "2", T + "0", T + "2"],
            4: [S + "1", S + "3", T + "1"],
            5: [S + "1", T + "1"],
            6: [S + "3"],
            7: []}


def test_stream_keeps_the_most_blocks_the_budget_has_room_for(deep_flux: Path) -> None:
    pipe = _loaded(deep_flux, torch.float32)
    t = pipe.transformer  # type: ignore[attr-defined]

    def sizes(m: torch.nn.Module) -> list[int]:
        return [x.numel() * x.element_size() for x in [*m.parameters(), *m.buffers()]]

    blocks = {**{f"{T}{i}": sizes(b) for i, b in enumerate(t.transformer_blocks)},
              **{f"{S}{i}": sizes(b) for i, b in enumerate(t.single_transformer_blocks)}}
    always = _bytes(t) - sum(sum(v) for v in blocks.values())
    # the other components under leaf-level group offloading: twice the largest layer's own tensors
    others = max(2 * max(sum(x.numel() * x.element_size() for x in [*m._parameters.values(), *m._buffers.values()]
                             if x is not None) for m in c.modules())
                 for n, c in pipe.components.items() if isinstance(c, torch.nn.Module) and n != "transformer")

    def by_hand(k: int) -> int:
        s = STREAMED[k]
        slot = max((sum(-(-n // 512) * 512 for n in blocks[b]) for b in s), default=0)
        return always + sum(sum(v) for b, v in blocks.items() if b not in s) + min(3, len(s)) * slot + others

    total = sum(fit(str(deep_flux), dtype="float32").components.values())
    chosen = set()
    for k in range(8):
        budget = by_hand(k)
        want = max(j for j in range(8) if by_hand(j) <= budget)
        chosen.add(want)
        row = _stream_row(deep_flux, budget)
        assert (row.resident_blocks, row.device_bytes, row.fits) == (want, by_hand(want), True), k
        resident = sum(sum(v) for b, v in blocks.items() if b not in STREAMED[want])
        assert row.host_bytes == total - always - resident
        streamer = BlockStreamer(_loaded(deep_flux, torch.float32).transformer, "cpu", k)  # type: ignore[attr-defined]
        assert sorted(b.name for b in streamer.blocks) == sorted(STREAMED[k])
    # 3 to 6 resident: the ring (3 slots the size of a double-stream block) outweighs the blocks streamed
    assert chosen == {0, 1, 2, 7}
    least = min(by_hand(k) for k in range(8))
    short = _stream_row(deep_flux, least - 1)
    assert short.fits is False and short.device_bytes == least and short.resident_blocks == 0


def test_offload_stream_at_start_takes_resident_blocks_from_the_budget(
        deep_flux: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusiond.daemon.residency.fit import stream_inputs
    from diffusiond.daemon.residency.working import Shape, default_working
    from diffusiond.pipelines import stream_plan

    inputs = stream_inputs(model_tensors(str(deep_flux), {}, "float32")[0], "float32")
    assert inputs is not None
    # what each count needs with the working memory estimated as the daemon does (fit's default, 1024x1024)
    needs = {k: d + default_working(d, Shape(1024, 1024))
             for k in range(8) if (d := stream_plan.plan(*inputs, k).device_bytes)}
    seen = set()
    for budget in needs.values():
        want = _stream_row(deep_flux, budget, None).resident_blocks
        m = build_config({}, {"model": [f"f={deep_flux}"], "offload": "stream", "device_memory": str(budget),
                              "device": "cuda:0", "dtype": "float32"}).models[0]
        assert m.options["resident_blocks"] == str(want) and m.options["offload"] == "stream"
        assert m.offload_reason.startswith(f"offload=stream: {want} of 7 denoiser blocks resident") or want == 7
        assert m.nothing_fits == ""
        seen.add(want)
    assert len(seen) >= 3, seen
    def auto_at(budget: int) -> Any:
        return build_config({}, {"model": [f"f={deep_flux},offload=auto"], "device_memory": str(budget),
                                 "device": "cuda:0", "dtype": "float32"}).models[0]

    # a FluxPipeline folder: auto takes stream where a quarter of the blocks or more stay resident, else group,
    # which moves about as much (auto_skips.AUTO_STREAM_RESIDENT)
    one = auto_at(needs[1])  # 1 of 7 (14 %) resident: under the quarter
    assert one.options["offload"] == "group" and "only 1 of 7 denoiser blocks" in one.offload_reason, one
    few = auto_at(needs[0])
    assert choose_offload(fit(str(deep_flux), dtype="float32", budget=needs[0]))[0] == "group"  # fit says the same
    assert few.options["offload"] == "group" and "only 0 of 7 denoiser blocks would stay resident" in \
        few.offload_reason, few.offload_reason
    budget = next(b for b in sorted(needs.values()) if (_stream_row(deep_flux, b, None).resident_blocks or 0) >= 2)
    auto, count = auto_at(budget), _stream_row(deep_flux, budget, None).resident_blocks
    assert auto.options["offload"] == "stream" and auto.options["resident_blocks"] == str(count), auto
    assert auto.offload_reason.startswith("offload=auto chose stream")
    # and residency places it from its headers before its first load, at the plan's figure
    given = build_config({}, {"model": [f"f={deep_flux},offload=stream,resident_blocks=3"], "device": "cuda:0",
                              "dtype": "float32"}).models[0]
    for m, held in ((auto, count), (given, 3)):
        placed = device_weights(m.spec, m.options, "float32", on_cpu=False)
        assert placed == stream_plan.plan(*inputs, held).device_bytes, (m.spec, placed)
    assert device_weights(str(deep_flux), {"offload": "stream"}, "float32", on_cpu=False) is None  # no count yet
    # a hub id in the HF cache is placed the same way: a stream plan fills the budget
    import huggingface_hub.constants

    cache = deep_flux.parent / "hub-cache"
    repo = cache / "models--org--flux"
    if not repo.exists():
        (repo / "snapshots").mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("abc")
        (repo / "snapshots" / "abc").symlink_to(deep_flux, target_is_directory=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    hub = device_weights("org/flux", {"offload": "stream", "resident_blocks": "3"}, "float32", on_cpu=False)
    assert hub == stream_plan.plan(*inputs, 3).device_bytes
    assert device_weights("org/flux", {"offload": "group"}, "float32", on_cpu=False) is None  # its first load tells
    tight = build_config({}, {"model": [f"f={deep_flux}"], "offload": "stream", "device_memory": "1KB",
                              "device": "cuda:0"}).models[0]
    assert tight.nothing_fits.startswith("offload=stream does not fit the --device-memory budget of 1000 B: at its "
                                         "least (0 of 7 denoiser blocks resident"), tight.nothing_fits


def _control(folder: Path, cls: str, promax: bool = False, width: int | None = None) -> Path:
    """A ControlNet folder of ``cls``'s family (and text ``width``) with 20 KB of float32 weights (a union
    one's second file too)."""
    from safetensors.torch import save_file

    folder.mkdir()
    config = {"_class_name": cls, **({"cross_attention_dim": width} if width else {})}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("diffusion_pytorch_model", *(["diffusion_pytorch_model_promax"] if promax else [])):
        save_file({"w": torch.zeros(5_000)}, str(folder / f"{name}.safetensors"))
    return folder


def test_the_plan_leaves_room_for_what_the_worker_keeps_beside_and_auto_streams_nothing_unsized(
        deep_flux: Path, tmp_path: Path) -> None:
    """The ControlNets of the model's family (IP-Adapters, upscalers) stay on the worker's device beside the model,
    so a stream plan, which fills what it is given, plans in the budget less them; another
    family's, which the worker refuses unloaded, are not counted."""
    from diffusiond.daemon.residency import beside as kept
    from diffusiond.daemon.residency.fit import stream_inputs
    from diffusiond.daemon.residency.too_large import too_large_hints
    from diffusiond.daemon.residency.units import format_bytes
    from diffusiond.daemon.residency.working import Shape, default_working
    from diffusiond.pipelines import controlnet, ip_adapter, stream_plan

    assert set(controlnet.FAMILIES) == kept.CONTROL_FAMILIES and set(ip_adapter.FAMILIES) == kept.ADAPTER_FAMILIES
    flux_cn = _control(tmp_path / "flux-cn", "FluxControlNetModel", promax=True)  # counted once: from_pretrained's
    unet_cn = _control(tmp_path / "sd-cn", "ControlNetModel", width=768)
    sdxl_cn = _control(tmp_path / "sdxl-cn", "ControlNetModel", width=2048)
    single = tmp_path / "canny.safetensors"
    shutil.copy(unet_cn / "diffusion_pytorch_model.safetensors", single)
    # SD 1.5's and SDXL's share a class and are told apart by their text width; a single file is a UNet family's
    for pipeline, counted in [("StableDiffusionXLPipeline", 40_000), ("StableDiffusionPipeline", 40_000),
                              ("FluxPipeline", 20_000), (None, 80_000), ("WanPipeline", 0)]:
        got = kept.beside([str(flux_cn), str(unet_cn), str(sdxl_cn), str(single)], [], [], "float32", pipeline)
        assert got.nbytes == counted, (pipeline, got)
        # a guess where a single file's family is assumed, or the model's is not known; not for Wan, which keeps none
        assert got.assumed == (pipeline in ("StableDiffusionXLPipeline", "StableDiffusionPipeline", None)), got
    inputs = stream_inputs(model_tensors(str(deep_flux), {}, "float32")[0], "float32")
    assert inputs is not None
    every = stream_plan.plan(*inputs, 7).device_bytes
    budget = every + default_working(every, Shape(1024, 1024))  # all 7 resident, alone
    flags = {"device_memory": str(budget), "device": "cuda:0", "dtype": "float32"}
    model = [f"f={deep_flux},offload=auto"]
    alone = build_config({}, {"model": model, **flags}).models[0]
    other = build_config({}, {"model": model, "controlnet": [f"c={unet_cn}"], **flags}).models[0]
    beside = build_config({}, {"model": model, "controlnet": [f"c={flux_cn}", f"d={unet_cn}"], **flags}).models[0]
    assert alone.options["offload"] == beside.options["offload"] == "stream", (alone, beside)
    assert other.options == alone.options and other.offload_reason == alone.offload_reason  # an SD ControlNet
    assert int(beside.options["resident_blocks"]) < int(alone.options["resident_blocks"]) == 7
    assert alone.offload_reason.startswith("offload=auto chose stream at float32: needs "), alone.offload_reason
    assert (f"planned in {format_bytes(budget - 20_000)}: the --device-memory budget of {format_bytes(budget)} less "
            "the ControlNets' 19.53 KiB, kept beside it") in beside.offload_reason, beside.offload_reason
    # auto's choice among the configurations is the whole budget's, as before: they leave it to activations
    whole = next(c for c in fit(str(deep_flux), dtype="float32").configurations if c.name == "none")
    exact = {**flags, "device_memory": str(whole.needs)}
    for controlnets in ([], [f"c={flux_cn}"]):
        m = build_config({}, {"model": model, "controlnet": controlnets, **exact}).models[0]
        assert m.options["offload"] == "none" and "stream passed over" not in m.offload_reason, m
    # a stream plan asked for that does not fit at its least beside what is surely kept is refused at start, saying
    # so; where the count is a guess (here the model's pipeline is not known, so every family's ControlNet counts)
    # it is the least plan, which fits the budget alone, and says so
    least = _stream_row(deep_flux, None, None)
    tight = {**flags, "device_memory": str(least.needs + 10_000)}  # less room than the ControlNet's 20 KB
    sure = build_config({}, {"model": [f"f={deep_flux},offload=stream"], "controlnet": [f"c={flux_cn}"],
                             **tight}).models[0]
    assert "does not fit the --device-memory budget of" in sure.nothing_fits, sure
    assert "beside the ControlNets' 19.53 KiB kept with it" in sure.nothing_fits
    assert "offload=group" in sure.nothing_fits
    alone_least = _stream_row(deep_flux / "transformer", None, None)
    guessed = build_config({}, {"model": [f"f={deep_flux / 'transformer'},offload=stream"],
                                "controlnet": [f"c={unet_cn}"], **flags,
                                "device_memory": str(alone_least.needs + 10_000)}).models[0]
    assert guessed.nothing_fits == "" and guessed.options["offload"] == "stream", guessed
    assert guessed.options["resident_blocks"] == str(alone_least.resident_blocks), guessed  # the least
    assert "(the least plan: it does not fit beside the ControlNets' 19.53 KiB" in guessed.offload_reason, guessed
    # a pinned model's stream plan leaves room for the largest model beside it, which could never take it back
    pinned_f = build_config({}, {"model": [*model, f"g={deep_flux},offload=group"], "pin": ["f"],
                                 **flags}).models[0]
    assert pinned_f.options["offload"] == "group", pinned_f  # here the rest of the budget is too small for stream
    assert "left beside g (the largest model beside it)'s " in pinned_f.offload_reason, pinned_f
    # sized at the neighbour's own offload (group keeps little): with room for it, the pinned one streams
    roomy = {**flags, "device_memory": str(budget + 600_000)}  # resident alone would not fit: auto streams
    for mode in ("stream", "auto"):
        pinned_s = build_config({}, {"model": [f"f={deep_flux},offload={mode}", f"g={deep_flux},offload=group"],
                                     "pin": ["f"], **roomy}).models[0]
        assert pinned_s.options["offload"] == "stream" and pinned_s.nothing_fits == "", pinned_s
        group_bytes = next(c.device_bytes for c in fit(str(deep_flux), dtype="float32").configurations
                           if c.name == "group")
        assert f"less g (the largest model beside it)'s {format_bytes(group_bytes)}" in pinned_s.offload_reason
    # where stream would not fit at all, the start line does not send anyone to unpin for it
    group = next(c for c in fit(str(deep_flux), dtype="float32").configurations if c.name == "group")
    small = {**flags, "device_memory": str((group.needs + least.needs) // 2 + group.device_bytes)}  # g's, pinned
    crowded, given = build_config({}, {"model": [*model, f"g={deep_flux},offload=group"], "pin": ["g"],
                                       **small}).models
    assert crowded.options["offload"] == "group" and "passed over" not in crowded.offload_reason, crowded
    auto = build_config({}, {"model": model, "controlnet": [f"c={flux_cn}"], **tight}).models[0]
    assert auto.options["offload"] == "group", auto  # auto takes group rather than stream over the room
    # and its start line gives the reason that holds with the ControlNet gone too: too few blocks would stay resident
    assert "stream passed over: only 0 of 7 denoiser blocks would stay resident" in auto.offload_reason, auto
    # an upscaler whose size no header tells (a pickle), or a model pinned on the device: auto keeps to group,
    # and its start line says why FLUX is not streamed
    pth = tmp_path / "x4.pth"
    pth.write_bytes(b"not read by the engine")
    unsized = build_config({}, {"model": model, "upscaler": [f"up={pth}"], "controlnet": [f"c={flux_cn}"],
                                **flags}).models[0]
    assert unsized.options["offload"] == "group", unsized
    assert "stream passed over: what is kept beside it is not all sized: " in unsized.offload_reason
    assert "x4.pth" in unsized.offload_reason, unsized.offload_reason
    pinned = build_config({}, {"model": [*model, f"g={deep_flux},offload=group"], "pin": ["g"], **flags,
                               "device_memory": str(budget + group.device_bytes)}).models[0]  # g's own, pinned
    assert pinned.options["offload"] == "group" and "stream passed over: g is pinned on the same device" in \
        pinned.offload_reason, pinned.offload_reason
    # what a refusal or an out-of-memory failure tells a model, by the offload it runs with
    assert "resident_blocks=K" in too_large_hints(str(deep_flux), False, beside.options, auto=True)[0]
    assert "offload=auto" in too_large_hints(str(deep_flux), False, {})[0]
    placed = too_large_hints(str(deep_flux), False, {"offload": "none"}, auto=True)[0]  # auto chose none already
    assert "offload=auto" not in placed and "offload=group" in placed
    assert "offload=auto" not in too_large_hints(str(deep_flux), False, {"offload": "group"})[0]
    # which of the two the keeper asks for: a model auto placed, not one whose offload was given
    assert auto.auto_placed and crowded.auto_placed and not given.auto_placed


@pytest.mark.parametrize(("table", "flags", "match"), [
    ({"offload": "stream"}, {}, r"offload=stream keeps as many denoiser blocks on the device as --device-memory has "
                                r"room for: give --device-memory SIZE, or resident_blocks=N"),
    ({"offload": "stream"}, {"device": "cpu", "device_memory": "8GB"}, "offload=stream needs an accelerator device"),
    ({"offload": "stream", "options": {"resident_blocks": "9"}}, {},
     "resident_blocks=9, but its denoiser has 3 blocks; give 0 to 3"),
    ({"offload": "stream", "options": {"resident_blocks": "-1"}}, {}, r"resident_blocks='-1': give a whole number"),
    ({"offload": "group", "options": {"resident_blocks": "1"}}, {},
     "resident_blocks=1 applies to offload=stream only, and offload=group is given"),
    ({"offload": "auto", "options": {"resident_blocks": "1"}}, {}, "applies to offload=stream only"),
    ({"offload": "stream", "options": {"quant": "transformer:fp8-storage"}}, {"device_memory": "8GB"},
     r"offload=stream with quant=transformer:\.\.\. is refused"),
    ({"offload": "stream", "options": {"fp8": "1"}}, {"device_memory": "8GB"}, "offload=stream with fp8=1 is refused"),
])
def test_offload_stream_refusals_name_the_value_and_what_to_do(flux: Path, table: dict[str, Any],
                                                               flags: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config({"models": [{"spec": str(flux), **table}]}, {"device": "cuda:0", **flags})


def test_offload_stream_of_a_model_without_headers_or_of_a_gguf(flux: Path, q8: tuple[Path, dict[str, int]]) -> None:
    with pytest.raises(ConfigError, match=r"cannot choose resident_blocks from the files \(.*built in code.*\); give "
                                          r"resident_blocks=N"):
        build_config({}, {"model": ["tiny-flux"], "offload": "stream", "device_memory": "8GB", "device": "cuda:0"})
    given = build_config({"models": [{"spec": "tiny-flux", "offload": "stream", "options": {"resident_blocks": "1"}}]},
                         {"device": "cuda:0"}).models[0]
    assert given.options == {"offload": "stream", "resident_blocks": "1"}  # sized by the worker when it loads
    with pytest.raises(ConfigError, match="offload=stream is refused for a GGUF transformer"):
        build_config({}, {"model": [f"g={q8[0]},base={flux}"], "offload": "stream", "device_memory": "8GB",
                          "device": "cuda:0"})


# which pipelines auto streams (auto_skips.py) ----------------------------------------------------
def test_auto_streams_only_the_pipeline_stream_was_measured_on(flux: Path, tmp_path: Path) -> None:
    """A FluxKontextPipeline folder holds FLUX's very transformer, but an edit's reference picture doubles its
    tokens, which stream's plan does not count: auto takes group for it, and names stream when only that fits."""
    kontext = tmp_path / "kontext"
    shutil.copytree(flux, kontext)
    index = json.loads((kontext / "model_index.json").read_text())
    (kontext / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    rows = {c.name: c.device_bytes for c in fit(str(kontext), working=0).configurations}
    report = fit(str(kontext), budget=rows["none"] - 1, working=0)
    assert "stream" in report.auto_skips and "stream" not in fit(str(flux), working=0).auto_skips
    assert choose_offload(report)[0] == "group"
    assert {"stream", "group"} <= {c.name for c in report.configurations if c.fits}  # stream listed, not taken


def _bfl_file(path: Path, guided: bool, in_features: int | None = None) -> Path:
    from diffusers import FluxTransformer2DModel
    from fluxkit import TRANSFORMER, bfl_state_dict
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = bfl_state_dict(FluxTransformer2DModel(**{**TRANSFORMER, "guidance_embeds": guided, "num_layers": 3,
                                                  "num_single_layers": 4}),
                        "model.diffusion_model.")
    if in_features is not None:  # Fill's and Depth's wider latent input, under FLUX.1-dev's layout otherwise
        inner = sd["model.diffusion_model.img_in.weight"].shape[0]
        sd["model.diffusion_model.img_in.weight"] = torch.zeros(inner, in_features)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


@pytest.mark.parametrize(("guided", "in_features", "streamed"), [
    (True, None, True),  # flux-dev as downloaded (ComfyUI's prefix)
    (False, None, True),  # flux-schnell: no guidance embedding
    (True, 384, False),  # flux-fill: FluxFillPipeline's, not the measured one
    (True, 128, False),  # flux-depth
])
def test_a_single_file_streams_when_the_loader_would_build_flux1s_text_to_image_pipeline(
        tmp_path: Path, guided: bool, in_features: int | None, streamed: bool) -> None:
    spec = str(_bfl_file(tmp_path / "flux.safetensors", guided, in_features))
    rows = {c.name: c.device_bytes for c in fit(spec, working=0).configurations}
    chosen, why = choose_offload(fit(spec, budget=rows["none"] - 1, working=0))
    assert chosen == ("stream" if streamed else "group"), why
    # pipeline_class= names what the loader builds, whatever the file's layout says
    named = fit(spec, budget=rows["none"] - 1, working=0, options={"pipeline_class": "FluxFillPipeline"})
    assert choose_offload(named)[0] == "group"
