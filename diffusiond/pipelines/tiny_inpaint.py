"""The embedded ``tiny-inpaint`` model: ``tiny`` with the UNet of a dedicated inpainting model.

SD's inpainting checkpoints take 9 input channels (the noisy latents, the mask, the latents of
the masked image) and are saved as a ``StableDiffusionInpaintPipeline``; they inpaint and do
nothing else. ``tiny-inpaint`` is that, built in code like ``tiny`` (same tokenizer, text encoder
and pass-through VAE, fixed seeds), saved once into ``<cache>/models/tiny-inpaint-v1`` and loaded
back through the folder loader, so the daemon's path for such models runs on a CPU with no network.
"""

from __future__ import annotations

import functools
from pathlib import Path

from diffusiond.pipelines.modelcache import BUILT_FOLDERS, ensure_built
from diffusiond.pipelines.tiny import DEFAULTS as DEFAULTS
from diffusiond.pipelines.tiny import _build

# Its folder in the cache (a new name there when the architecture or the saved layout changes).
TINY_INPAINT_VERSION = BUILT_FOLDERS["tiny-inpaint"]


def ensure_tiny_inpaint(cache_dir: Path | None = None) -> Path:
    """The tiny-inpaint folder under ``<cache_dir or cache_root()>/models``, built on first use."""
    return ensure_built(TINY_INPAINT_VERSION, functools.partial(_build, inpaint=True), cache_dir)
