"""An upscaler for the tests, built in code (no download): spandrel's ESRGAN architecture (RRDBNet)
at tiny widths, random weights, saved as a state dict with the key names ESRGAN checkpoints use, so
the daemon's spandrel recognises it from the file alone, as it does a downloaded one."""

from __future__ import annotations

from pathlib import Path


def build_upscaler(out: Path, *, seed: int, scale: int = 2) -> Path:
    """Write an ESRGAN (8 features, 1 block) of ``scale`` to ``out`` (.pth or .safetensors); returns it."""
    import torch

    from diffusiond.pipelines.upscalers import _spandrel

    _spandrel()  # imported as the daemon does (without torchvision where none imports)
    from spandrel.architectures.ESRGAN import ESRGAN

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = {k: v.contiguous() for k, v in ESRGAN(num_filters=8, num_blocks=1, scale=scale).state_dict().items()}
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out))
    else:
        torch.save(state, out)
    return out


def require_spandrel() -> None:
    """Skip unless spandrel imports the way the daemon imports it (without torchvision where none does)."""
    import pytest

    from diffusiond.pipelines.upscalers import _spandrel

    try:
        _spandrel()
    except ImportError as exc:
        pytest.skip(f"spandrel is not installed ({exc}): pip install 'diffusiond[upscale]'")
