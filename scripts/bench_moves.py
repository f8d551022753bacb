"""Time a model's weights leaving the GPU and coming back, as residency moves them (sleep / wake).

    python scripts/bench_moves.py --preset random:sdxl [--dtype float16] [--rounds 5] [--json OUT]

The model is built as the daemon's ``random:<preset>`` spec builds it (``save=0``: straight onto the
GPU) and wrapped in the daemon's own ``DiffusersPipeline``, whose ``sleep`` and ``wake`` are what a
worker runs when residency sends a model to host memory and back (``pipelines/hostcopy.py``: pinned
buffers made on the first move and reused). Round 1 of ``leave`` includes pinning the host buffers;
later rounds are the steady state. Also timed, for comparison in the same run: ``module.to("cpu")``
and back, the pageable path the daemon used before. Each time is wall clock with the GPU drained.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffusiond.pipelines.registry import load_pipeline


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pageable", type=int, default=1, help="also time module.to() both ways (1 round)")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args()
    pipe: Any = load_pipeline(f"{a.preset},save=0", device="cuda", dtype=a.dtype)
    from diffusiond.pipelines.base import weight_bytes

    nbytes = weight_bytes(pipe)
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        leave = timed(pipe.sleep)
        free_gb = torch.cuda.mem_get_info()[0] / 1e9
        back = timed(pipe.wake)
        rows.append({"round": r + 1, "leave_s": leave, "back_s": back, "free_gb_while_away": free_gb})
        print(f"round {r + 1}: leave {leave:.3f} s ({nbytes / leave / 1e9:.1f} GB/s), back {back:.3f} s "
              f"({nbytes / back / 1e9:.1f} GB/s)", flush=True)
    pageable: dict[str, float] = {}
    if a.pageable:
        modules = [c for c in pipe._pipe.components.values() if isinstance(c, torch.nn.Module)]
        pageable["to_cpu_s"] = timed(lambda: [m.to("cpu") for m in modules])
        pageable["to_cuda_s"] = timed(lambda: [m.to("cuda") for m in modules])
        print(f"module.to(): to cpu {pageable['to_cpu_s']:.3f} s, back {pageable['to_cuda_s']:.3f} s", flush=True)
    out = {"preset": a.preset, "dtype": a.dtype, "weight_bytes": nbytes, "device": torch.cuda.get_device_name(),
           "rounds": rows, "pageable": pageable, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
