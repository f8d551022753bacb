"""The GPU time one preview adds, timed by CUDA events: the projection and resize that the
forward's stream runs (``LinearPreviewer``), and the uint8 conversion that the copy thread's
stream runs (``to_output_layout``). Set beside the time a denoising step takes, this is what
previews can cost at most, whatever the run-to-run noise of end-to-end throughput.

    python scripts/bench_preview_kernels.py            # SDXL latents at 1024², 256 px previews
"""

from __future__ import annotations

import argparse

import torch

from diffusiond.ipc import messages as m
from diffusiond.pipelines.previews import LinearPreviewer
from diffusiond.worker.copier import to_output_layout


def timed_us(fn: object, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()  # type: ignore[operator]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="sdxl")
    p.add_argument("--size", type=int, default=1024, help="output side; latents are 1/8 of it")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()

    class Pipe:  # what the previewer reads of a pipeline: nothing, for unpacked latents
        pass

    previewer = LinearPreviewer(Pipe(), args.family)
    channels = len(previewer._weight)
    latents = torch.randn(args.batch, channels, args.size // 8, args.size // 8, device="cuda", dtype=torch.float16)
    params = m.BatchParams(width=args.size, height=args.size, steps=20, guidance=5.0)
    pictures: list[torch.Tensor] = []
    for indices in ([0], list(range(args.batch))):
        for _ in range(20):  # warm-up: the factors move to the device, kernels load
            pictures = previewer(latents, indices, params, [256] * len(indices))
        us = timed_us(lambda i=indices: previewer(latents, i, params, [256] * len(i)), args.calls)
        print(f"preview projection+resize, {len(indices)} picture(s): {us:.1f} us GPU per call")
    picture = pictures[0]
    print(f"to uint8 HWC (copy thread): {timed_us(lambda: to_output_layout(picture, 'uint8'), args.calls):.1f} us GPU")


if __name__ == "__main__":
    main()
