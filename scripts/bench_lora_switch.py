"""What switching LoRA adapters between batches costs a worker (``Adapters.activate``), on ``tiny``.

    PYTHONPATH=. python scripts/bench_lora_switch.py [--repeat 10]

Two adapters (built in code like the tests', rank 4 on the UNet and the text encoder) are
switched back and forth: with ``--max-loras 1`` every switch unloads one and loads the other
from disk; with 2 both stay loaded and a switch is ``set_adapters`` alone; and base <-> adapter
is ``disable_lora`` / ``enable_lora`` + ``set_adapters``. Median milliseconds per switch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from lorakit import build_lora

from diffusiond.ipc.messages import LoraRef
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.hotswap import adapters_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = {"a": str(build_lora(tmp / "a", seed=1)), "b": str(build_lora(tmp / "b", seed=2))}
    adapters = adapters_for(load_pipeline("tiny"), paths, max_loaded=1)
    assert adapters is not None
    a, b = (LoraRef("a", 1.0),), (LoraRef("b", 1.0),)

    def switches(first: tuple[LoraRef, ...], second: tuple[LoraRef, ...]) -> float:
        times = []
        for i in range(args.repeat):
            t0 = time.perf_counter()
            adapters.activate(first if i % 2 == 0 else second)
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    print(f"switch with a reload (max_loras 1): {switches(a, b):.1f} ms")
    adapters.max_loaded = 2
    adapters.activate(a)
    adapters.activate(b)
    print(f"switch between loaded adapters (max_loras 2): {switches(a, b):.2f} ms")
    print(f"base <-> adapter: {switches((), (LoraRef('a', 0.5),)):.2f} ms")


if __name__ == "__main__":
    main()
