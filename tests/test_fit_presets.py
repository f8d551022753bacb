"""A ``random:`` preset under a ``--device-memory`` budget (issue 28): ``offload=auto`` sizes it from the folder its
first load saved, as it sizes any folder, instead of loading all of it. Wan 2.1 1.3B in bf16 holds 13.5 GiB of
weights (its UMT5-XXL encoder 10.6 of them): resident, it cannot run in 12 GiB; with its encoder in fp8 storage it
loads in 9 GiB and ran out of memory in the transformer at 832x480x81 on the GPU, where offloading fits.

The folder is the preset's own layout (names and shapes from its modules built on the meta device), written as
safetensors headers over sparse files: the headers are all that sizing reads, and the disk holds none of the 14 GB.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from diffusiond.daemon.residency.fit import choose_auto, fit
from diffusiond.pipelines.preset_tables import PRESETS, Net, folder_name
from diffusiond.pipelines.presets import build_part, parameter_counts

BUDGET = 12 * 2**30
WAN = "random:wan-1.3b"


def _write_headers(module: torch.nn.Module, path: Path) -> None:
    """A safetensors file of ``module``'s weights in bf16 whose data is a hole (a sparse file); tied ones once, as
    ``save_pretrained`` writes them (UMT5's token table is its encoder's too)."""
    header: dict[str, object] = {}
    offset = 0
    for name, t in module.named_parameters():
        nbytes = t.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """A cache of its own holding wan-1.3b's saved folder, as ``DIFFUSIOND_CACHE`` (the session's is put back)."""
    root = tmp_path_factory.mktemp("preset-cache")
    folder = root / "models" / folder_name(PRESETS["wan-1.3b"])
    for key, part in PRESETS["wan-1.3b"].parts.items():
        if isinstance(part, Net):
            (folder / key).mkdir(parents=True)
            _write_headers(build_part(part, "meta", torch.bfloat16), folder / key / "model.safetensors")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return root


def test_before_its_first_load_a_preset_stays_unsized_and_says_when_it_will_be(
        model_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DIFFUSIOND_CACHE", str(tmp_path))
    chosen, why, unfit = choose_auto(WAN, {}, "bfloat16", on_cpu=False, budget=BUDGET)
    assert (chosen, unfit) == ("none", "")
    assert "until its first load has built and saved it" in why, why


@pytest.mark.parametrize("options", [{}, {"quant": "text_encoder:fp8-storage"}])
def test_offload_auto_offloads_wan_1_3b_in_12_gib_rather_than_load_it_whole(
        cache: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, str]) -> None:
    """Resident, the weights alone (or with the encoder in fp8, the weights and the working estimate) overrun the
    budget, so auto takes the fastest offload that fits: group, which keeps no whole component on the device."""
    monkeypatch.setenv("DIFFUSIOND_CACHE", str(cache))
    report = fit(WAN, budget=BUDGET, options=options)
    counts = parameter_counts(PRESETS["wan-1.3b"])
    assert options or report.components == {k: 2 * n for k, n in counts.items()}  # the inputs: its headers
    resident = next(c for c in report.configurations if c.name == "none")
    assert resident.fits is False and resident.device_bytes > 8 * 2**30, resident
    chosen, why, unfit = choose_auto(WAN, options, "bfloat16", on_cpu=False, budget=BUDGET)
    assert (chosen, unfit) == ("group", ""), why
    assert "group at bfloat16: needs" in why
