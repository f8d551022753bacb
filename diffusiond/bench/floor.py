"""The kernels' floor: how fast one forward could be if nothing ran but its matrix products, convolutions and
attention, each as fast as the device runs it alone.

A speed target is only worth chasing below what the kernels themselves allow. ``flops.py`` compares a forward
with the datasheet's peak, which no real kernel reaches; this compares it with the kernels the pipeline really
calls. One forward at the bench's batch runs under a recorder that notes every heavy call (``F.linear``,
convolutions, ``F.scaled_dot_product_attention``, the matmul family) with its operands' shapes, strides and
dtypes. Each distinct call is then replayed alone on the device, on fresh operands of the same layout, and
timed; the floor is the sum over calls of count x time. Everything else (norms, activations, RoPE, the
scheduler, launch gaps) is left out, so the floor is a lower bound: a compiler can fuse the rest away, but it
calls the same cuBLAS, cuDNN and SDPA kernels for the heavy ones (default and reduce-overhead modes), so no
compiled forward of the same dtype beats it. ``max-autotune`` may pick Triton products instead, and fp8 or a
step cache changes the calls themselves; those are measured, not bounded, here.

Alone, a call's operands can sit in L2 between repeats, which makes small calls faster than in the model:
another reason the figure is a floor and not an estimate. ``scripts/kernel_floor.py`` runs it on a model.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("linear", "conv", "attention", "matmul")  # how the floor's seconds are broken down


def _heavy() -> dict[Any, str]:
    """The torch functions a forward's heavy work goes through, by kind (the Python-level entry points, so
    attention is replayed through SDPA's own backend choice on the device, not a CPU decomposition)."""
    import torch
    import torch.nn.functional as F

    return {F.linear: "linear", torch.conv1d: "conv", torch.conv2d: "conv", torch.conv3d: "conv",
            F.conv_transpose2d: "conv", F.conv_transpose3d: "conv",
            F.scaled_dot_product_attention: "attention",
            torch.matmul: "matmul", torch.bmm: "matmul", torch.baddbmm: "matmul", torch.addmm: "matmul",
            torch.Tensor.matmul: "matmul", torch.Tensor.__matmul__: "matmul", torch.Tensor.bmm: "matmul"}


@dataclass(frozen=True)
class Operand:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any  # a torch.dtype


@dataclass(frozen=True)
class Call:
    """One heavy call as made: the function, its kind, and its arguments with tensors replaced by their
    layout (hashable, so repeats of one call collapse into one signature)."""

    func: Any
    kind: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


def _describe(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return Operand(tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return value


def _make(value: Any, device: Any) -> Any:
    """An operand of the recorded layout with fresh values (normal floats; zeros for integers and masks)."""
    import torch

    if isinstance(value, Operand):
        if not value.shape or 0 in value.shape:
            return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device=device)
        size = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride, strict=True))
        if value.dtype.is_floating_point:
            base = torch.randn(size, device=device, dtype=torch.float32).to(value.dtype)
        else:
            base = torch.zeros(size, device=device, dtype=value.dtype)
        return base.as_strided(value.shape, value.stride)
    if isinstance(value, tuple):
        return tuple(_make(v, device) for v in value)
    return value


def recorder(calls: Counter[Call]) -> Any:
    """A TorchFunctionMode that counts every heavy call made under it into ``calls`` and runs it as usual."""
    from torch.overrides import TorchFunctionMode

    heavy = _heavy()

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            kind = heavy.get(func)
            if kind is not None:
                described = tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))
                calls[Call(func, kind, _describe(tuple(args)), described)] += 1
            return func(*args, **kwargs)

    return Recorder()


@dataclass
class Signature:
    kind: str
    count: int  # calls of this signature in the forward
    seconds: float  # one call alone, the median of the timed repeats
    flops: int  # one call's, torch's FLOP counter
    shapes: str  # the tensor operands' shapes, for reading

    @property
    def total(self) -> float:
        return self.count * self.seconds


@dataclass
class Floor:
    seconds: float  # the forward's floor: every heavy call's time alone, summed
    by_kind: dict[str, float]  # seconds by KINDS
    flops: int  # of the heavy calls, counted per call
    calls: int
    signatures: list[Signature] = field(default_factory=list)

    def summary(self, top: int = 8) -> dict[str, Any]:
        """The figures for a report: seconds by kind, their TFLOP/s alone, and the costliest signatures."""
        by_flops: dict[str, int] = Counter()
        for s in self.signatures:
            by_flops[s.kind] += s.count * s.flops
        kinds = {k: {"seconds": round(v, 6), "tflops": round(by_flops[k] / v / 1e12, 1) if v else None}
                 for k, v in self.by_kind.items() if v}
        worst = sorted(self.signatures, key=lambda s: -s.total)[:top]
        return {"floor_s": round(self.seconds, 6), "calls": self.calls, "signatures": len(self.signatures),
                "tflops": round(self.flops / self.seconds / 1e12, 1) if self.seconds else None, "kinds": kinds,
                "top": [{"kind": s.kind, "count": s.count, "ms": round(s.seconds * 1e3, 4),
                         "share": round(s.total / self.seconds, 3), "shapes": s.shapes} for s in worst]}


def _timer(device: Any) -> Callable[[Callable[[], Any], int], float]:
    """Seconds per call of ``fn`` over ``n`` calls: CUDA events on a GPU, the wall clock elsewhere."""
    import torch

    cuda = torch.device(device).type == "cuda"

    def timed(fn: Callable[[], Any], n: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    return timed


def replay(calls: Counter[Call], device: Any, repeats: int = 3, budget_s: float = 0.02) -> Floor:
    """Each distinct call run alone on ``device``: a warm-up, then ``repeats`` timings of as many calls as fill
    about ``budget_s`` (at least one), the median kept."""
    import torch

    from diffusiond.bench.flops import counter

    timed = _timer(device)
    signatures = []
    with torch.inference_mode():
        for call, count in calls.items():
            args = _make(call.args, device)
            kwargs = {k: _make(v, device) for k, v in call.kwargs}

            def fn(args: Any = args, kwargs: Any = kwargs, func: Any = call.func) -> Any:
                return func(*args, **kwargs)

            once = timed(fn, 1)  # also the warm-up: the first call chooses the algorithm
            once = timed(fn, 1)
            n = max(1, min(1000, int(budget_s / max(once, 1e-7))))
            seconds = statistics.median(timed(fn, n) for _ in range(repeats))
            mode = counter()
            with mode:
                fn()
            shapes = " ".join("x".join(map(str, a.shape)) for a in call.args if isinstance(a, Operand))
            signatures.append(Signature(call.kind, count, seconds, int(mode.get_total_flops()), shapes))
    by_kind = {k: sum(s.total for s in signatures if s.kind == k) for k in KINDS}
    return Floor(sum(by_kind.values()), by_kind, sum(s.count * s.flops for s in signatures),
                 sum(calls.values()), signatures)
