"""``fp8=rowwise``: the denoiser's linear layers multiply in fp8 on the matrix units, scaled per row.

Each linear layer's weight is stored in float8 (e4m3) with one scale per output row, and its forward quantizes
the input per token row and multiplies with ``torch._scaled_mm``, out in the model's dtype. A matrix product of
FLUX's size then runs at the fp8 rate of a Hopper or Ada GPU, about twice bf16's, and the weights take half the
memory. Row scales keep each token's and each output channel's largest value exact, where one scale a tensor
lets one outlier token coarsen all the others.

Why not torchao's ``Float8DynamicActivationFloat8WeightConfig`` (``fp8=1``): its weights are a tensor subclass
whose every op dispatches through Python, so eager it ran FLUX.1-dev at 0.61x bf16, and dynamo, tracing the
subclass op by op, had not compiled the model after 460 s (docs/benchmarks.md, issues 28 and 31). Here the
weight is a plain tensor and the forward a few torch ops around one product, which compile fuses into one
quantizing kernel, and a LoRA, an offload or a weight update sees an fp8 tensor it can refuse by its dtype.
FLUX.1-dev inside 24 GiB then ran at 1.075x bf16 eager and 1.30x compiled (H100, docs/benchmarks.md).

The layers converted are the denoiser's blocks' (``spec.FP8_ROWS_KEEP``: norms, the embedders, the first and last
projections stay as loaded), with both dimensions multiples of 16, which the fp8 product needs. It is applied while the
model is on the host, before offload hooks are made and before the move (``speedups.apply_fp8_rows``), after each
attention's query, key and value projections are fused into one where its processor reads them so
(``fusion.fuse_for_fp8``), so that their common input is quantized once: row scales make the fusion free of
rounding of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import fp8_rows_kept

__all__ = ["Fp8RowwiseLinear", "check_device", "check_plain", "to_fp8_rowwise"]

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = 1e-12  # an all-zero row's scale: its quantized values are 0 whatever it is
FAST_ACCUM = True
"""The GPU's fast fp8 accumulation: a product's sums stay in the matrix units' own accumulator, where the slower mode
adds them into float32 every few steps of the inner dimension. fp8 inference kernels run it (torchao's forward
among them); the option's PSNR figures include its rounding (docs/benchmarks.md)."""


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, k) as fp8 and each row's scale (rows, 1), float32: the row's largest magnitude maps to 448."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=TINY) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


_FUSED: list[Any] = []  # the compiled quantizer, made at the first CUDA forward; None in it: compiling failed


def _quantize(x: torch.Tensor, fuse: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rows`` as one fused kernel on a GPU. Eager, its torch ops each read and write the whole input (in
    float32): about 0.5 GB a layer at FLUX's size, more traffic than the fp8 product saves. Compiled once with
    dynamic shapes, it is one reduction and one pass. Inside a compiled model the model's compile fuses it anyway;
    on a CPU, for a single row (which a dynamic graph would specialise, and which costs nothing eager), and once
    compiling has failed (no C compiler for Triton, a recompile past dynamo's limit: logged once),
    it runs eager, with the same numbers. ``fuse``: whether to try the fused kernel (default: on CUDA)."""
    if not (x.is_cuda if fuse is None else fuse) or x.shape[0] < 2 or torch.compiler.is_compiling():
        return _rows(x)
    if not _FUSED:
        _FUSED.append(torch.compile(_rows, dynamic=True, fullgraph=True))
    if _FUSED[0] is not None:
        try:
            return _FUSED[0](x)
        except torch.OutOfMemoryError:
            raise  # the eager ops need more memory, not less
        except Exception as exc:  # any compiler failure, at the first call or a recompile
            log.warning("fp8=rowwise: the fused quantizer failed (%s: %s); quantizing with eager ops from now on, "
                        "which costs speed", type(exc).__name__, exc)
            _FUSED[0] = None
    return _rows(x)


class Fp8RowwiseLinear(torch.nn.Module):
    """A linear layer from fp8 weights scaled per output row; see the module's docstring. Quantized on ``work``
    (the compute device, not the host's cores) and kept on ``keep``."""

    def __init__(self, linear: torch.nn.Linear, work: torch.device | None = None,
                 keep: torch.device | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        source = linear.weight.detach()
        keep = keep or source.device
        weight, scale = _rows(source.to(work or source.device))
        self.weight = torch.nn.Parameter(weight.to(keep), requires_grad=False)
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", scale.t().contiguous().to(keep))  # (1, out): the scale of weight.t()
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(keep), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.numel() == 0:  # no rows: nothing to scale (an empty scale's strides are refused by _scaled_mm)
            return x.new_zeros(*shape[:-1], self.out_features)
        xq, xs = _quantize(x.reshape(-1, shape[-1]))
        wide = torch.bfloat16 if x.is_cuda else x.dtype  # CUDA's row-scaled product writes bf16 only
        bias = self.bias
        inside = bias is not None and bias.dtype == wide  # the product adds a bias of its output's dtype
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale,
                               bias=bias if inside else None, out_dtype=wide, use_fast_accum=FAST_ACCUM)
        if bias is not None and not inside:
            out = out + bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def to_fp8_rowwise(module: torch.nn.Module, device: torch.device, what: str = "the denoiser",
                   resident: bool = True) -> int:
    """Replace ``module``'s eligible linear layers in place; how many were replaced. Each is quantized on
    ``device`` and kept there when ``resident``, else where it was. A GPU needs fp8 matrix units (compute
    capability 8.9+); on a CPU torch's own fp8 product runs (slowly: for tests and checks). A module whose
    layers are quantized already is refused (``check_plain``)."""
    check_device(device)
    check_plain(module, what)
    replaced = 0
    for parent, name, child in _linears(module):
        if type(child) is torch.nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0:
            setattr(parent, name, Fp8RowwiseLinear(child, device, device if resident else None))
            replaced += 1
    if not replaced:
        raise PipelineError(f"fp8=rowwise: {what} ({type(module).__name__}) has no linear layer to convert; "
                            "drop fp8=rowwise for this model")
    return replaced


def check_device(device: torch.device) -> None:
    """Refuse a device without fp8 products, before anything is changed."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise PipelineError(f"fp8=rowwise needs a GPU with fp8 matrix units (compute capability 8.9+: Ada, Hopper); "
                            f"this one has {major}.{minor}")
    if device.type not in ("cuda", "cpu"):
        raise PipelineError(f"fp8=rowwise runs on CUDA GPUs (and on the CPU, slowly), not on {device.type}")


def check_plain(module: torch.nn.Module, what: str) -> None:
    """Refuse a module whose layers are quantized already (GGUF's, torchao's, bitsandbytes'): nothing plain is
    left to convert, and the name would claim what did not happen. Checked before the QKV fusion
    too, which would concatenate quantized blocks as if they were weights."""
    other = {f"{type(child).__name__} ({child.weight.dtype})".replace("torch.", "")
             for _, _, child in _linears(module)
             if child.weight.dtype not in _FLOATS or type(child.weight) not in _PLAIN}
    if other:
        raise PipelineError(f"fp8=rowwise: {what} ({type(module).__name__}) is not a plain float model (its linear "
                            f"layers are {', '.join(sorted(other))}); load it unquantized to use fp8=rowwise, or drop "
                            "fp8=rowwise")


def _linears(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """Each linear layer under ``module`` that fp8=rowwise does not keep (``spec.FP8_ROWS_KEEP``), with its parent
    and its name there; a kept module's children are not visited."""
    for name, child in list(module.named_children()):
        full = f"{prefix}{name}"
        if fp8_rows_kept(full):
            continue
        if isinstance(child, torch.nn.Linear):
            yield module, name, child
        else:
            yield from _linears(child, f"{full}.")


_FLOATS: Any = (torch.bfloat16, torch.float16, torch.float32)
_PLAIN: Any = (torch.nn.Parameter, torch.Tensor)
