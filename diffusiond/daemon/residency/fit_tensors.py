"""A tensor as ``fit`` counts it (residency/fit.py), and its width under a ``quant=`` method.

Apart from the files' reading so that a model held in memory (scripts/bench_bigger.py's, built in code) is counted
by the same rule as one read from headers: the daemon's ``offload=auto`` and a benchmark mirroring it agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from diffusiond.daemon.residency.gguf_header import FLOAT_TYPES
from diffusiond.daemon.residency.sizes import FLOATS, TARGET_BYTES
from diffusiond.pipelines.denoisers import DENOISERS
from diffusiond.pipelines.spec import FP8_ROWS_NAME, fp8_rows_kept, parse_quant

__all__ = ["QUANT_WIDTH", "Tensor", "quant_approximations", "quantize"]


@dataclass(frozen=True)
class Tensor:
    name: str
    kind: str  # a safetensors dtype (BF16, F32, ...) or a ggml type (Q8_0, F16, ...)
    stored: int  # bytes in the file
    elements: int
    dims: tuple[int, ...] = ()  # a safetensors header's shape; () where unknown (GGUF)

    def bytes_at(self, dtype: str) -> int:
        """On the device at the model's dtype: floats converted, quantized and integer tensors as stored."""
        return self.elements * TARGET_BYTES[dtype] if self.kind in FLOATS | FLOAT_TYPES else self.stored


QUANT_WIDTH: Final = {"fp8-storage": (8, 0), "int8": (8, 0), "fp8": (8, 0), "bnb8": (8, 0), "nf4": (4, 64),
                      "fp4": (4, 64), "fp8-rowwise": (8, 0)}
"""``quant=`` method -> (bits per weight, elements per fp32 scale): what a quantized weight takes on the device.
bitsandbytes' 4-bit formats keep an absmax per block of 64 (double quantization makes that less: an
over-count of about 3%); the 8-bit ones' per-row scales are left out (an under-count under 1%)."""


_KEPT: Final = re.compile(r"norm|pos_embed|patch_embed|embed_tokens|embeddings\.|^shared\.")
"""Tensors every method leaves at the dtype: norms, position and patch embeddings (diffusers' layerwise-casting
skip list) and token embedding tables (``nn.Embedding``)."""


_KEPT_BFL: Final = re.compile(r"_mod\.|modulation|^(img|txt|time|vector|guidance)_in\.|^final_layer\.")
"""``fp8=rowwise`` leaves at the dtype what ``spec.fp8_rows_kept`` names (by module: the tensor's name less its
last part), and in a single file the same modules under their file names: LDM's ``label_emb``, and in a
BFL-layout FLUX file (``double_blocks.``) ``img_in``, ``*_mod``, ``modulation`` and ``final_layer``, diffusers'
``x_embedder``, ``norm*.linear`` and ``proj_out`` (only there: Qwen-Image's ``img_mod`` and ``img_in`` are
converted). Only linear layers' weights (two dimensions, each a multiple of 16) are converted: a
UNet's convolutions stay. Its per-row scales (4 bytes a row) are left out, under 1 %."""


def quantized(t: Tensor, method: str, bfl: bool = False) -> Tensor:
    """One tensor at its quantized width: the weights of linear and convolution layers (fp8-storage casts
    their biases too); norms and embeddings stay at the dtype (as each method leaves them, near enough).
    ``fp8-rowwise`` converts linear layers only: a UNet's convolutions, counted here too, stay at the dtype."""
    bits, block = QUANT_WIDTH[method]
    weight = t.name.endswith(".weight") or (method == "fp8-storage" and t.name.endswith(".bias"))
    if t.kind not in FLOATS or not weight or (method != "fp8-rowwise" and _KEPT.search(t.name)):
        return t
    if method == "fp8-rowwise" and (not (len(t.dims) == 2 and t.dims[0] % 16 == 0 and t.dims[1] % 16 == 0)
                                    or fp8_rows_kept(t.name.rsplit(".", 1)[0])
                                    or "label_emb" in t.name or (bfl and _KEPT_BFL.search(t.name))):
        return t
    return Tensor(t.name, method, -(-t.elements * bits // 8) + (4 * -(-t.elements // block) if block else 0),
                  t.elements)


def quant_approximations(options: Mapping[str, str], dtype: str) -> tuple[str, ...]:
    """The ``quant=`` methods a model's rows count at their stored width, named as the loaded model names them
    (pipelines/quant.py) plus the width counted."""
    rows = (f"{FP8_ROWS_NAME} at ~1 byte/weight",) \
        if options.get("fp8") == "rowwise" else ()
    if not options.get("quant"):
        return rows
    names = {"fp8-storage": "fp8-storage({c}, computed in {d})", "int8": "torchao-int8-weights({c})",
             "fp8": "torchao-fp8-weights({c})"}
    named = tuple(names.get(m, "bitsandbytes-{m}({c}, computed in {d})").format(c=c, m=m, d=dtype)
                  + f" at ~{QUANT_WIDTH[m][0] / 8:g} byte/weight" for c, m in parse_quant(options["quant"]).items())
    return named + rows



def quantize(components: dict[str, list[Tensor]], quant: str, notes: list[str],
             fp8: str = "") -> dict[str, list[Tensor]]:
    """``components`` with each one a ``quant=`` option names at its quantized width, and the denoisers at fp8's
    with ``fp8=rowwise`` (counted at full width, it did not help a model fit); a component
    ``quant=`` names that is not among them is noted in ``notes``."""
    if fp8 == "rowwise":
        for component in DENOISERS:
            if component in components:  # the load converts every denoiser (speedups.apply_fp8_rows)
                bfl = any(t.name.startswith("double_blocks.") for t in components[component])
                components[component] = [quantized(t, "fp8-rowwise", bfl) for t in components[component]]
    for component, method in (parse_quant(quant).items() if quant else ()):
        if component in components:
            components[component] = [quantized(t, method) for t in components[component]]
        else:
            notes.append(f"quant={component}:{method}: no {component} among the counted components "
                         f"({', '.join(components)})")
    return components
