"""Where an update's time goes on this machine's CPU, in the pieces the GPU benchmarks cannot split (issue 29).

    python scripts/bench_update_phases.py weights   # SD 1.5's UNet (1.6 GB fp16), a CPU daemon, three rounds
    python scripts/bench_update_phases.py lora      # a rank-64 adapter of FLUX.1-dev's shapes, in process

``weights``: one daemon serves ``random:sd15`` on the CPU; each round times the client's pack (its memfds written
and sealed) apart from the send and the answer (the engine, the worker's copy and the reply), and the worker's
own line says how long its copy took. What is left of the send and answer beyond that copy is the engine's.
``lora``: the worker's read of the adapter out of its memfds and its check-and-apply, in this process, on a
FLUX-architecture transformer with FLUX.1-dev's 57 blocks at tiny widths (so its 532 tensors, the count the
GPU figure has), rounds after the first (which makes the adapter). Prints one line per round.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_live import full_state, lora_state

from diffusiond.bench.procs import process, wait_ready
from diffusiond.client import AsyncClient
from diffusiond.client import weights as client_weights
from diffusiond.ipc.messages import UpdateLora, UpdateWeights


def weights(rounds: int) -> None:
    from diffusiond.pipelines.preset_tables import get_preset
    from diffusiond.pipelines.presets import build_part

    unet = build_part(get_preset("sd15").parts["unet"], "meta")
    states = [full_state(unet, torch.float16, "cpu") for _ in range(rounds)]
    with tempfile.TemporaryDirectory() as tmp:
        sock, log = Path(tmp) / "d.sock", Path(tmp) / "serve.log"
        argv = [sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--no-persist", "--model",
                "m=random:sd15,save=0", "--device", "cpu", "--dtype", "float16", "--workers", "1"]
        with process(argv, log) as proc:
            wait_ready(proc, sock, log, "diffusiond", 900)

            async def first() -> None:  # the model loaded and its worker idle before the first update
                async with AsyncClient(str(sock), timeout=900) as c:
                    await (await c.submit("x", size="64x64", steps=1, output_format="npy")).wait()

            asyncio.run(first())
            for i, state in enumerate(states):
                t0 = time.perf_counter()
                fds, tensors = client_weights.pack(state)
                t1 = time.perf_counter()
                client_weights._send(str(sock), UpdateWeights("m", "unet", tensors), fds, "update", 600)
                print(f"round {i}: pack {t1 - t0:.3f} s, send and answer {time.perf_counter() - t1:.3f} s",
                      flush=True)
            time.sleep(0.5)
            print("\n".join(line.split("diffusiond.worker: ", 1)[-1] for line in log.read_text().splitlines()
                            if "update_weights m/unet" in line))


def lora(rounds: int) -> None:
    from diffusers import FluxTransformer2DModel

    from diffusiond.pipelines import load_pipeline
    from diffusiond.pipelines.hotswap import adapters_for
    from diffusiond.pipelines.tiny_flux import TRANSFORMER
    from diffusiond.worker.weights import apply_update, read_tensors

    pipe = load_pipeline("tiny-flux", name="m", device="cpu", dtype="float32")
    big = FluxTransformer2DModel(**{**TRANSFORMER, "num_layers": 19, "num_single_layers": 38})
    pipe.pipe.register_modules(transformer=big)
    states = [lora_state(big, "transformer", 64, torch.float32) for _ in range(rounds + 1)]  # before the adapter
    adapters = adapters_for(pipe, {}, 2)  # wraps the layers lora_state looks for
    assert adapters is not None
    for i, state in enumerate(states):
        fds, tensors = client_weights.pack(state)
        msg = UpdateLora("trainer", tensors, i + 1)
        t0 = time.perf_counter()
        read = read_tensors(msg, fds)
        t1 = time.perf_counter()
        why = apply_update(adapters, "m", msg, read)
        t2 = time.perf_counter()
        print(f"round {i}{' (makes the adapter)' if not i else ''}: {len(read)} tensors, read "
              f"{1000 * (t1 - t0):.1f} ms, checked and applied {1000 * (t2 - t1):.1f} ms{f': {why}' if why else ''}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("weights", "lora"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    (weights if args.kind == "weights" else lora)(args.rounds)


if __name__ == "__main__":
    main()
