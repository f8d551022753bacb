"""Build, save, load and run a ``random:<preset>`` model on a GPU, timing each stage.

    python scripts/bench_presets.py --preset random:sd15 [--dtype float16] [--save 1] [--batch 1]
        [--steps N] [--frames N] [--warmup-steps 2] [--cache DIR] [--rebuild] [--json OUT]

Stages: build (every component initialised on the GPU in the dtype, tokenizers generated), save
(``save_pretrained`` as safetensors into ``<cache>/models/``, ``preset_tables.folder_name``), load (through
the daemon's own folder loader, onto the GPU). ``--save 0`` skips save and load and runs the
model as built, as the daemon's ``save=0`` option does. An existing cache folder is loaded
without a rebuild unless ``--rebuild``.

The forward is one batch through the daemon's ``DiffusersPipeline.run`` (text encoding, every denoising step,
VAE decode; an edit-only model, FLUX Kontext or Qwen-Image-Edit, edits a random picture) at the preset's native
size and default steps, after one warm-up batch with ``--warmup-steps`` steps at the same shapes (each step has
the same shapes, so a short warm-up loads every kernel). ``forward_s`` comes from CUDA events around the call;
``per_step_s`` from events recorded at each step's end (steps 2..N, so without text encoding and VAE decode).
The weights are random: the outputs are noise, only the timings mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.loaders import load_folder
from diffusiond.pipelines.modelcache import cache_root
from diffusiond.pipelines.preset_tables import folder_name, get_preset
from diffusiond.pipelines.presets import build_pipeline, parameter_counts
from diffusiond.pipelines.registry import DTYPES
from diffusiond.protocol import EDIT_TASKS


def timed(fn: Any) -> tuple[Any, float]:
    """Wall-clock seconds of ``fn()``, with the GPU drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, help="random:NAME, NAME a preset of docs/models.md")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: float16 for UNets, else bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--save", choices=["0", "1"], default="1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's")
    ap.add_argument("--frames", type=int, default=None, help="video presets; default: the preset's")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=None, help="default: $DIFFUSIOND_CACHE or ~/.cache/diffusiond")
    ap.add_argument("--rebuild", action="store_true", help="build and save even if the cache folder exists")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()

    preset = get_preset(args.preset.removeprefix("random:"))
    dtype_name = args.dtype or ("float16" if "unet" in preset.parts else "bfloat16")
    dtype = DTYPES[dtype_name]
    device = torch.device(args.device)
    if device.index is not None:
        torch.cuda.set_device(device)
    result: dict[str, Any] = {
        "preset": f"random:{preset.name}", "shapes_of": preset.source, "dtype": dtype_name, "batch": args.batch,
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "params": parameter_counts(preset),
    }  # fmt: skip

    if args.save == "0":
        built, result["build_s"] = timed(lambda: build_pipeline(preset, device, dtype))
        pipe = DiffusersPipeline(built, name=f"random:{preset.name}", device=device, dtype=dtype)
    else:
        folder = (args.cache or cache_root()) / "models" / folder_name(preset)
        if args.rebuild and folder.exists():
            shutil.rmtree(folder)
        if not (folder / "model_index.json").is_file():
            built, result["build_s"] = timed(lambda: build_pipeline(preset, device, dtype))
            tmp = folder.with_name(folder.name + ".bench-tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _, result["save_s"] = timed(lambda: built.save_pretrained(str(tmp), safe_serialization=True))
            os.sync()
            tmp.rename(folder)
            del built
            torch.cuda.empty_cache()
        result["saved_gb"] = round(folder_bytes(folder) / 1e9, 2)
        pipe, result["load_s"] = timed(
            lambda: load_folder(folder, name=f"random:{preset.name}", device=device, dtype=dtype, options={})
        )
    result["weights_gb_on_gpu"] = round(torch.cuda.memory_allocated(device) / 1e9, 2)

    d = preset.defaults
    steps = args.steps or int(d["steps"])
    frames = args.frames or (int(d["num_frames"]) if "num_frames" in d else None)
    shape = {"width": int(d["width"]), "height": int(d["height"]), "guidance": float(d["guidance"])}
    shape["num_frames"] = frames
    requests = [RequestSpec(request_id=f"r{i}", prompt="a photo of a cat", seed=i) for i in range(args.batch)]
    step_ends: list[torch.cuda.Event] = []

    def on_step(_step: int, _total: int) -> bool:
        """Marks each step's end on the stream: the denoising loop's time without encode/decode."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        step_ends.append(event)
        return True

    # An edit-only model (FLUX Kontext, Qwen-Image-Edit: task instruction-edit) runs as its users run it, on an
    # input image at the output size (random pixels), whose latents its transformer attends to beside the noise.
    edit = pipe.task.value if pipe.task in EDIT_TASKS else None
    shape["edit"] = edit
    picture = np.random.default_rng(0).integers(0, 256, (shape["height"], shape["width"], 3), dtype=np.uint8)

    def forward(params: BatchParams) -> list[torch.Tensor]:
        if edit is None:
            return pipe.run(params, requests, on_step)
        return pipe.edit(params, requests, [(picture, None)] * len(requests), on_step)

    result["edit"] = edit
    warm = BatchParams(steps=args.warmup_steps or steps, **shape)  # type: ignore[arg-type]
    _, result["warmup_s"] = timed(lambda: forward(warm))
    torch.cuda.reset_peak_memory_stats(device)
    step_ends.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    outputs = forward(BatchParams(steps=steps, **shape))  # type: ignore[arg-type]
    end.record()
    end.synchronize()
    forward_s = start.elapsed_time(end) / 1000
    # Denoiser calls can exceed the steps asked for (PNDM, SD1.5's scheduler, adds one).
    calls = len(step_ends)
    # Calls 2..N, between the first and the last call's end: one step's time with no encode/decode.
    per_step = step_ends[0].elapsed_time(step_ends[-1]) / 1000 / (calls - 1) if calls > 1 else None
    result.update(
        width=shape["width"], height=shape["height"], steps=steps, denoiser_calls=calls, num_frames=frames,
        forward_s=round(forward_s, 3), per_step_s=None if per_step is None else round(per_step, 4),
        output_shape=list(outputs[0].shape), peak_gpu_gb=round(torch.cuda.max_memory_allocated(device) / 1e9, 2),
    )  # fmt: skip
    for key in ("build_s", "save_s", "load_s", "warmup_s"):
        if key in result:
            result[key] = round(result[key], 2)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
