"""A GGUF file's BF16 tensors are sized as diffusers keeps them: as stored, whatever the model's dtype.

diffusers makes a GGUF's F32 and F16 tensors plain tensors, cast to the dtype, but wraps BF16 ones in
GGUFParameter (as Q8_0), dequantized per layer: city96's flux1-dev-BF16.gguf counted at float32 would be twice
what loads, and offload=auto would pick a slower offload than the model needs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fluxkit import build_flux, tiny_transformer, write_gguf

from diffusiond.daemon.residency.fit import fit
from diffusiond.pipelines.base import weight_bytes

pytest.importorskip("gguf")
SLACK = 2 * 77 * 8  # non-persistent buffers (position ids), counted by torch, absent from the files


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bf16_gguf_is_counted_as_stored_as_a_real_load_holds_it(tmp_path: Path, dtype: str) -> None:
    from diffusiond.pipelines.registry import load_pipeline

    flux = build_flux(tmp_path / "flux")
    sizes = write_gguf(tiny_transformer(), tmp_path / "flux-BF16.gguf", "BF16")
    spec = f"{tmp_path / 'flux-BF16.gguf'},base={flux}"
    report = fit(spec, dtype=dtype, working=0)
    pipeline = load_pipeline(spec, name="b", dtype=dtype)
    transformer = pipeline.pipe.transformer  # type: ignore[attr-defined]
    held = sum(p.numel() * p.element_size() for p in transformer.parameters())
    kept = [p for p in transformer.parameters() if getattr(p, "quant_type", None) is not None]
    assert kept and {p.dtype for p in kept} == {torch.uint8}  # BF16 kept as stored, not cast to the dtype
    assert report.components["transformer"] == held
    if dtype == "float32":
        assert held == sum(sizes.values())  # BF16 at 2 bytes, the F32 norms and biases at 4
    rows = {c.name: c for c in report.configurations}
    assert 0 <= weight_bytes(pipeline) - rows["none"].device_bytes <= SLACK
    assert rows["none"].approximations == () == pipeline.capabilities.approximations  # the file's own precision
    assert "fp8" not in rows and "stream" not in rows  # its transformer is a GGUF one: neither applies
