"""Wan 2.2 A14B from two GGUF files, both experts quantized, served by a real daemon on a CPU (issue 28).

A14B's two 14B experts (``transformer`` for the high-noise steps, ``transformer_2`` for the low-noise ones,
switched at the base's ``boundary_ratio``) are 2 x 28 GB in bf16; community files come one per expert
(QuantStack's ``Wan2.2-T2V-A14B-HighNoise-Q8_0.gguf`` and ``...-LowNoise-Q8_0.gguf``), under the original Wan
names. tests/wankit.py's tiny A14B-shaped WanPipeline folder stands for ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``,
each expert written so (the low-noise one under ComfyUI's prefix, as some files are). Checked where a user
looks: the model's entry and its jobs name both experts' quantization, the log warns when the second loads
unquantized from the base, ``fit`` counts the files, and a base without a second expert is refused at start.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemonkit import Daemon, get, http, shared_daemon, submit, wait_job
from fluxkit import write_tensors
from wankit import build_wan, original_state_dict

pytest.importorskip("gguf")

FLOATS = ("time_embedding.", "time_embedder.")  # city96's and QuantStack's converters keep these F32
Q8 = "gguf-Q8_0({}, dequantized per layer to float32)"
VIDEO = {"prompt": "a boat", "width": 64, "height": 64, "steps": 2, "num_frames": 5, "seed": 5,
         "output_format": "npy"}


def expert(base: Path, component: str) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(str(base / component))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-a14b")
    base = build_wan(root / "a14b", "a14b", head_dim=16)  # 32 wide: rows of whole Q8_0 blocks
    write_tensors(original_state_dict(expert(base, "transformer")), root / "high.gguf", "Q8_0", "wan", FLOATS)
    write_tensors(original_state_dict(expert(base, "transformer_2"), "model.diffusion_model."), root / "low.gguf",
                  "Q8_0", "wan", FLOATS)
    one = Path(shutil.copytree(base, root / "one-expert"))  # Wan 2.1 T2V's layout: no transformer_2
    shutil.rmtree(one / "transformer_2")
    index = json.loads((one / "model_index.json").read_text())
    (one / "model_index.json").write_text(json.dumps({k: v for k, v in index.items()
                                                      if k not in ("transformer_2", "boundary_ratio")}))
    return {"base": base, "high": root / "high.gguf", "low": root / "low.gguf", "one-expert": one}


def spec(files: dict[str, Path], base: str = "base", second: bool = True) -> str:
    return f"{files['high']},base={files[base]}" + (f",transformer_2={files['low']}" if second else "")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, files: dict[str, Path]) -> Iterator[Daemon]:
    args = ["--model", f"a14b={spec(files)}", "--model", f"a14b-high-only={spec(files, second=False)}",
            "--workers", "1", "--job-timeout", "120"]
    with shared_daemon(tmp_path_factory.mktemp("gguf-a14b-daemon"), args, model_cache) as d:
        yield d


def test_both_experts_served_quantized_from_their_files_make_a_video(daemon: Daemon) -> None:
    async def go() -> tuple[dict[str, Any], dict[str, tuple[dict[str, Any], np.ndarray]]]:
        async with http(daemon.socket) as s:
            _, models = await get(s, "/v1/models")
            got = {}
            for name in ("a14b", "a14b-high-only"):
                job = await wait_job(s, (await submit(s, {**VIDEO, "model": name}))["id"])
                assert job["status"] == "succeeded", job
                async with s.get(job["outputs"][0]["url"]) as r:
                    got[name] = job, np.load(io.BytesIO(await r.read()))
        return {m["id"]: m for m in models["data"]}, got

    listed, got = asyncio.run(go())
    both = [Q8.format("transformer"), Q8.format("transformer_2")]
    assert (listed["a14b"]["task"], listed["a14b"]["approximations"]) == ("text-to-video", both), listed["a14b"]
    assert listed["a14b-high-only"]["approximations"] == both[:1], listed["a14b-high-only"]
    for name, want in (("a14b", both), ("a14b-high-only", both[:1])):
        job, video = got[name]
        assert job["approximations"] == want, job
        assert video.shape[0] == 5 and video.std() > 0, video.shape
    # the low-noise step ran each model's second expert: the same weights, from the file quantized or from the base
    # not, so the videos differ by no more than rounding, and by that much (the file's expert is the one that ran)
    assert 0 < np.abs(got["a14b"][1].astype(np.int16) - got["a14b-high-only"][1].astype(np.int16)).max() <= 8
    log = daemon.log_path.read_text(errors="replace")
    assert "a14b-high-only: the low-noise expert (transformer_2, 0.00 GB) loads from base=" in log
    assert "unquantized, at float32; give transformer_2=FILE.gguf" in log
    assert "a14b: the low-noise expert" not in log


def test_each_file_loads_as_its_own_expert_still_quantized_and_both_run(files: dict[str, Path]) -> None:
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from diffusiond.ipc import messages as m
    from diffusiond.pipelines.loaders import load_gguf

    pipeline = load_gguf(files["high"], name="a", device=torch.device("cpu"), dtype=torch.float32,
                         options={"base": str(files["base"]), "transformer_2": str(files["low"])})
    pipe: Any = pipeline._pipe  # type: ignore[attr-defined]
    for component in ("transformer", "transformer_2"):
        got = dict(getattr(pipe, component).named_parameters())
        source = expert(files["base"], component).state_dict()
        assert got["blocks.1.attn1.to_q.weight"].quant_type.name == "Q8_0", component
        for key, tensor in got.items():
            weight = dequantize_gguf_tensor(tensor) if hasattr(tensor, "quant_type") else tensor.data
            assert (weight.float() - source[key]).abs().max() <= source[key].abs().max() / 127 + 1e-7, (component, key)
    ran: dict[str, int] = {"transformer": 0, "transformer_2": 0}
    for component in ran:
        getattr(pipe, component).register_forward_hook(lambda *_, c=component: ran.__setitem__(c, ran[c] + 1))
    with torch.inference_mode():
        pipeline.run(m.BatchParams(width=32, height=32, steps=2, guidance=1.0, num_frames=5),
                     [m.RequestSpec(request_id="r", prompt="a boat", seed=1)], lambda _s, _t: True)
    assert ran["transformer"] > 0 and ran["transformer_2"] > 0, ran  # boundary_ratio 0.875: one step each


def test_fit_counts_both_files_instead_of_the_bases_second_expert(files: dict[str, Path]) -> None:
    from diffusiond.daemon.residency.fit import fit, gguf_tensors

    both = fit(spec(files), dtype="float32", working=0).components
    assert both["transformer"] == sum(t.stored for t in gguf_tensors(files["high"]))
    assert both["transformer_2"] == sum(t.stored for t in gguf_tensors(files["low"]))
    assert {"text_encoder", "vae"} <= both.keys()
    high_only = fit(spec(files, second=False), dtype="float32", working=0).components
    unquantized = sum(p.numel() * 4 for p in expert(files["base"], "transformer_2").parameters())
    assert high_only["transformer_2"] == unquantized > both["transformer_2"]  # loaded from the base at float32


def test_a_second_expert_file_without_a_base_that_has_one_is_refused_at_start(files: dict[str, Path], capsys: Any,
                                                                              monkeypatch: Any) -> None:
    import sys

    from diffusiond.cli import main

    server = type(sys)("diffusiond.daemon.server")  # a spec let through would start this, which serves nothing
    server.serve = lambda config: 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "diffusiond.daemon.server", server)
    assert main(["serve", "--model", f"a={spec(files, 'one-expert')}"]) == 2
    err = capsys.readouterr().err
    assert f"transformer_2={files['low']}: base={files['one-expert']} (WanPipeline) has no transformer_2, the " \
           "low-noise expert that file would replace" in err, err
    assert "drop transformer_2= or name an A14B pipeline as base=" in err
    assert main(["serve", "--model", f"a={files['base']},transformer_2={files['low']}"]) == 2
    assert "a folder or hub id loads its own transformer_2: drop the option" in capsys.readouterr().err
    assert main(["serve", "--model", f"a={spec(files).replace('low.gguf', 'lo.gguf')}"]) == 2
    assert "lo.gguf: no such file; give the low-noise expert's GGUF file" in capsys.readouterr().err


def test_a_low_noise_file_lacking_weights_is_the_one_named(files: dict[str, Path], tmp_path: Path) -> None:
    """Either file may be the incomplete one (city96's converter writes Wan's 5-D patch embedding in a second step):
    the error names the file that lacks it, not the first."""
    from diffusiond.pipelines.errors import PipelineError
    from diffusiond.pipelines.loaders import load_gguf

    tensors = original_state_dict(expert(files["base"], "transformer_2"))
    del tensors["patch_embedding.weight"]
    write_tensors(tensors, tmp_path / "cut-low.gguf", "Q8_0", "wan", FLOATS)
    with pytest.raises(PipelineError, match=r"^cut-low.gguf lacks weights of the base's WanTransformer3DModel"):
        load_gguf(files["high"], name="x", device=torch.device("cpu"), dtype=torch.float32,
                  options={"base": str(files["base"]), "transformer_2": str(tmp_path / "cut-low.gguf")})


def test_a_models_tables_base_and_second_expert_are_checked_at_start_and_fingerprinted(
        files: dict[str, Path], tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    """``base=`` and ``transformer_2=`` given in a ``[[models]]`` table's ``options`` are the spec's own to the
    loaders, so to the start's checks and to the parameter table's fingerprint too: a one-expert base
    is refused at start, and a second expert replaced in place is a new table."""
    import os
    import sys

    from diffusiond.cli import main
    from diffusiond.daemon.model_config import ModelConfig
    from diffusiond.daemon.state.params import table_key

    server = type(sys)("diffusiond.daemon.server")
    server.serve = lambda config: 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "diffusiond.daemon.server", server)
    toml = tmp_path / "a14b.toml"
    toml.write_text(f'[[models]]\nname = "a"\nspec = "{files["high"]}"\n'
                    f'options = {{ base = "{files["one-expert"]}", transformer_2 = "{files["low"]}" }}\n')
    assert main(["serve", "--config", str(toml)]) == 2
    assert "(WanPipeline) has no transformer_2, the low-noise expert that file would replace" in capsys.readouterr().err

    low = tmp_path / "low.gguf"
    shutil.copy(files["low"], low)
    config = ModelConfig(name="a", spec=str(files["high"]), options={"base": str(files["base"]),
                                                                     "transformer_2": str(low)})
    before = table_key(config, {})
    low.write_bytes(low.read_bytes() + b"\0" * 64)  # another quantization of the same expert, at the same path
    os.utime(low, ns=(1, 1))
    assert before is not None and table_key(config, {}) != before
