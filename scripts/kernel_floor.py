"""A model's forward against its kernels' floor (diffusiond/bench/floor.py), in one process: the eager
forward's time at a batch, optionally the compiled one's, and the sum of its heavy calls each timed alone. The
ratio eager / floor is the most that any change to everything but those calls could gain (fusing, CUDA graphs,
a faster scheduler); a target beyond it needs faster products or fewer of them (fp8, a step cache).

    python scripts/kernel_floor.py --model random:flux-dev,save=0 --dtype bfloat16 --size 1024 --steps 28
    python scripts/kernel_floor.py --model random:sd15,save=0,channels_last=1 --dtype float16 --size 512 \\
        --steps 4 --batch 16 --compile reduce-overhead

Prints one JSON object. The floor is measured on the forward's first batch's shapes; --steps only sets how
many denoiser calls there are, so a short run is enough to record them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--size", default="1024", help="WIDTH or WIDTHxHEIGHT")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--runs", type=int, default=3, help="timed forwards of each path (the median is kept)")
    p.add_argument("--compile", default="", help="also time the forward as --compile MODE runs it")
    a = p.parse_args()
    w, _, h = a.size.partition("x")

    import torch

    from diffusiond.bench.floor import recorder, replay
    from diffusiond.ipc.messages import BatchParams
    from diffusiond.pipelines import load_pipeline
    from diffusiond.pipelines.ltx2 import as_served

    pipe = load_pipeline(a.model, device=a.device, dtype=a.dtype)
    params = BatchParams(width=int(w), height=int(h or w), steps=a.steps, guidance=a.guidance, num_frames=a.frames)
    reqs = as_served(pipe.capabilities, PROMPT, range(a.batch), "")
    cuda = a.device.startswith("cuda")

    def forward(p: Any) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            p.run(params, reqs, lambda step, total: True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    forward(pipe)  # warm-up: cuDNN's and cuBLAS's choices, the allocator
    eager = statistics.median(forward(pipe) for _ in range(a.runs))
    calls: Counter[Any] = Counter()
    with recorder(calls):
        forward(pipe)
    floor = replay(calls, a.device)
    out: dict[str, Any] = {
        "model": a.model, "dtype": a.dtype, "size": f"{params.width}x{params.height}", "steps": a.steps,
        "batch": a.batch, "frames": a.frames, "eager_s": round(eager, 4),
        "floor": floor.summary(), "eager_over_floor": round(eager / floor.seconds, 3),
        "outputs_per_s": {"eager": round(a.batch / eager, 2), "floor": round(a.batch / floor.seconds, 2)},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]),
    }
    if a.compile:
        from diffusiond.pipelines.compile import CompiledPipeline
        from diffusiond.pipelines.spec import model_options

        compiled = CompiledPipeline(pipe, a.compile, model_options(a.model))
        t0 = time.perf_counter()
        for _ in range(3):  # compiled, CUDA graphs recorded (CompiledPipeline.run marks each call's graph step)
            forward(compiled)
        out["compile_warmup_s"] = round(time.perf_counter() - t0, 1)
        done = statistics.median(forward(compiled) for _ in range(a.runs))
        out["compiled_s"] = round(done, 4)
        out["compiled_over_floor"] = round(done / floor.seconds, 3)
        out["outputs_per_s"]["compiled"] = round(a.batch / done, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
