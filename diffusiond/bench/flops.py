"""FLOPs per output and the device's peak, so every speed figure says how far it is from the hardware.

``x limit`` says how close the daemon comes to the pipeline called in a loop; it cannot say whether
that loop itself uses 5 % or 60 % of the GPU. Achieved TFLOP/s (FLOPs per output x outputs per
second) and its share of the device's peak can.

What is counted: the bench's own pipeline makes one output, at batch 1, with the bench's size,
steps, guidance and frames, under torch's ``FlopCounterMode``. The count is therefore what the
pipeline really runs: every denoiser forward with the CFG batch it really uses (2 with guidance on
SD-style models, 1 on guidance-distilled ones), the text encoders, the VAE decode. It is made in the
bench's process, never in the daemon (which never loads torch). FLOPs grow linearly with the batch,
so a forward of b outputs costs b times the count.

Why not on the meta device, where counting would cost no compute: diffusers' schedulers copy their
timesteps to the host (``sigmas.to("cpu")``) and read tensor values, which a meta tensor does not
have, so a pipeline cannot run there as a whole; one output at batch 1 on the real device is the
least work that runs the pipeline's own code. It reuses the eager limit's pipeline when there is
one, and is cached (``<cache>/bench/flops.json``) per model, size, steps, guidance and frames, so a
second bench run of the same workload counts nothing.

FlopCounterMode counts matrix multiplies, convolutions and attention (2 FLOPs per multiply-add);
elementwise work, norms and softmax are left out, as in the usual model-FLOPs-utilization figure.
Attention is counted as 4·B·H·Sq·Sk·D per call (two matrix products over the full score matrix, masks
not subtracted), the formula torch gives its SDPA kernels. The counter knows nothing else (issue 31):
on the CPU, SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, which it has no formula for
(``counter`` adds one), and the packages' kernels a model's ``attention=`` option may choose
(FlashAttention, xformers, SageAttention) are invisible to it; so the count always runs the denoiser's
attention on SDPA (``count``), whichever kernel the timed modes use.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Bump when what is counted changes: older cache entries are then ignored.
COUNT_VERSION = 2  # 2: attention counted on the default path (issue 31)

# Dense (no sparsity) bf16/fp16 tensor-core peaks in TFLOP/s. Source: each vendor's datasheet (NVIDIA
# H100 and H200 datasheets, A100 datasheet, L40S datasheet; the RTX 4090 from NVIDIA's Ada architecture
# whitepaper, fp16 with fp32 accumulate). Matched by substring of the CUDA device name, first match
# first, so the specific names (NVL, PCIe) come before the family name.
PEAKS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312.0),
    ("L40S", 362.0),
    ("RTX 4090", 165.2),
)
PEAK_DTYPES = ("float16", "bfloat16")  # what the table's peaks are for


@dataclass
class FlopCount:
    per_image: int  # FLOPs of one output: an image, or one video of --frames frames
    denoiser: int  # of which in the denoiser's forwards
    denoiser_forwards: int  # forwards per output: the steps (x2 where a scheduler evaluates twice a step)
    counted_on: str  # device and dtype of the counting run


def cache_key(model: str, width: int, height: int, steps: int, guidance: float, frames: int | None) -> str:
    return json.dumps([COUNT_VERSION, model, width, height, steps, guidance, frames])


def cache_file() -> Path | None:
    """``<diffusiond cache>/bench/flops.json``, or None when there is no diffusiond cache to keep it in."""
    from diffusiond.pipelines.modelcache import cache_root

    root = cache_root()
    return root / "bench" / "flops.json" if root.is_dir() else None


def _read_cache(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached(key: str) -> FlopCount | None:
    entry = _read_cache(cache_file()).get(key)
    try:
        return FlopCount(**entry) if isinstance(entry, dict) else None
    except TypeError:  # written by a different FlopCount
        return None


def remember(key: str, count: FlopCount) -> None:
    """Add ``count`` to the cache file; written beside it and renamed, so a reader never sees half a file."""
    path = cache_file()
    if path is None:
        return
    with contextlib.suppress(OSError):
        path.parent.mkdir(exist_ok=True)
        data = {**_read_cache(path), key: asdict(count)}
        fd, tmp = tempfile.mkstemp(prefix=".flops-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query, key, value))


def counter() -> Any:
    """A FlopCounterMode that also counts attention on the CPU: torch registers formulas for the CUDA
    attention kernels only, and without this a CPU count would leave attention out."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    extra = {}
    cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu is not None:
        extra[cpu] = _cpu_attention
    return FlopCounterMode(display=False, custom_mapping=extra)


def denoisers(pipeline: Any) -> list[Any]:
    """The denoiser modules of a served pipeline (a compiled one's inner diffusers pipeline's; Wan 2.2 has
    two); none for a pipeline that is not diffusers'."""
    from diffusiond.pipelines.denoisers import denoisers as pipeline_denoisers  # the CLI's import stays light

    return [module for _, module in pipeline_denoisers(_diffusers_pipe(pipeline))]


def _diffusers_pipe(pipeline: Any) -> Any:
    """The diffusers pipeline a served one runs (a compiled one's inner one's), None for one that is not
    diffusers' (which then has no denoisers and no attention backend)."""
    return getattr(getattr(pipeline, "inner", pipeline), "pipe", None)


def count(pipeline: Any, params: Any, prompt: str) -> FlopCount:
    """Run ``pipeline`` once, for one output with ``params``, and count what it computes, its attention on
    the default path whatever backend the model's ``attention=`` option chose (``default_attention``): the
    count is a property of the shapes, not of the kernel, and torch's counter sees SDPA's kernels only."""
    import torch

    from diffusiond.pipelines.attention import default_attention
    from diffusiond.pipelines.ltx2 import as_served

    mode = counter()
    denoised = [0, 0]  # FLOPs inside denoiser forwards, forwards
    starts: list[int] = []

    def before(*_: Any) -> None:
        starts.append(mode.get_total_flops())

    def after(*_: Any) -> None:
        denoised[0] += mode.get_total_flops() - starts.pop()
        denoised[1] += 1

    hooks = [h for m in denoisers(pipeline)
             for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        with torch.inference_mode(), default_attention(_diffusers_pipe(pipeline)), mode:
            pipeline.run(params, as_served(pipeline.capabilities, prompt, [0], "flops"), lambda step, total: True)
    finally:
        for h in hooks:
            h.remove()
    dtype = str(pipeline.dtype).removeprefix("torch.")
    return FlopCount(int(mode.get_total_flops()), denoised[0], denoised[1], f"{pipeline.device}, {dtype}, batch 1")


def datasheet_peak(name: str) -> float | None:
    """The table's peak for a CUDA device name, None for a device it does not hold."""
    return next((tflops for key, tflops in PEAKS if key.lower() in name.lower()), None)


def peak(device: str, dtype: str, override: float | None) -> tuple[float | None, str]:
    """The peak to measure against and where it comes from; None (with the reason) when there is none."""
    if override is not None:
        return override, "--peak-tflops"
    if not device.startswith("cuda"):
        return None, "no peak for a CPU: the share of peak is left out (give --peak-tflops to set one)"
    import torch

    name = torch.cuda.get_device_name(device)
    found = datasheet_peak(name)
    if found is None:
        return None, f"no peak known for {name}: the share of peak is left out (give --peak-tflops)"
    if dtype not in PEAK_DTYPES:
        return None, (f"the table holds {name}'s dense bf16/fp16 peak ({found:g} TFLOP/s), not one for {dtype}: "
                      "the share of peak is left out (give --peak-tflops)")
    return found, f"{name}, dense bf16/fp16, vendor datasheet"


def measure_flops(s: Any, pipeline: Any | None, prompt: str, override: float | None) -> dict[str, Any]:
    """The report's ``flops`` section: the count (from the cache, or made on ``pipeline``, or on a
    pipeline loaded for it when the run has no eager limit) and the peak it is measured against."""
    key = cache_key(s.model, s.width, s.height, s.steps, s.guidance, s.frames)
    found = cached(key)
    fresh = found is None
    if found is None:
        print("bench: counting FLOPs per image (one output at batch 1) ...", file=sys.stderr, flush=True)
        try:
            found = _count_with(s, pipeline, prompt)
        except Exception as exc:  # a bench run is worth more than its FLOPs: say why and go on
            print(f"bench: FLOPs not counted: {exc}", file=sys.stderr, flush=True)
            return {"per_image": None, "note": f"FLOPs not counted: {type(exc).__name__}: {exc}"}
        if found.per_image:
            remember(key, found)
    top, source = peak(s.device, s.dtype, override)
    note = None if top is not None else source
    if not found.per_image:
        note = "the model ran no matrix multiply, convolution or attention the counter knows: no TFLOP/s"
    return {**asdict(found), "cached": not fresh, "peak_tflops": top, "peak_from": source if top else None,
            "note": note}


def _count_with(s: Any, pipeline: Any | None, prompt: str) -> FlopCount:
    from diffusiond.ipc.messages import BatchParams

    params = BatchParams(width=s.width, height=s.height, steps=s.steps, guidance=s.guidance, num_frames=s.frames,
                         output_dtype=s.output_dtype)
    if pipeline is not None:
        return count(pipeline, params, prompt)
    from diffusiond.pipelines import load_pipeline

    loaded = load_pipeline(s.model, device=s.device, dtype=s.dtype)
    try:
        return count(loaded, params, prompt)
    finally:
        del loaded
        _free(s.device)


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def annotate(rows: list[dict[str, Any]], flops: dict[str, Any] | None) -> None:
    """Give each mode's row its achieved TFLOP/s (FLOPs per image x images/s) and share of the peak."""
    per_image = (flops or {}).get("per_image")
    top = (flops or {}).get("peak_tflops")
    for row in rows:
        tflops = per_image * row["throughput"] / 1e12 if per_image else None
        row["tflops"] = tflops
        row["peak_share"] = tflops / top if tflops is not None and top else None


def describe(flops: dict[str, Any] | None) -> list[str]:
    """The lines under the table that say what the TFLOP/s column was computed from."""
    if not flops:
        return []
    if not flops.get("per_image"):
        return ["", f"TFLOP/s: {flops.get('note')}"]
    rest = flops["per_image"] - flops["denoiser"]
    lines = [
        "",
        f"TFLOP/s: {_si(flops['per_image'])}FLOP per image (denoiser: {flops['denoiser_forwards']} forwards, "
        f"{_si(flops['denoiser'])}FLOP; text encoders, VAE decode and the rest: {_si(rest)}FLOP) x req/s; counted "
        f"with torch's FlopCounterMode on one output ({flops['counted_on']}"
        f"{', from the cache' if flops.get('cached') else ''}).",
    ]
    if flops.get("peak_tflops"):
        lines.append(f"% peak: against {flops['peak_tflops']:g} TFLOP/s ({flops['peak_from']}).")
    if flops.get("note"):
        lines.append(f"% peak: {flops['note']}.")
    return lines


def _si(n: float) -> str:
    for scale, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} "
