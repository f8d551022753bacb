"""Which devices a model's workers use: ``--device auto`` (the default), ``cpu``, ``cuda`` or a list, counted
without loading torch in the engine (NVML where it answers, else a child interpreter), so that a daemon on a
GPU machine uses its GPUs when nobody said otherwise, as a user of a local daemon expects."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from diffusiond.daemon.values import ConfigError


def cuda_device_count() -> int:
    """From NVML where it answers (milliseconds), else asked of a child interpreter with torch: the
    engine process never loads torch (hundreds of MB that only the workers need), and that child
    costs seconds before the daemon can listen (4-5 s of a cold start measured on an H200 box)."""
    counted = _nvml_count(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if counted is not None:
        return counted
    code = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"--device cuda: could not count the CUDA devices with torch: {exc}") from None
    return int(out.stdout.strip() or 0)


def _nvml_count(visible: str | None) -> int | None:
    """The devices CUDA will show, read from NVML; None where NVML is missing or cannot tell (a
    ``CUDA_VISIBLE_DEVICES`` naming devices by UUID or MIG instance: torch answers those)."""
    try:
        pynvml: Any = importlib.import_module("pynvml")
        pynvml.nvmlInit()
        try:
            total = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # ImportError, or NVML's own errors: no driver, no library
        return None
    if visible is None:
        return total
    count = 0
    for entry in visible.split(","):  # CUDA's rule: the devices listed, up to the first that is not one
        entry = entry.strip()
        if not entry.isdigit():
            return None if entry and not entry.startswith("-") else count
        if int(entry) >= total:
            return count
        count += 1
    return count


def parse_devices(device: str, workers: int) -> tuple[str, ...]:
    """``auto`` (every visible GPU, else the CPU), ``cpu`` with N workers, ``cuda`` (every visible GPU), or an
    explicit ``cuda:0,cuda:1`` list."""
    parts = [d.strip() for d in device.split(",") if d.strip()]
    if parts == ["auto"]:
        gpus, _ = auto_device()
        if not gpus:
            return ("cpu",) * max(1, workers)
        return tuple(f"cuda:{i}" for i in range(gpus))
    if parts == ["cpu"]:
        return ("cpu",) * max(1, workers)
    if parts == ["cuda"]:
        count = cuda_device_count()
        if count == 0:
            raise ConfigError("--device cuda, but no CUDA device is visible (check nvidia-smi, CUDA_VISIBLE_DEVICES)")
        return tuple(f"cuda:{i}" for i in range(count))
    for p in parts:
        if p != "cpu" and not (p.startswith("cuda:") and p[5:].isdigit()):
            raise ConfigError(f"device {p!r} is not auto, cpu, cuda or cuda:N")
    return tuple(parts)


def auto_device() -> tuple[int, str]:
    """How many GPUs ``--device auto`` (the default) uses, and why, without loading torch: none where no NVIDIA
    driver is loaded or torch is a CPU build (its workers could not use one), else every visible GPU. A GPU
    user who gave no ``--device`` ran on the CPU without a word before."""
    if not os.path.isdir("/proc/driver/nvidia/gpus") or not os.listdir("/proc/driver/nvidia/gpus"):
        return 0, "no NVIDIA GPU on this machine"
    cuda = _torch_cuda_version()
    if cuda is None:
        return 0, "torch here is a CPU build; install a CUDA build of torch to use this machine's GPUs"
    count = cuda_device_count()
    return count, f"{count} GPU(s) visible, torch built for CUDA {cuda}" if count else "no GPU visible to CUDA"


def _torch_cuda_version() -> str | None:
    """The CUDA version torch was built for, read from its ``version.py`` (importing torch costs the engine
    seconds and hundreds of MB), or None for a CPU build or when it cannot be read."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None
