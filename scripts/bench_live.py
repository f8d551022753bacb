"""Live weights from a trainer, timed from the call to the first job that runs with them (issue 29).

    python scripts/bench_live.py lora --preset flux-dev --component transformer --rank 64 --dtype bfloat16
    python scripts/bench_live.py weights --preset sdxl --component unet --dtype float16

One daemon serves ``random:<preset>,save=0`` (or a model built in code, ``--preset tiny``, with ``--device cpu``: a
dry run). Each phase prints its seconds on stderr as it ends, so a run cut short leaves a trail
(``--stacks-every N``: every thread's stack too). ``lora``: a rank-R adapter on every attention projection
(``to_q``, ``to_k``, ``to_v``, ``to_out.0``, and the ``add_*_proj``/``to_add_out`` of joint blocks) of
the component, PEFT naming, random weights; ``weights``: every parameter of the component, same shapes,
random values. The tensors are made in this process (CPU, the model's dtype) before the clock starts.
Each round: ``update_*`` (the call returns once every worker applied the update), then one job at the
smallest size and 1 step whose record must carry the new version; reported are the call alone and the
call plus that job (its own compute measured alone at the end, so the difference is the update's share), and of
the call, the client's pack (its memfds written and sealed: ``pack_s``). ``--parts N`` caps the memfds one update
is written into (the client's default is ``ipc.updates.MAX_PARTS``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from diffusiond.bench.procs import process, wait_ready
from diffusiond.client import AsyncClient
from diffusiond.client import weights as client_weights
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.modelcache import BUILT_FOLDERS
from diffusiond.pipelines.preset_tables import get_preset
from diffusiond.pipelines.presets import build_part

_ATTN = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def lora_state(component: torch.nn.Module, prefix: str, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, mod in component.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.endswith(_ATTN):
            out[f"{prefix}.{name}.lora_A.weight"] = torch.randn(rank, mod.in_features, dtype=dtype) * 0.01
            out[f"{prefix}.{name}.lora_B.weight"] = torch.randn(mod.out_features, rank, dtype=dtype) * 0.01
    return out


def full_state(component: torch.nn.Module, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Drawn in place (``normal_``: ``randn(...) * 0.02`` made each tensor twice), on the GPU where there is one
    (SDXL's UNet three times over took minutes of a CPU before the daemon even started: issue 29), then held on
    the CPU as a trainer's copy would be."""
    return {name: torch.empty(p.shape, dtype=dtype, device=device).normal_(0, 0.02).cpu() for name, p in
            component.state_dict().items() if p.is_floating_point()}


def say(what: str, since: float) -> float:
    """One phase done, with its seconds, on stderr at once: a run cut short by a timeout leaves its trail."""
    now = time.perf_counter()
    print(f"bench_live: {what} in {now - since:.1f} s", file=sys.stderr, flush=True)
    return now


async def job(c: AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    h = await c.submit("a lighthouse", **body)
    done = await h.wait()
    if done["status"] != "succeeded":
        raise SystemExit(f"job ended {done['status']}: {done.get('error')}")
    return done


_packs: list[float] = []
_pack = client_weights.pack


def _timed_pack(state_dict: Any) -> Any:
    """The client's pack, its seconds kept: the share of the call spent before anything reaches the daemon."""
    t0 = time.perf_counter()
    try:
        return _pack(state_dict)
    finally:
        _packs.append(time.perf_counter() - t0)


async def drive(sock: Path, args: argparse.Namespace, states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    client_weights.pack = _timed_pack  # update_lora and update_weights look it up as they run
    body: dict[str, Any] = {"size": args.size, "steps": 1, "output_format": "npy"}
    calls, to_job = [], []
    async with AsyncClient(str(sock), timeout=900) as c:
        t = time.perf_counter()
        await job(c, body)  # the model is loaded and warm
        say("first job (the model loaded and warm)", t)
        for i, state in enumerate(states):
            run_body = dict(body, loras=[(args.name, 1.0)]) if args.kind == "lora" else body
            print(f"bench_live: round {i}: update_{args.kind}...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            if args.kind == "lora":
                version = await c.update_lora(args.name, state)
            else:
                version = await c.update_weights("m", args.component, state)
            t1 = time.perf_counter()
            done = await job(c, run_body)
            t2 = time.perf_counter()
            seen = done.get("lora_versions" if args.kind == "lora" else "weight_versions")
            print(f"round {i}: version {version}, call {t1 - t0:.3f} s (pack {_packs[-1]:.3f} s), to first job done "
                  f"{t2 - t0:.3f} s, job says {seen}", file=sys.stderr, flush=True)
            if i:  # round 0 makes the adapter (PEFT layers injected): reported apart
                calls.append(t1 - t0)
                to_job.append(t2 - t0)
            else:
                first = {"call_s": t1 - t0, "to_job_s": t2 - t0}
        alone = []
        for _ in range(3):
            t0 = time.perf_counter()
            await job(c, dict(body, loras=[(args.name, 1.0)]) if args.kind == "lora" else body)
            alone.append(time.perf_counter() - t0)
    return {"first_round": first, "call_s": calls, "to_job_s": to_job, "pack_s": _packs[1:],
            "pack_s_median": statistics.median(_packs[1:]), "call_s_median": statistics.median(calls),
            "to_job_s_median": statistics.median(to_job), "job_alone_s_median": statistics.median(alone)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("lora", "weights"))
    ap.add_argument("--preset", required=True)
    ap.add_argument("--component", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", default="256x256")
    ap.add_argument("--name", default="trainer")
    ap.add_argument("--serve-extra", default="")
    ap.add_argument("--parts", type=int, default=client_weights.MAX_PARTS,
                    help="the most memfds the client writes an update into (1..MAX_PARTS)")
    ap.add_argument("--device", default="cuda", help="the daemon's --device (cpu: a dry run with a small preset)")
    ap.add_argument("--stacks-every", type=float, default=0.0,
                    help="every N seconds, every thread's stack on stderr (faulthandler): where a slow run is")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2: round 0 (the adapter made, the first copy) is reported apart")
    if not 1 <= args.parts <= client_weights.MAX_PARTS:
        ap.error(f"--parts must be 1 to {client_weights.MAX_PARTS}")
    client_weights._MAX_PARTS = args.parts
    if args.stacks_every > 0:
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True, file=sys.stderr)
    dtype = getattr(torch, args.dtype)
    if args.preset in BUILT_FOLDERS:  # a model built in code (tiny): served as is, its component loaded here
        spec = args.preset
        component = load_pipeline(args.preset, device="cpu", dtype="float32").pipe.components[args.component]
    else:
        spec = f"random:{args.preset},save=0"
        component = build_part(get_preset(args.preset).parts[args.component], "meta")
    t0 = time.perf_counter()
    if args.kind == "lora":
        states = [lora_state(component, args.component, args.rank, dtype) for _ in range(args.rounds)]
    else:
        states = [full_state(component, dtype, args.device) for _ in range(args.rounds)]
    made = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
    t = say(f"made {args.rounds} states of {len(states[0])} tensors, {nbytes / 2**30:.2f} GiB each", t0)
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        sock = Path(tmp) / "d.sock"
        log = Path(tmp) / "serve.log"
        argv = [sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--no-persist",
                "--model", f"m={spec}", "--device", args.device, "--dtype", args.dtype,
                "--workers", "1", *shlex.split(args.serve_extra)]
        with process(argv, log) as proc:
            try:
                wait_ready(proc, sock, log, "diffusiond", 900)
                say("daemon ready", t)
                result = asyncio.run(drive(sock, args, states))
            except BaseException:
                print(log.read_text()[-3000:], file=sys.stderr)
                raise
            # the worker's line per update names where its share went (mapped, checked, copied)
            result["worker_phases"] = [line.split("diffusiond.worker: ", 1)[-1].strip() for line in
                                       log.read_text().splitlines() if f"update_{args.kind} " in line]
            print("\n".join(result["worker_phases"]), file=sys.stderr)
    copy = os.environ.get("DIFFUSIOND_UPDATE_COPY", "staged")
    print(json.dumps({"kind": args.kind, "update_copy": copy, "parts": args.parts, "preset": args.preset,
                      "component": args.component,
                      "rank": args.rank,
                      "dtype": args.dtype, "tensors": len(states[0]), "bytes": nbytes, "made_s": made, **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
