"""``quant=COMPONENT:fp8-storage``: a component's layer weights kept in float8 (e4m3), each cast to the model's
dtype by the layer's forward as it reads it (issue 28: FLUX.1-dev's transformer in 12 GB instead of 24).

Why not diffusers' layerwise casting, which this replaced: its hooks cast every layer's parameters to the compute
dtype in place before the layer's forward and back to float8 after, through ``module.to`` in Python (two
allocations and two casts per layer and step). On FLUX.1-dev that ran at 0.83x bf16 (H200, 2026-12-02; the target
is 0.95x), and dynamo recompiled the hooks layer by layer, so ``--compile`` had to refuse it. Here the float8
tensor is the parameter itself, and the forward casts a temporary copy, freed after its matmul: one cast kernel
(1 byte read, 2 written per weight) and no Python beyond the forward's own line, which dynamo traces like any
other, so compiled blocks fuse the cast.

Which layers: linear and convolution layers (as diffusers' casting chose), outside the subtrees whose dotted name
matches one of ``skip`` (``re.search``, as diffusers matches its skip patterns: norms, embeddings, the first and
last projections, and the model's ``_keep_in_fp32_modules``). Code outside a layer that reads its weight's dtype
sees float8 either way, as it did between the hooks' casts.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

STORAGE = torch.float8_e4m3fn
_ATTR = "_diffusiond_fp8_compute"  # on the component and each cast layer: the dtype they compute in


def apply(component: torch.nn.Module, compute: torch.dtype, skip: Iterable[str]) -> int:
    """Store ``component``'s linear and convolution layers' weights and biases in float8, computed in ``compute``;
    how many layers were."""
    patterns = [re.compile(p) for p in skip]
    count = 0

    def visit(module: torch.nn.Module, prefix: str) -> None:
        nonlocal count
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if any(p.search(path) for p in patterns):
                continue  # the whole subtree keeps its precision
            if isinstance(child, torch.nn.Linear | torch.nn.Conv1d | torch.nn.Conv2d | torch.nn.Conv3d):
                _store(child, compute)
                count += 1
            visit(child, path)

    visit(component, "")
    setattr(component, _ATTR, compute)
    return count


def compute_dtype(component: torch.nn.Module) -> torch.dtype | None:
    """The dtype an fp8-stored component computes in (None: it is not fp8-stored)."""
    found = getattr(component, _ATTR, None)
    return found if isinstance(found, torch.dtype) else None


def _store(layer: torch.nn.Module, compute: torch.dtype) -> None:
    with torch.no_grad():
        for param in layer.parameters(recurse=False):
            param.data = param.data.to(STORAGE)
    setattr(layer, _ATTR, compute)
    forward = _linear if isinstance(layer, torch.nn.Linear) else _conv
    layer.forward = types.MethodType(forward, layer)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _linear(self: Any, x: torch.Tensor) -> torch.Tensor:
    dtype = getattr(self, _ATTR)
    return F.linear(x, self.weight.to(dtype), _cast(self.bias, dtype))


def _conv(self: Any, x: torch.Tensor) -> torch.Tensor:
    dtype = getattr(self, _ATTR)
    out: torch.Tensor = self._conv_forward(x, self.weight.to(dtype), _cast(self.bias, dtype))
    return out
