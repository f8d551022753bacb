"""``attention=NAME``: the kernel the denoiser's attention runs on, one of diffusers' dispatch backends.

Why a model option: on a large transformer (FLUX.1-dev at 1024² attends over 4,096 + 512 tokens in 57
blocks) attention is a large share of the step, and which kernel computes it is a real speed choice:
PyTorch's SDPA picks one per call by its own rules (``native``, the default), while FlashAttention,
cuDNN's fused attention or SageAttention may be faster on a given GPU. The option is measured per
model on the GPU it runs on (``scripts/gpu_round3.sh attention``) before any becomes a default.

What each name changes, and how it is named (docs/models.md, "Attention backends"):

- ``native``: the default path itself (SDPA, kernel chosen by torch); not named anywhere.
- the other exact kernels (``_native_flash``, ``_native_cudnn``, ``_native_efficient``, ``_native_math``,
  ``flex``, ``flash``, ``_flash_3``, ``xformers`` and their varlen forms) compute softmax(QKᵀ/√d)V
  itself, only in another order of float operations: outputs differ from the default's by float
  rounding, as ``--compile``'s do, so they are named the way ``compiled`` is, in the model's, the job's
  and every output's ``attention``, and are not approximations;
- SageAttention (``sage`` and its ``_sage_*`` kernels) quantizes Q and K to int8 (and P·V to fp8 in some
  kernels): an approximation in the project's sense, like fp8 weights, so it is named in
  ``approximations`` too.

Refused at load with the reason, never at the first job: a name diffusers does not know (the message
lists the ones served); the Hub-kernel backends (``*_hub``: they download code at load, and the daemon
runs nothing fetched from the network), the NPU and XLA ones (devices diffusiond does not serve); a
package that does not import (diffusers' own message, naming what to install); a kernel that needs a
CUDA GPU, a newer one, or half precision, on a model that has none of these; a denoiser whose attention
does not go through diffusers' dispatcher (the UNets of SD 1.5 and SDXL, SD3's transformer: their
processors call SDPA directly, so the option would silently change nothing). A last probe runs one
small attention call through the chosen kernel on the model's device and dtype, so a wheel built for
another GPU fails the load too.

Only the denoisers' processors are set (both of Wan 2.2 A14B's experts: pipelines/denoisers.py).
``ModelMixin.set_attention_backend`` also makes the chosen backend the process-wide default for every processor
that names none; that default is put back at once, so a ControlNet, another pipeline in the same process or a
processor swapped in later runs the default path, as it would without the option. Backends that take no
attention mask (FlashAttention 2, SageAttention) fail on models whose denoiser masks the text tokens
(LTX-Video's); Flux, Wan and Qwen-Image without padding pass none.

Imports neither torch nor diffusers at module level: the engine checks the name at start (spec.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffusiond.pipelines.errors import PipelineError

if TYPE_CHECKING:
    import torch

__all__ = ["KERNELS", "Attention", "Kernel", "apply_attention", "check_attention", "default_attention"]


@dataclass(frozen=True)
class Kernel:
    """What a served backend needs, and what it changes."""

    cuda: bool = False  # runs on CUDA GPUs only
    half: bool = False  # float16 or bfloat16 inputs only
    compute: tuple[int, int] = (0, 0)  # the least CUDA compute capability
    quantized: str = ""  # the approximation's name, for a kernel that computes in fewer bits


_SAGE8 = "sage-attention(Q and K in int8, P·V in fp8)"
_SAGE16 = "sage-attention(Q and K in int8, P·V in fp16)"
_SAGE = "sage-attention(Q and K in int8, P·V in fp16 or fp8 by GPU)"
KERNELS: dict[str, Kernel] = {
    "native": Kernel(),
    "_native_math": Kernel(),
    "_native_flash": Kernel(half=True),  # on a CPU torch's own flash kernel takes float32 too: checked by the probe
    "_native_efficient": Kernel(cuda=True),
    "_native_cudnn": Kernel(cuda=True, half=True),
    "flex": Kernel(),  # eager: an unfused kernel that holds the whole score matrix (fused under --compile)
    "flash": Kernel(cuda=True, half=True),
    "flash_varlen": Kernel(cuda=True, half=True),
    "_flash_3": Kernel(cuda=True, half=True, compute=(9, 0)),
    "_flash_varlen_3": Kernel(cuda=True, half=True, compute=(9, 0)),
    "xformers": Kernel(cuda=True),
    "sage": Kernel(cuda=True, half=True, compute=(8, 0), quantized=_SAGE),
    "sage_varlen": Kernel(cuda=True, half=True, compute=(8, 0), quantized=_SAGE),
    "_sage_qk_int8_pv_fp16_cuda": Kernel(cuda=True, half=True, compute=(8, 0), quantized=_SAGE16),
    "_sage_qk_int8_pv_fp16_triton": Kernel(cuda=True, half=True, compute=(8, 0), quantized=_SAGE16),
    "_sage_qk_int8_pv_fp8_cuda": Kernel(cuda=True, half=True, compute=(8, 9), quantized=_SAGE8),
    "_sage_qk_int8_pv_fp8_cuda_sm90": Kernel(cuda=True, half=True, compute=(9, 0), quantized=_SAGE8),
}
_REFUSED = {
    "_native_npu": "it is for Ascend NPUs, which diffusiond does not serve",
    "_native_xla": "it is for XLA devices (TPUs), which diffusiond does not serve",
}
_HUB = ("downloads its kernel from the Hugging Face Hub when set, and the daemon runs no code fetched at load; "
        "install the package form instead (flash-attn for flash, sageattention for sage)")


@dataclass(frozen=True)
class Attention:
    """The backend in force: ``name`` for the model's, job's and outputs' ``attention`` ("" on the default
    path), and the approximations it adds."""

    name: str = ""
    approximations: tuple[str, ...] = ()


def check_attention(name: str) -> Kernel:
    """The served backend ``name``, or a PipelineError naming why not and the served names (no torch)."""
    if name.endswith("_hub"):
        raise PipelineError(f"attention={name} is refused: it {_HUB}")
    if name in _REFUSED:
        raise PipelineError(f"attention={name} is refused: {_REFUSED[name]}")
    kernel = KERNELS.get(name)
    if kernel is None:
        raise PipelineError(f"attention={name[:60]!r} is not a backend diffusiond serves; known: {', '.join(KERNELS)} "
                            "(see docs/models.md, Attention backends)")
    return kernel


def _dispatching(denoiser: Any) -> list[Any]:
    """The denoiser's attention modules whose processor calls diffusers' ``dispatch_attention_fn`` (a
    processor that does has an ``_attention_backend`` attribute; SDPA-calling ones have none)."""
    return [m for m in denoiser.modules()
            if hasattr(getattr(m, "processor", None), "_attention_backend")]


def _head_dim(module: Any) -> int:
    """The module's head width (Flux and LTX keep it; diffusers' ``Attention`` keeps the heads' total), for
    the probe: kernels support some widths only."""
    if getattr(module, "head_dim", None):
        return int(module.head_dim)
    inner, heads = getattr(module, "inner_dim", 0), getattr(module, "heads", 0)
    return inner // heads if inner and heads else 64


def _set(denoiser: Any, name: str) -> None:
    """``set_attention_backend``, with diffusers' process-wide default put back (see the module's docstring)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    try:
        denoiser.set_attention_backend(name)
    except (RuntimeError, ValueError) as exc:  # the package is missing or too old: diffusers names it
        raise PipelineError(f"attention={name}: {exc}") from None
    finally:
        _AttentionBackendRegistry.set_active_backend(before)


def _probe(name: str, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
    """One small attention call through the kernel on the model's device and dtype."""
    import torch
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    q = torch.randn(1, 32, 2, head_dim, device=device, dtype=dtype)
    try:
        with torch.inference_mode():
            dispatch_attention_fn(q, q, q, backend=AttentionBackendName(name))
    except Exception as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineError(f"attention={name}: a test call of the kernel on {device.type} in "
                            f"{str(dtype).removeprefix('torch.')} failed: {why}") from None


def apply_attention(pipe: Any, name: str, device: torch.device) -> Attention:
    """Set the denoiser's attention backend ``name`` (nothing for "" or ``native``); what it is named."""
    kernel = check_attention(name) if name else None
    if kernel is None or name == "native":
        return Attention()  # the default path, on any denoiser: set nothing, so it stays exactly that
    import torch

    from diffusiond.pipelines.denoisers import denoisers

    found = denoisers(pipe)  # both of Wan 2.2 A14B's experts: each runs part of the steps
    if not found or not all(hasattr(d, "set_attention_backend") for _, d in found):
        raise PipelineError(f"attention={name}: {type(pipe).__name__} has no denoiser with diffusers' attention "
                            "backends (diffusers 0.35 or later has them)")
    modules: list[Any] = []
    for attr, d in found:
        mine = _dispatching(d)
        if not mine:
            raise PipelineError(f"attention={name}: the model's {attr} ({type(d).__name__}) calls PyTorch's "
                                "attention directly, not through diffusers' dispatcher, so a backend would change "
                                "nothing; the transformer models (Flux, Wan, LTX, Qwen-Image) take it, not the "
                                "UNets of SD 1.5 and SDXL, nor SD3")
        modules += mine
    for _, d in found:
        _set(d, name)
    denoiser = found[0][1]
    dtype = denoiser.dtype
    if kernel.cuda and device.type != "cuda":
        raise PipelineError(f"attention={name} runs on CUDA GPUs only, and this model is on {device.type}")
    if kernel.half and dtype not in (torch.float16, torch.bfloat16) and device.type == "cuda":
        raise PipelineError(f"attention={name} takes float16 or bfloat16 only, and this model is "
                            f"{str(dtype).removeprefix('torch.')}; serve it with --dtype bfloat16 (or float16)")
    have = torch.cuda.get_device_capability(device) if kernel.compute > (0, 0) else (0, 0)
    if have < kernel.compute:
        raise PipelineError(f"attention={name} needs a GPU of compute capability {'.'.join(map(str, kernel.compute))} "
                            f"or newer; this one is {'.'.join(map(str, have))}")
    _probe(name, _head_dim(modules[0]), device, dtype)
    return Attention(name, (kernel.quantized,) if kernel.quantized else ())


@contextlib.contextmanager
def default_attention(pipe: Any) -> Iterator[None]:
    """Every denoiser's attention on the default path (``native``: PyTorch's SDPA) inside the block, the
    model's own backend put back after, for the bench's FLOP count (issue 31): torch's FLOP counter has
    formulas for SDPA's kernels only, so a count made on FlashAttention's, xformers' or SageAttention's
    would leave attention out, and one made on ``flex`` fails (eager FlexAttention cannot run under the
    counter). The kernel changes how the FLOPs are scheduled, not how many the shapes call for."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from diffusiond.pipelines.denoisers import denoisers

    processors = [m.processor for _, d in denoisers(pipe) for m in _dispatching(d)]
    saved = [p._attention_backend for p in processors]
    before = _AttentionBackendRegistry._active_backend
    try:
        for p in processors:
            p._attention_backend = None  # the process-wide default, native for the block
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        yield
    finally:
        _AttentionBackendRegistry.set_active_backend(before)
        for p, backend in zip(processors, saved, strict=True):
            p._attention_backend = backend
