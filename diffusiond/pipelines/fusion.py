"""Fused QKV projections: each attention's query, key and value as one matrix, one product instead of three.

Two callers, two rules:

- ``fuse_qkv=1`` (``fuse_qkv``), a ``--compile`` option: diffusers' model-level fusion, which for a UNet or SD3
  also swaps in fused processors. A model whose fused processors would misread it is refused by name.
- ``fp8=rowwise`` (``fuse_for_fp8``), made before its layers are quantized, so each attention's input is
  quantized once, not three times: only attentions whose own processor reads fused projections are fused, one
  at a time, and the rest are left apart. It is never refused: a model that cannot fuse runs unfused.

Either way the separate projections a fusion copied are deleted (``_drop_separate``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from diffusiond.pipelines.denoisers import denoisers
from diffusiond.pipelines.errors import PipelineError

__all__ = ["fuse_for_fp8", "fuse_qkv"]

_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def fuse_qkv(pipe: Any) -> None:
    """``fuse_qkv=1``: each attention's query, key and value projections as one matrix (one GEMM instead of three).

    diffusers keeps a pipeline method for this only where the pipeline has a ``unet`` (it sets the UNet's and
    the VAE's fused processors); a DiT pipeline has none in diffusers 0.42 (FLUX, SD3, Wan: issue 31), and its
    denoiser's own method is what the pipeline method used to call: the transformer's attentions build fused
    projections that their processors read in place of the separate ones (``attn.fused_projections``). The VAE
    is fused too where it has the method, as the pipeline method did. A denoiser that fuses nothing, or whose
    processors would never read what was fused (its projections held twice for no gain), or would misread it,
    is refused by name."""
    cls = type(pipe).__name__
    if hasattr(pipe, "fuse_qkv_projections"):
        pipe.fuse_qkv_projections()
    else:
        _fuse_denoisers(pipe, cls)
    for component in getattr(pipe, "components", {}).values():
        if isinstance(component, torch.nn.Module):
            for attn in list(component.modules()):
                _drop_separate(attn)


def fuse_for_fp8(pipe: Any) -> int:
    """``fp8=rowwise``'s fusion: row scales make it free of rounding of its own (a fused row keeps the scale it had
    apart, and the input's rows are scaled as they were). Attention by attention, and only where the model's own
    processor reads fused projections: diffusers' UNet and SD3 fusions swap in other processors, and SD3's skips
    SD3.5's query and key norms. Each attention's separate projections go as soon as it fuses, so
    the host holds at most one attention's twice.
    How many attentions fused."""
    fused = 0
    for _, denoiser in denoisers(pipe):
        for attn in list(denoiser.modules()):
            if not _fuses_in_place(attn):
                continue
            attn.fuse_projections()
            if getattr(attn, "fused_projections", False):  # a class may decline (``_supports_qkv_fusion``)
                _drop_separate(attn)
                fused += 1
    return fused


def _fuses_in_place(attn: torch.nn.Module) -> bool:
    if not callable(getattr(attn, "fuse_projections", None)) or getattr(attn, "fused_projections", False):
        return False
    processor = getattr(attn, "processor", None)
    return processor is not None and _reads_fused(type(processor))


_SOURCES: dict[type, tuple[str, str]] = {}


def _sources(kind: type) -> tuple[str, str]:
    """A processor class's own source and its module's, read once per class, not once per attention ('' for none
    or where Python cannot find it)."""
    if kind not in _SOURCES:
        own = module = ""
        if kind is not type(None):
            try:
                own, module = inspect.getsource(kind), inspect.getsource(sys.modules[kind.__module__])
            except (OSError, TypeError, KeyError):
                pass
        _SOURCES[kind] = (own, module)
    return _SOURCES[kind]


def _reads_fused(kind: type) -> bool:
    """Whether a processor class reads fused projections itself (diffusers' ``_get_qkv_projections`` helpers
    choose between fused and separate by ``attn.fused_projections``)."""
    own = _sources(kind)[0]
    return "fused_projections" in own or "_get_qkv_projections" in own


def _drop_separate(attn: torch.nn.Module) -> None:
    """The separate projections a fusion copied, deleted: the fused attention never reads them again, so a LoRA or
    an ``update_weights`` naming them was taken and changed nothing, and they held the projections' bytes twice
    (4.3 GB of FLUX.1-dev in bf16). Deleted, an update naming one is refused as naming no such
    module, by the checks every update goes through. A cross-attention fuses only its key and value (``to_kv``).
    Wan 2.1 I2V's image key and value (``to_added_kv``): its processor tests ``add_k_proj`` for None to know it has
    an image branch, so a weightless stand-in keeps that answer."""
    if not getattr(attn, "fused_projections", False):
        return
    names: tuple[str, ...] = ("to_q", "to_k", "to_v") if hasattr(attn, "to_qkv") else \
        ("to_k", "to_v") if hasattr(attn, "to_kv") else ()
    if hasattr(attn, "to_added_qkv"):
        names += ("add_q_proj", "add_k_proj", "add_v_proj")
    elif hasattr(attn, "to_added_kv"):
        names += ("add_k_proj", "add_v_proj")
    for name in names:
        if isinstance(getattr(attn, name, None), torch.nn.Module):
            delattr(attn, name)
    if hasattr(attn, "to_added_kv") and not hasattr(attn, "to_added_qkv"):
        attn.add_k_proj = FusedAway()


class FusedAway(torch.nn.Module):
    """A projection fused into another, kept only as an answer to ``is not None``; it has no weights, and a call
    to it is a bug that must not pass unseen."""

    def forward(self, *_args: Any) -> torch.Tensor:
        raise RuntimeError("this projection was fused into another (fused_projections); the processor must call that")


def _fuse_denoisers(pipe: Any, cls: str) -> None:
    found = denoisers(pipe)
    if not found or not all(hasattr(module, "fuse_qkv_projections") for _, module in found):
        raise PipelineError(f"fuse_qkv=1: {cls} cannot fuse its QKV projections; drop fuse_qkv=1 for this model")
    for name, module in found:
        try:
            module.fuse_qkv_projections()
        except ValueError as exc:  # diffusers refuses attentions with added KV projections (IP-Adapter's)
            raise PipelineError(f"fuse_qkv=1: {cls}'s {name} cannot fuse its QKV projections ({exc}); "
                                "drop fuse_qkv=1 for this model") from exc
        unread = _unread_fusions(module)
        if unread is not None:
            raise PipelineError(f"fuse_qkv=1: {cls}'s {name} cannot fuse its QKV projections: {unread}; "
                                "drop fuse_qkv=1 for this model")
    vae: Any = getattr(pipe, "vae", None)
    if hasattr(vae, "fuse_qkv_projections"):
        vae.fuse_qkv_projections()


def _unread_fusions(module: torch.nn.Module) -> str | None:
    """Why the fusion just made in ``module`` does nothing or goes wrong, or None where its attentions' processors
    read it: fused (``fused_projections``) by some attention, each fused attention's processor from code that knows
    fused projections (diffusers' processors that do read ``fused_projections`` or ``to_qkv``), applying the
    attention's query and key norms where it has them, and finding the added projections it reads (SD3's fused
    processor skips SD3.5's norms and reads the text's projections in an attention without them)."""
    fused = [m for m in module.modules() if getattr(m, "fused_projections", False)]
    if not fused:
        return "none of its attentions has projections to fuse"
    for attn in fused:
        kind = type(getattr(attn, "processor", None))
        own, source = _sources(kind)
        if "fused_projections" not in source and "to_qkv" not in source:
            return f"its attention processor {kind.__name__} does not read fused projections"
        if "_get_qkv_projections" in own or "_get_fused_projections" in own:
            continue  # the model's own processor, norms and all
        if any(getattr(attn, n, None) is not None for n in _NORMS) and "norm_q" not in own:
            return f"its fused processor {kind.__name__} skips the attention's query and key norms"
        if "to_added_qkv" in own and not hasattr(attn, "to_added_qkv"):
            return f"its fused processor {kind.__name__} reads added projections that some attention lacks"
    return None
