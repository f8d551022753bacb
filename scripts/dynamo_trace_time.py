"""Dynamo's share of a compiled warm-up, the part no compile cache skips (issue 31): a model's compiled modules
(text encoders, denoiser, VAE decoder, as ``--compile`` picks them) traced with the eager backend, so only dynamo
runs, by one small forward. Prints the worker's compile-cache line and dynamo's seconds per graph.

Usage: PYTHONPATH=. python scripts/dynamo_trace_time.py [SPEC] [SIZE]   (default: random:sd15,save=0 64)
"""

from __future__ import annotations

import sys
import time

import torch
from torch._dynamo.utils import compilation_time_metrics

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.compile import CompiledPipeline, cache_report
from diffusiond.pipelines.registry import load_pipeline
from diffusiond.pipelines.spec import model_options


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "random:sd15,save=0"
    size = int(argv[1]) if len(argv) > 1 else 64
    t0 = time.perf_counter()
    pipe = load_pipeline(spec, name="m", device="cpu", dtype="float32", options=model_options(spec, {}))
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    compiled = CompiledPipeline(pipe, "default", {"compile_backend": "eager"})
    params = BatchParams(width=size, height=size, steps=2, guidance=pipe.capabilities.guidance)
    t0 = time.perf_counter()
    with torch.inference_mode():
        compiled.run(params, [RequestSpec(request_id="w", prompt="warm-up", seed=0)], lambda _s, _n: True)
    print(f"first forward {time.perf_counter() - t0:.1f} s; {cache_report()}")
    print("compiled:", ", ".join(compiled.compiled), "; per graph (s), in the order the forward ran them "
          "(text encoders, denoiser, VAE decoder):",
          {k: [round(x, 2) for x in compilation_time_metrics.get(k, [])]
           for k in ("_compile.compile_inner", "bytecode_tracing", "build_guards")})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
