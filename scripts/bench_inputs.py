"""What admitting an edit costs the engine: decode, check, resize and seal an input image (and
mask) with ``daemon.inputs.decode_edit``, the work the encode pool does per edit request.

    PYTHONPATH=. python scripts/bench_inputs.py

Median of 15 runs per case; the images are a smooth gradient plus noise, saved as PNG (level 4).
"""

from __future__ import annotations

import io
import statistics
import time

import numpy as np
from PIL import Image

from diffusiond.daemon.config import Limits
from diffusiond.daemon.core.inputs import Source, decode_edit
from diffusiond.protocol import Task


def png(side: int, channels: int) -> bytes:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    img = (ramp[None, :, None] + ramp[:, None, None]) / 2 + rng.normal(0, 8, (side, side, channels))
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8).squeeze()).save(buf, format="PNG", compress_level=4)
    return buf.getvalue()


def median_ms(image: bytes, mask: bytes | None, target: int | None, limits: Limits, runs: int = 15) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        edit = decode_edit(Source("image", data=image), Source("mask", data=mask) if mask else None,
                           task=Task.INPAINTING if mask else Task.IMAGE_TO_IMAGE, strength=0.5,
                           width=target, height=target, limits=limits, input_dir=None)
        times.append((time.perf_counter() - t0) * 1000)
        edit.close()
    return statistics.median(times)


def main() -> None:
    limits = Limits()
    for side, target in ((512, None), (1024, None), (1024, 512)):
        image, mask = png(side, 3), png(side, 4)
        for with_mask in (False, True):
            what = f"{side}² PNG{' + mask' if with_mask else ''}{f' -> {target}²' if target else ''}"
            print(f"| {what} | {median_ms(image, mask if with_mask else None, target, limits):.1f} ms |")


if __name__ == "__main__":
    main()
