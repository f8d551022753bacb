"""``fit`` and ``offload=auto`` agree with what ``serve`` loads (issue 28 #1, #2, #7, #8, #12): a model's own
``quant=`` counted at its stored width, fp8 checkpoints at the dtype diffusers loads them at, a single-file
checkpoint with the components its ``config=`` folder adds, ``serve``'s default dtype, and refusals that say
what is wrong. Checked against the modules a real load makes where the figure is one a load can show.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fluxkit import build_flux

from conftest import ROOT
from diffusiond.daemon.residency.fit import choose_auto, fit

BF16 = "bfloat16"


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux(tmp_path_factory.mktemp("flux") / "flux")


def _saved(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _transformer_file(folder: Path) -> Path:
    return next((folder / "transformer").glob("*.safetensors"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diffusiond", "fit", *args], capture_output=True, text=True,
                          cwd=ROOT.parent, timeout=60)


def test_an_fp8_checkpoint_is_counted_at_the_dtype_diffusers_loads_it_at(flux: Path, tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "fp8"
    shutil.copytree(flux, folder)
    path = _transformer_file(folder)
    weights = load_file(str(path))
    save_file({k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in weights.items()}, str(path))
    loaded = FluxTransformer2DModel.from_pretrained(str(folder / "transformer"), torch_dtype=torch.bfloat16)
    assert fit(str(folder), dtype=BF16).components["transformer"] == _saved(loaded)  # 1 byte each before


def test_the_models_quant_counts_its_weights_at_their_stored_width_and_auto_runs_it_resident(flux: Path) -> None:
    plain = fit(str(flux), dtype=BF16, working=0).configurations[0]
    spec = f"{flux},quant=transformer:fp8-storage"
    rows = fit(spec, dtype=BF16).configurations
    stored = rows[0]
    assert stored.name == "none" and stored.device_bytes < plain.device_bytes
    assert all(any(a.startswith("fp8-storage(transformer") for a in c.approximations) for c in rows)
    # a budget the fp8-stored model fits whole in: auto runs it resident (group before: it sized it unquantized)
    chosen, why, unfit = choose_auto(spec, {"offload": "auto"}, BF16, on_cpu=False, budget=stored.needs)
    assert (chosen, unfit) == ("none", ""), why
    nf4 = fit(f"{flux},quant=transformer:nf4", dtype=BF16, working=0).configurations[0]
    assert nf4.device_bytes < stored.device_bytes  # about half a byte a weight against one


def test_the_quant_rows_match_a_real_fp8_storage_load_within_its_named_approximation(flux: Path) -> None:
    from diffusers import FluxPipeline

    from diffusiond.pipelines.quant import apply_quant

    pipe = FluxPipeline.from_pretrained(str(flux), torch_dtype=torch.bfloat16)
    apply_quant(pipe, {"transformer": "fp8-storage"}, torch.device("cpu"), torch.bfloat16)
    counted = fit(f"{flux},quant=transformer:fp8-storage", dtype=BF16).components["transformer"]
    loaded = _saved(pipe.transformer)
    assert abs(counted - loaded) <= 0.1 * loaded, (counted, loaded)


def test_a_single_file_counts_its_config_folders_other_components_and_notes_when_none_is_given(
        flux: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    alone = fit(str(_transformer_file(flux)), dtype=BF16)
    assert set(alone.components) == {"transformer"} and any("config=" in n for n in alone.notes)
    whole = fit(f"{_transformer_file(flux)},config={flux}", dtype=BF16)
    assert whole.components == fit(str(flux), dtype=BF16).components and not whole.notes
    comfy = tmp_path / "comfy.safetensors"  # ComfyUI's layout: every key under model.diffusion_model.
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(_transformer_file(flux))).items()},
              str(comfy))
    rows = {c.name: c for c in fit(str(comfy), dtype=BF16, working=0).configurations}
    assert "stream" in rows  # its blocks are found: none before, under the prefix


def test_the_fit_command_defaults_to_serves_dtype_and_refuses_what_it_cannot_size(flux: Path) -> None:
    out = _cli(str(flux), "--device-memory", "16GiB")  # fit's --device is cuda: serve's dtype there is bfloat16
    assert out.returncode == 0 and "of weights at bfloat16" in out.stdout, out
    assert "offload=auto would run it with none at bfloat16: needs " in out.stdout and " GiB budget" in out.stdout
    cpu = _cli(str(flux), "--device", "cpu", "--device-memory", "16GiB")
    assert cpu.returncode == 0 and "of weights at float32" in cpu.stdout, cpu
    rows = json.loads(_cli(f"{flux},quant=transformer:nf4", "--json").stdout)["configurations"]
    assert all(any(a.startswith("bitsandbytes-nf4(transformer") for a in r["approximations"]) for r in rows)
    big = _cli(str(flux), "--size", "99999999x99999999")
    assert big.returncode == 2 and "width and height must each be 8 to 16384" in big.stderr, big.stderr
    # the working estimate for a batch (the daemon batches up to --max-batch): four images' counted beside the weights
    one, four = (json.loads(_cli(str(flux), "--batch", n, "--json").stdout)["configurations"][0]["working_bytes"]
                 for n in ("1", "4"))
    assert four > one > 0
    for bad in ("0", "x", "257"):
        out = _cli(str(flux), "--batch", bad)
        assert out.returncode == 2 and "--batch" in out.stderr and "from 1 to 256" in out.stderr, out.stderr
    passwd = _cli("/etc/passwd")
    assert passwd.returncode == 2 and "a file, but not one fit can size" in passwd.stderr, passwd.stderr


def test_fit_takes_a_share_of_the_device_as_serve_does(flux: Path) -> None:
    total = int(next(x for x in Path("/proc/meminfo").read_text().splitlines()
                     if x.startswith("MemTotal:")).split()[1]) * 1024
    got = json.loads(_cli(str(flux), "--device", "cpu", "--device-memory", "0.5", "--json").stdout)
    assert got["budget"] == total // 2
