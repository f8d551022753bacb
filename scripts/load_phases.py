"""Where a model's load goes on this machine: the SD 1.5-size random folder (as `gpu_round3.sh cold` uses),
built once into CACHE, then loaded N times through the folder loader, each load's phases printed.

    PYTHONPATH=. python scripts/load_phases.py [--cache /tmp/coldcache] [--device cpu] [--loads 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from diffusiond.pipelines.loaders import load_folder
from diffusiond.pipelines.modelcache import ensure_built
from diffusiond.pipelines.preset_tables import folder_name, get_preset
from diffusiond.pipelines.presets import _save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/coldcache"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--loads", type=int, default=2)
    args = parser.parse_args()
    preset, device = get_preset("sd15"), torch.device(args.device)
    folder = ensure_built(folder_name(preset), lambda out: _save(preset, out, device, torch.float16), args.cache)
    for i in range(args.loads):
        t = time.perf_counter()
        pipeline = load_folder(folder, name="sd", device=device, dtype=torch.float16, options={})
        print(f"load {i}: {time.perf_counter() - t:.2f} s: {pipeline.load_phases}", flush=True)


if __name__ == "__main__":
    main()
