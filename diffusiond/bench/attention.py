"""One model's image time on each attention backend (model option ``attention=``), in one process.

    python -m diffusiond.bench.attention --model random:flux-dev,save=0 --size 1024x1024 --steps 28 \
        --backends native,_native_flash,_native_cudnn,_native_efficient,flash,sage --rounds 2

Why in one process, not one daemon per backend: the model (FLUX.1-dev is 34 GB with its encoders) is
built once and only the denoiser's kernel changes between runs (``pipelines/attention.py`` sets it, as
a load would, after ``reset_attention_backend``), so the figures differ by the kernel alone. Each run
is one image through the daemon's ``DiffusersPipeline.run`` (text encoding, every step, VAE decode),
after a warm-up of ``--warmup-steps`` steps on the same backend; backends take turns round by round,
in an order rotated each round, so a clock's drift spreads over all of them. A backend that cannot
run here (package missing, no CUDA, a GPU too old) is listed under ``skipped`` with the load's reason.

``s_per_image`` is the median over rounds; ``ratio`` is it over ``native``'s (below 1: faster);
``max_diff`` and ``mean_diff`` compare the backend's image (float, [0, 1], the same seed) with the
default path's: exact kernels land at float rounding, SageAttention's int8 further. Prints one JSON
object. Imports torch only in ``main``, as the rest of ``diffusiond.bench`` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

DEFAULT_BACKENDS = ("native", "_native_flash", "_native_cudnn", "_native_efficient", "flash", "_flash_3",
                    "xformers", "sage")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", default="random:flux-dev,save=0", help="a model spec, as serve --model takes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", default="1024x1024", help="WIDTHxHEIGHT")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help="comma-separated; native is always run")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from diffusiond.ipc.messages import BatchParams
    from diffusiond.pipelines.attention import apply_attention
    from diffusiond.pipelines.errors import PipelineError
    from diffusiond.pipelines.ltx2 import as_served
    from diffusiond.pipelines.registry import load_pipeline

    device = torch.device(args.device)
    width, _, height = args.size.partition("x")
    pipeline: Any = load_pipeline(args.model, device=args.device, dtype=args.dtype)
    pipe = pipeline.pipe
    denoiser = getattr(pipe, "transformer", None) or pipe.unet
    guidance = pipeline.capabilities.guidance
    requests = as_served(pipeline.capabilities, "a photo of a cat", [7], "r")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def image(steps: int) -> tuple[Any, float]:
        params = BatchParams(width=int(width), height=int(height or width), steps=steps, guidance=guidance)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = pipeline.run(params, requests, lambda _s, _t: True)[0]
        sync()
        return out.float().cpu().clone(), time.perf_counter() - start  # the next run may write over it

    def use(name: str) -> str:
        """Set ``name`` as a load would; the reason it cannot run here, or ""."""
        denoiser.reset_attention_backend()
        try:
            apply_attention(pipe, name, device)
        except PipelineError as exc:
            return str(exc)
        return ""

    names = ["native", *(n for n in dict.fromkeys(args.backends.split(",")) if n and n != "native")]
    skipped = {n: why for n in names if (why := use(n))}
    names = [n for n in names if n not in skipped]
    times: dict[str, list[float]] = {n: [] for n in names}
    images: dict[str, Any] = {}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            use(name)
            image(args.warmup_steps)
            out, seconds = image(args.steps)
            times[name].append(seconds)
            images.setdefault(name, out)
    base = statistics.median(times["native"])
    results = []
    for name in names:
        diff = (images[name] - images["native"]).abs()
        s = statistics.median(times[name])
        results.append({"attention": name, "s_per_image": round(s, 3), "ratio": round(s / base, 3),
                        "runs": [round(t, 3) for t in times[name]], "max_diff": float(f"{float(diff.max()):.3g}"),
                        "mean_diff": float(f"{float(diff.mean()):.3g}")})
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(json.dumps({"model": args.model, "device": gpu, "dtype": args.dtype, "size": args.size,
                      "steps": args.steps, "rounds": args.rounds, "torch": torch.__version__,
                      "results": results, "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
