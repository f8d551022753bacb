"""Stream generated images from a running diffusiond straight into a PyTorch training loop.

    diffusiond serve --model tiny                  # in one terminal (or let systemd run it)
    python examples/train_loop.py --batches 5      # in another: prints each step, then steps/s

``GeneratedImages`` is an ``IterableDataset``: it keeps up to ``--in-flight`` jobs submitted ahead,
so the daemon computes the next batches while the model trains on this one. Arrays come with
``output="array"``: mapped from the daemon's shared memory when it runs on this machine (no copy),
streamed over HTTP otherwise; the code is the same either way.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from numpy.typing import NDArray
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import diffusiond
from diffusiond.client import JobParams

Batch = tuple[torch.Tensor, list[str], list[int]]
PROMPTS = ("a red cube on a table", "a lighthouse at dusk", "a bowl of fruit", "a cat in the snow")


class GeneratedImages(IterableDataset[Batch]):
    """Yields (images N×3×H×W float32 in [0, 1] on ``device``, prompts, seeds); one job per batch."""

    def __init__(self, socket: str | None, *, model: str, batch: int, size: str | None, steps: int | None,
                 batches: int | None, in_flight: int, prompts: Sequence[str] = PROMPTS, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        super().__init__()
        self.socket, self.model, self.batch, self.size, self.steps = socket, model, batch, size, steps
        self.batches, self.in_flight, self.prompts, self.seed = batches, max(1, in_flight), prompts, seed
        self.device = torch.device(device)

    def __iter__(self) -> Iterator[Batch]:
        # The client is made here, in the process that iterates: keep DataLoader(num_workers=0),
        # since a worker process would have to pickle every batch back and the copy is the point.
        with diffusiond.Client(self.socket) as client:
            pending: deque[tuple[diffusiond.JobHandle, str]] = deque()
            submitted = 0

            def fill() -> None:
                nonlocal submitted
                while len(pending) < self.in_flight and (self.batches is None or submitted < self.batches):
                    prompt = self.prompts[submitted % len(self.prompts)]
                    params: JobParams = {"model": self.model, "n": self.batch, "output_format": "npy",
                                         "seed": self.seed + submitted * self.batch}  # fmt: skip
                    if self.size:
                        params["size"] = self.size
                    if self.steps:
                        params["steps"] = self.steps
                    job = client.submit(prompt, **params)
                    pending.append((job, prompt))
                    submitted += 1

            try:
                fill()
                while pending:
                    job, prompt = pending.popleft()
                    arrays = job.outputs("array")  # uint8 (H, W, 3), read-only over the daemon's memory
                    fill()  # submit the next one before the trainer takes over: the daemon never waits
                    seeds = [int(o["seed"]) for o in sorted(job.job["outputs"], key=lambda o: o["index"])]
                    yield self._tensor(arrays), [prompt] * len(arrays), seeds
                    # `arrays` is dropped at the next turn: the daemon's memory goes back to it then.
            finally:
                for job, _ in pending:  # stopped early: nobody will read these
                    job.cancel()

    def _tensor(self, arrays: list[NDArray[Any]]) -> torch.Tensor:
        with warnings.catch_warnings():  # the arrays are read-only on purpose; we never write them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            views = [torch.from_numpy(a) for a in arrays]  # no copy: the tensors share the mapping
        h, w = views[0].shape[:2]
        out = torch.empty((len(views), 3, h, w), dtype=torch.float32, device=self.device)
        for i, view in enumerate(views):
            # The normalisation is the one copy: uint8 HWC -> float NCHW on the device, in one
            # copy_ (the read-only source cannot be normalised in place, and need not be).
            out[i].copy_(view.permute(2, 0, 1))
        return out.div_(255.0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", help="the daemon's socket (default: as the diffusiond CLI finds it)")
    p.add_argument("--model", default="tiny", help="model name on the daemon (default: tiny)")
    p.add_argument("--size", help="WxH, e.g. 64x64 (default: the model's)")
    p.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    p.add_argument("--batch", type=int, default=4, help="images per batch (default: 4)")
    p.add_argument("--batches", type=int, default=5, help="stop after N batches (default: 5; 0 = forever)")
    p.add_argument("--in-flight", type=int, default=2, help="jobs submitted ahead (default: 2)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = GeneratedImages(args.socket, model=args.model, batch=args.batch, size=args.size, steps=args.steps,
                           batches=args.batches or None, in_flight=args.in_flight, device=device)  # fmt: skip
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    start, images, step = time.perf_counter(), 0, 0
    # batch_size=None: the dataset already yields whole batches.
    for step, (x, prompts, seeds) in enumerate(DataLoader(data, batch_size=None), 1):
        loss = nn.functional.mse_loss(net(x), x)  # a dummy objective: reconstruct the input
        opt.zero_grad()
        loss.backward()
        opt.step()
        images += len(x)
        print(f"step {step}  loss {loss.item():.4f}  images {tuple(x.shape)}  seeds {seeds}  {prompts[0]!r}")
    took = time.perf_counter() - start
    print(f"{step} steps in {took:.2f} s: {step / took:.2f} steps/s, {images / took:.1f} images/s on {device}")


if __name__ == "__main__":
    try:
        main()
    except diffusiond.ClientError as exc:  # no daemon, a rejected job, ...: one line, not a traceback
        raise SystemExit(f"train_loop: {exc}") from None
