"""Models bigger than the card (issue 28): FLUX.1-dev offloaded or quantized, against itself fully resident.

    python scripts/bench_bigger.py --out DIR [--configs resident,stream,group,fp8,fp8-wo,fp8-mm,q8,q4] [--budget-gib 24]
        [--images 2] [--steps 28] [--size 1024|WxH] [--folder FLUX_FOLDER] [--device cuda|cpu] [--resident-blocks N]
        [--preset flux-dev|wan-1.3b ...] [--frames N] [--compile MODE]

``--preset`` builds another preset's random model instead (``--preset wan-1.3b --size 832x480 --frames 81
--configs te-fp8,model --budget-gib 12``: issue 28's Wan inside 12 GiB, with ``te-fp8``, its UMT5 encoder in
fp8 storage and the offload the daemon's ``offload=auto`` chooses for that within the budget (resident, the
transformer's activations at 81 frames ran out of memory beside the encoder), or ``model``, diffusers'
whole-component offload); a video's output is all its frames (its PSNR too);

``--folder`` runs a diffusers folder of your own (the real FLUX.1-dev, say) instead of the random one;
``--device cpu`` with a tiny folder is a dry run of the script itself (no budget, no offload there).

Each configuration runs in a process of its own, so that what one leaves in the allocator does not count
against the next: ``random:flux-dev`` (bf16, random weights) built on the GPU with the daemon's preset code
and wrapped in the daemon's ``DiffusersPipeline`` with the configuration's options, then one warm-up image
and ``--images`` timed ones (28 steps at 1024x1024, the same seed and prompt for all). The budget is
enforced for the runs with ``torch.cuda.set_per_process_memory_fraction`` (set after the build, which
needs the full model on the GPU once), so a configuration that overruns it really fails:

- ``resident``: everything on the device, no budget (the reference);
- ``group``: ``offload=group`` (diffusers' group offloading on CUDA streams), within the budget;
- ``stream``: ``offload=stream`` (pipelines/streaming.py: the transformer blocks the budget has room for stay
  resident, the rest stream through a ring of device slots), within the budget; ``resident_blocks`` planned
  as the daemon plans it (``stream_plan.choose`` with residency's default working-memory estimate at
  ``--size``) unless ``--resident-blocks`` gives it; the plan is in the JSON;
- ``fp8``: ``quant=transformer:fp8-storage,text_encoder_2:fp8-storage``, no offload, within the budget;
- ``fp8-wo``: ``quant=transformer:fp8,text_encoder_2:fp8-storage`` (torchao's float8 weight-only transformer);
- ``fp8-mm``: ``fp8=1,quant=text_encoder_2:fp8-storage`` (torchao's float8 weights and dynamic float8
  activations, so the transformer's matmuls run in fp8; the T5 encoder, used once per image, stored in fp8);
- ``fp8-rows``: ``fp8=rowwise,quant=text_encoder_2:fp8-storage`` (the same arithmetic scaled per row, without
  torchao: pipelines/fp8_rows.py; under ``--compile`` T5 in fp8 storage runs eager); ``fp8-rows-full`` and
  ``fp8-mm-full`` leave T5 as built;
- ``q8``, ``q4``: the transformer quantized to GGUF Q8_0 / Q4_0 (written here from the random weights with
  the ``gguf`` package's writer; the blocks are quantized with torch on the GPU, by the ggml formulas) and
  loaded back through diffusers' GGUF support as the daemon's loader does; no budget.

Each writes ``DIR/<config>.json`` (seconds per image, peak device memory) and its last image and final
latents (``.npy``); the driver then reports each one's speed against ``resident`` and the PSNR of its image
and latents against the resident ones. Times are wall clock around the pipeline call with the GPU drained.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = {
    "resident": ({}, False),
    "group": ({"offload": "group"}, True),
    "stream": ({"offload": "stream"}, True),
    "fp8": ({"quant": "transformer:fp8-storage,text_encoder_2:fp8-storage"}, True),
    "fp8-wo": ({"quant": "transformer:fp8,text_encoder_2:fp8-storage"}, True),
    "fp8-mm": ({"fp8": "1", "quant": "text_encoder_2:fp8-storage"}, True),
    "te-fp8": ({"quant": "text_encoder:fp8-storage", "offload": "auto"}, True),  # the daemon's auto: offloads
    "auto": ({"offload": "auto"}, True),  # what the daemon's default offload runs the preset with inside the budget
    "model": ({"offload": "model"}, True),
    "fp8-mm-full": ({"fp8": "1"}, False),  # fp8-mm with T5 as built, no budget
    "fp8-rows": ({"fp8": "rowwise", "quant": "text_encoder_2:fp8-storage"}, True),  # diffusiond's own fp8 matmuls
    "fp8-rows-full": ({"fp8": "rowwise"}, False),  # the same with T5 as built, no budget
    "cache-fbc": ({"cache": "fbc"}, False),  # step caches (eager: refused with --compile), PSNR against resident
    "cache-taylorseer": ({"cache": "taylorseer"}, False),
    "cache-taylorseer-lite": ({"cache": "taylorseer-lite"}, False),  # blocks skipped whole between full steps
    "q8": ({}, False),
    "q4": ({}, False),
}


def quantize_q8_0(w: Any) -> Any:
    """ggml's Q8_0 on the GPU: blocks of 32, d = max|x| / 127 (fp16), q = round(x / d) (int8)."""
    import torch

    rows, cols = w.shape
    x = w.float().reshape(rows, cols // 32, 32)
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(x * inv).to(torch.int8)
    out = torch.cat([d.half().view(torch.uint8).reshape(rows, cols // 32, 2), q.view(torch.uint8)], -1)
    return out.reshape(rows, cols // 32 * 34).cpu().numpy()


def quantize_q4_0(w: Any) -> Any:
    """ggml's Q4_0: d = (the value of largest magnitude) / -8, q = min(15, trunc(x / d + 8.5)), two per byte."""
    import torch

    rows, cols = w.shape
    x = w.float().reshape(rows, cols // 32, 32)
    idx = x.abs().argmax(-1, keepdim=True)
    d = torch.gather(x, -1, idx) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.clamp(torch.trunc(x * inv + 8.5), 0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    out = torch.cat([d.half().view(torch.uint8).reshape(rows, cols // 32, 2), packed], -1)
    return out.reshape(rows, cols // 32 * 18).cpu().numpy()


def write_gguf(module: Any, path: Path, qtype: str) -> None:
    import gguf
    import numpy as np

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    quant = quantize_q8_0 if qtype == "Q8_0" else quantize_q4_0
    writer = gguf.GGUFWriter(str(path), arch="flux")
    for name, t in module.state_dict().items():
        if t.ndim == 2 and t.shape[1] % 32 == 0 and t.numel() >= 256 * 32:
            q = quant(t)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(t.float().cpu().numpy(), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def one(a: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from diffusiond.pipelines.base import weight_bytes
    from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
    from diffusiond.pipelines.preset_tables import PRESETS
    from diffusiond.pipelines.presets import build_pipeline

    options, budgeted = CONFIGS[a.config]
    gguf_named: tuple[str, ...] = ()
    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    width, height = dims(a.size)
    t0 = time.perf_counter()
    if a.folder:
        import diffusers

        pipe = diffusers.DiffusionPipeline.from_pretrained(a.folder, torch_dtype=dtype).to(a.device)
    else:
        pipe = build_pipeline(PRESETS[a.preset], a.device, dtype)
    if a.config in ("q8", "q4"):
        import diffusers

        qtype = "Q8_0" if a.config == "q8" else "Q4_0"
        cfg = Path(a.out) / "transformer-config"
        pipe.transformer.save_config(str(cfg))
        gguf_path = Path(a.scratch) / f"flux-{qtype}.gguf"
        write_gguf(pipe.transformer, gguf_path, qtype)
        pipe.transformer = None
        torch.cuda.empty_cache()
        transformer = diffusers.FluxTransformer2DModel.from_single_file(
            str(gguf_path), config=str(cfg), torch_dtype=dtype,
            quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=dtype))
        pipe.transformer = transformer.to(a.device)
        options = {}
        gguf_named = (f"gguf-{qtype}(transformer, dequantized per layer to {str(dtype).removeprefix('torch.')})",)
    auto = ""
    if options.get("offload") == "auto":
        options, auto = auto_offload(pipe, options, a)
    if "offload" in options:
        pipe.to("cpu")  # built on the GPU; group offloading starts from host memory
    if cuda:
        torch.cuda.empty_cache()
    plan: dict[str, Any] = {}
    if options.get("offload") == "stream":  # the plan's options beside the others (te-fp8's quant=)
        streamed, plan = stream_options(pipe, a)
        options = {**options, **streamed}
    dp = DiffusersPipeline(pipe, name="flux", device=a.device, dtype=dtype, options=options)
    if a.compile:  # the daemon's --compile (regional for the transformer); the warm-up image compiles
        from diffusiond.pipelines.compile import CompiledPipeline

        CompiledPipeline(dp, a.compile, options)  # with the options: what a compile refuses is refused here too
    if cuda:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        if budgeted:
            torch.cuda.set_per_process_memory_fraction(a.budget_gib * 2**30 / total)
        torch.cuda.reset_peak_memory_stats()
    built_s = time.perf_counter() - t0
    latents: dict[str, Any] = {}

    def keep(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        latents["x"] = kw["latents"]
        return kw

    def image() -> tuple[float, Any]:
        sync()
        s = time.perf_counter()
        if a.compile in ("reduce-overhead", "max-autotune"):  # as CompiledPipeline.run: each call a new graph step
            torch.compiler.cudagraph_mark_step_begin()  # (without it: "accessing tensor output of CUDAGraphs that
            # has been overwritten", 2026-12-06 sixth session, h100-2026-12-06-s13/after-fusion/reduce-overhead)
        out = dp.pipe(prompt="a red fox in the snow", num_inference_steps=a.steps, height=height, width=width,
                      **({"num_frames": a.frames} if a.frames else {}),
                      guidance_scale=3.5, generator=torch.Generator(a.device).manual_seed(0), output_type="pt",
                      callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"])
        sync()
        return time.perf_counter() - s, (out.frames if hasattr(out, "frames") else out.images)[0]  # a video's all

    warm, _ = image()  # after it, the peak of one whole output (encoders, denoiser, VAE decode)
    times, img = [], None
    for _ in range(a.images):
        dt, img = image()
        times.append(dt)
    assert img is not None
    np.save(Path(a.out) / f"{a.config}-image.npy", img.half().cpu().numpy())
    np.save(Path(a.out) / f"{a.config}-latents.npy", latents["x"].float().cpu().numpy())
    result = {"config": a.config, "compile": a.compile or None, "preset": a.folder or a.preset, "size": a.size,
              "frames": a.frames, "steps": a.steps, "options": options, "offload_auto": auto or None,
              "budget_gib": a.budget_gib if budgeted else None,
              "build_s": built_s, "warmup_s": warm, "image_s": times, "mean_s": sum(times) / len(times),
              "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
              "device_weight_gib": weight_bytes(dp) / 2**30,
              "approximations": [*gguf_named, *dp.capabilities.approximations], "stream_plan": plan,
              "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    (Path(a.out) / f"{a.config}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


def auto_offload(pipe: Any, options: dict[str, str], a: argparse.Namespace) -> tuple[dict[str, str], str]:
    """``offload=auto`` as the daemon resolves it at its start (residency/fit.py's ``configurations`` and
    ``choose_offload``, working memory at its default 1024x1024 estimate), over the built modules' tensors counted
    as their files' headers would be, ``quant=`` included: the offload the daemon would run this model with."""
    import torch

    from diffusiond.daemon.residency.auto_skips import skips
    from diffusiond.daemon.residency.fit import FitReport, choose_offload, configurations
    from diffusiond.daemon.residency.fit_tensors import Tensor, quantize

    dtype = "bfloat16" if a.device == "cuda" else "float32"
    components = {name: [Tensor(k, "F32", 4 * t.numel(), t.numel()) for k, t in module.named_parameters()]
                  for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    components = quantize(components, options.get("quant", ""), [])
    budget = int(a.budget_gib * 2**30)
    rows = configurations(components, dtype, budget=budget, on_cpu=a.device == "cpu")
    at = {name: sum(t.bytes_at(dtype) for t in ts) for name, ts in components.items()}
    report = FitReport(a.preset, dtype, budget, at, rows, auto_skips=skips(type(pipe).__name__))
    chosen, why = choose_offload(report)
    print(f"offload=auto chose {why}", file=sys.stderr, flush=True)
    rest = {k: v for k, v in options.items() if k != "offload"}
    return ({**rest, "offload": chosen} if chosen != "none" else rest), why


def stream_options(pipe: Any, a: argparse.Namespace) -> tuple[dict[str, str], dict[str, Any]]:
    """``offload=stream`` with its ``resident_blocks``: given, or the most the budget has room for by the rule the
    daemon applies to a model's headers (working memory: residency's default estimate at the image size)."""
    from dataclasses import asdict

    from diffusiond.daemon.residency.working import Shape, default_working
    from diffusiond.pipelines import offload, stream_plan

    budget = int(a.budget_gib * 2**30)
    sizes = offload.stream_sizes(pipe)
    if a.resident_blocks is not None:
        plan, fits = stream_plan.plan(*sizes, a.resident_blocks), None
    else:
        width, height = dims(a.size)
        plan, fits = offload.plan_stream(pipe, lambda d: d + default_working(d, Shape(width, height)) <= budget)
    info = {**asdict(plan), "streamed": len(plan.streamed), "ring": plan.ring, "device_bytes": plan.device_bytes,
            "fits_by_the_estimate": fits, "describe": plan.describe()}
    print(f"stream: {plan.describe()}", file=sys.stderr, flush=True)
    return {"offload": "stream", "resident_blocks": str(plan.resident_blocks)}, info


def dims(size: str) -> tuple[int, int]:
    """``--size``'s (width, height): ``1024`` or ``832x480``."""
    w, _, h = size.partition("x")
    return int(w), int(h or w)


def psnr(a: Any, b: Any) -> float:
    import numpy as np

    peak = max(float(np.abs(b).max()), 1e-12)
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)


def drive(a: argparse.Namespace) -> None:
    import numpy as np

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.deadline
    for name in a.configs.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--out", a.out, "--scratch", a.scratch, "--device", a.device,
               *(["--folder", a.folder] if a.folder else []),
               "--budget-gib", str(a.budget_gib), "--images", str(a.images), "--steps", str(a.steps),
               "--size", str(a.size), "--preset", a.preset, *(["--frames", str(a.frames)] if a.frames else []),
               *(["--resident-blocks", str(a.resident_blocks)] if a.resident_blocks is not None else []),
               *(["--compile", a.compile] if a.compile else [])]
        with open(out / f"{name}.log", "w") as log:
            try:
                left = min(a.timeout, deadline - time.monotonic())
                rc = str(subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max(left, 1)).returncode)
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"{name}: rc={rc}", flush=True)
        for f in Path(a.scratch).glob("*.gguf"):
            f.unlink()
    ref = json.loads((out / "resident.json").read_text()) if (out / "resident.json").is_file() else None
    rows = []
    for name in a.configs.split(","):
        path = out / f"{name}.json"
        if not path.is_file():
            rows.append({"config": name, "failed": (out / f"{name}.log").read_text()[-600:]})
            continue
        r = json.loads(path.read_text())
        if ref is not None:
            r["speed_vs_resident"] = ref["mean_s"] / r["mean_s"]
            if name != "resident":
                for kind in ("image", "latents"):
                    r[f"psnr_{kind}_db"] = psnr(np.load(out / f"{name}-{kind}.npy"),
                                                np.load(out / f"resident-{kind}.npy"))
        rows.append(r)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("options",)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scratch", default="/tmp/bench-bigger")
    ap.add_argument("--configs", default="resident,stream,group,fp8,q8,q4")
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--size", default="1024", help="N (square) or WxH")
    ap.add_argument("--preset", default="flux-dev", help="the random model to build when no --folder is given")
    ap.add_argument("--frames", type=int, default=None, help="frames per output (a video preset)")
    ap.add_argument("--folder", help="a diffusers FLUX folder instead of random:flux-dev")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--compile", default="", help="every configuration compiled as serve --compile MODE does "
                    "(GGUF's per-layer dequantization fused by inductor; compare with resident compiled too)")
    ap.add_argument("--resident-blocks", type=int, help="stream: transformer blocks kept resident (default: planned)")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per configuration")
    ap.add_argument("--deadline", type=float, default=3600, help="seconds for all of them")
    ap.add_argument("--one", dest="config", help=argparse.SUPPRESS)
    a = ap.parse_args()
    Path(a.scratch).mkdir(parents=True, exist_ok=True)
    if a.config:
        one(a)
    else:
        drive(a)


if __name__ == "__main__":
    main()
