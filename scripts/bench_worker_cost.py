"""What one more worker process costs on a GPU: device memory of its CUDA context, and the time from
spawn to its first CUDA tensor (torch import and CUDA initialisation), the fixed price residency
pays when it stops a model's worker and starts it again.

    python scripts/bench_worker_cost.py [--runs 3]

Device memory is read with NVML (nvidia-ml-py) for the child's pid while it holds one small tensor,
so it is the context plus the allocator's first block, as a worker's is before it loads weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
x = torch.ones(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f}", flush=True)
sys.stdin.readline()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    rows = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdin is not None
        imp, init = map(float, p.stdout.readline().split())
        first = time.perf_counter() - t0
        used = next((x.usedGpuMemory for x in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if x.pid == p.pid), 0)
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait()
        rows.append({"spawn_to_first_tensor_s": round(first, 3), "torch_import_s": imp, "cuda_init_s": init,
                     "context_bytes": int(used or 0)})
        print(rows[-1], flush=True)
    print(json.dumps({"device": pynvml.nvmlDeviceGetName(handle), "runs": rows,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))


if __name__ == "__main__":
    main()
