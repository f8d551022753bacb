"""Issue 28's fp8 target (fp8 storage, no offload, >= 0.95x bf16): which way of running a linear layer from fp8
weights gets there, measured on the FLUX.1-dev transformer's forward at 1024² in one process.

    PYTHONPATH=. python scripts/bench_fp8_linear.py [--device cuda] [--rounds 3] [--forwards 4] [--out FILE]

diffusers' layerwise casting (``quant=transformer:fp8-storage``, 0.83x bf16 on the H100/H200) casts each layer's
weights to bf16 before its forward and back to fp8 after it: two full casts and a ``module.to`` per layer and
forward. The ways measured here, each on the same random ``flux-dev`` transformer (bf16, the daemon's preset
code), every linear layer diffusers' casting would cast wrapped by one module whose mode is switched between
forwards, so every variant pays the same wrapper:

- ``bf16``: the layer's own bf16 weights (the reference);
- ``diffusers``: the wrapper calls the layer under diffusers' own hook (pre: cast up; post: cast down);
- ``cast-once``: fp8 (e4m3) weights cast to bf16 inside the forward, nothing cast back;
- ``rowwise``: fp8 weights scaled per output row and the activations quantized per token row, multiplied by
  ``torch._scaled_mm`` (the matrix units' fp8 rate), bf16 out;
- ``rowwise-cq``: the same, with the activations' quantization compiled (one fused kernel instead of five).

Rounds alternate the variants; each reports its median seconds per forward, its ratio to bf16 in the same round,
and its output's distance from bf16's (PSNR over the output's range). ``--device cpu`` runs a tiny transformer,
a dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MODE = ["bf16"]
VARIANTS = ("bf16", "diffusers", "cast-once", "rowwise", "rowwise-cq")


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (token) scales so that each row's largest magnitude maps to fp8's largest."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


QUANT = {"rowwise": quant_rows, "rowwise-cq": quant_rows}


class Wrapped(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

        self.linear = linear
        w = linear.weight.detach()
        self.w8 = w.to(FP8)
        scale = (w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX)
        self.wq = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        self.wscale = scale.t().contiguous()  # (1, out): _scaled_mm's per-column scale of b = wq.t()
        self.hook = LayerwiseCastingHook(FP8, w.dtype, non_blocking=False)
        self.shadow = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      device="meta")  # diffusers' variant: its own fp8 copy, cast by its hook
        self.shadow.weight = torch.nn.Parameter(w.to(FP8), requires_grad=False)
        if linear.bias is not None:
            self.shadow.bias = torch.nn.Parameter(linear.bias.detach().to(FP8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = MODE[0]
        b = self.linear.bias
        if mode == "bf16":
            return F.linear(x, self.linear.weight, b)
        if mode == "diffusers":
            self.hook.pre_forward(self.shadow)
            out = self.shadow(x)
            self.hook.post_forward(self.shadow, out)
            return out
        if mode == "cast-once":
            return F.linear(x, self.w8.to(x.dtype), b)
        shape = x.shape
        xq, xs = QUANT[mode](x.reshape(-1, shape[-1]))
        out = torch._scaled_mm(xq, self.wq.t(), scale_a=xs, scale_b=self.wscale, out_dtype=x.dtype)
        if b is not None:
            out = out + b
        return out.reshape(*shape[:-1], out.shape[-1])


def wrap(model: torch.nn.Module) -> int:
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    n = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is torch.nn.Linear and not any(re.search(p, full) for p in DEFAULT_SKIP_MODULES_PATTERN) \
                    and child.in_features % 16 == 0 and child.out_features % 16 == 0:
                setattr(module, child_name, Wrapped(child))
                n += 1
    return n


def build(device: str) -> tuple[Any, dict[str, Any]]:
    if device == "cuda":
        from diffusiond.pipelines.preset_tables import PRESETS
        from diffusiond.pipelines.presets import build_pipeline

        model = build_pipeline(PRESETS["flux-dev"], device, torch.bfloat16).transformer
        tokens, text, width = 4096, 512, 1024
    else:
        import diffusers

        model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                 pooled_projection_dim=32, guidance_embeds=True,
                                                 axes_dims_rope=(4, 6, 6)).to(device, torch.bfloat16)
        tokens, text, width = 256, 32, 0
    cfg = model.config
    g = torch.Generator(device).manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)

    side = int(tokens ** 0.5)
    axis = torch.arange(side).float()
    ids = torch.stack(torch.meshgrid(torch.zeros(1), axis, axis, indexing="ij"), -1)
    inputs = {"hidden_states": r(1, tokens, cfg.in_channels),
              "encoder_hidden_states": r(1, text, cfg.joint_attention_dim),
              "pooled_projections": r(1, cfg.pooled_projection_dim), "timestep": torch.full((1,), 0.5, device=device),
              "img_ids": ids.reshape(-1, 3).to(device), "txt_ids": torch.zeros(text, 3, device=device),
              "guidance": torch.full((1,), 3.5, device=device), "return_dict": False}
    return model.eval(), {"inputs": inputs, "width": width}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forwards", type=int, default=4)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    model, info = build(a.device)
    n = wrap(model)
    if cuda:
        torch.cuda.empty_cache()
    print(f"bench_fp8_linear: built and wrapped {n} linear layers in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    QUANT["rowwise-cq"] = torch.compile(quant_rows, dynamic=True)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    outs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for v in VARIANTS:  # warm-up: the compiled quantizer compiles, the allocator grows
            MODE[0] = v
            outs[v] = model(**info["inputs"])[0].float()
        for rnd in range(a.rounds):
            this: dict[str, float] = {}
            for v in VARIANTS:
                MODE[0] = v
                sync()
                t = time.perf_counter()
                for _ in range(a.forwards):
                    model(**info["inputs"])
                sync()
                this[v] = (time.perf_counter() - t) / a.forwards
                times[v].append(this[v])
            for v in VARIANTS:
                ratios[v].append(this["bf16"] / this[v])
            print(f"round {rnd}: " + ", ".join(f"{v} {this[v] * 1000:.1f} ms" for v in VARIANTS), file=sys.stderr)
    ref = outs["bf16"]
    span = float(ref.max() - ref.min())
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "layers": n,
                              "forwards": a.forwards, "rounds": a.rounds, "variants": {}}
    for v in VARIANTS:
        mse = float(((outs[v] - ref) ** 2).mean())
        psnr = float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(span * span / mse)).item()
        result["variants"][v] = {"s_median": statistics.median(times[v]), "x_bf16": ratios[v],
                                 "x_bf16_median": statistics.median(ratios[v]), "psnr_db": psnr}
    text = json.dumps(result)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
