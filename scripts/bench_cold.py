"""First image from a cold daemon (issue 27's target: <= 6 s plus the image's own compute time).

    python scripts/bench_cold.py --folder DIR [--size 512x512 --steps 20 --dtype float16 --starts 3]
    python scripts/bench_cold.py --model tiny --second synthetic --device cpu --dtype float32 --size 64x64 \
        --steps 2 --preimport on      (issue 27's template: workers forked from it; off: fresh interpreters)

``DIR`` is a diffusers folder on disk (``scripts/bench_presets.py --preset random:sd15 --save 1`` writes
one). Each start: ``diffusiond serve --model sd=DIR`` is spawned, and this process submits one job as soon
as the socket accepts one (polling every 20 ms), waits for it and reads its PNG back; the clock runs from
the spawn to the bytes. Then, on the same warm daemon, the same job three more times: the median is the
image's own compute time. The first start reads the folder from disk (or the page cache, if it was just
written); later starts find the page cache warm, which is what the target assumes. Prints one JSON object.

``--model SPEC`` serves a spec instead of a folder. ``--second SPEC`` serves a second model the start does not
load (``--preload sd``): after the first model's images, one job for it times a load on demand, the case a worker
template speeds up most (issue 27). Each run names every worker's spawn-to-READY from the engine's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diffusiond.bench.procs import process
from diffusiond.client import AsyncClient
from diffusiond.client.errors import DaemonError, DaemonUnreachable


async def first_image(proc: Any, sock: Path, body: dict[str, Any], t_spawn: float,
                      with_second: bool) -> dict[str, float]:
    while not sock.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode} before listening")
        await asyncio.sleep(0.02)
    t_socket = time.perf_counter()
    async with AsyncClient(str(sock), timeout=600) as c:
        while True:
            try:
                job = await c.create_job(body, wait_start_s=0)
                break
            except (DaemonError, DaemonUnreachable):
                if proc.poll() is not None:
                    raise SystemExit(f"the daemon exited with {proc.returncode} before admitting a job") from None
                await asyncio.sleep(0.02)
        t_admitted = time.perf_counter()
        done = await c.wait(job["id"])
        if done["status"] != "succeeded":
            raise SystemExit(f"first job ended {done['status']}: {done.get('error')}")
        png = await c.output(job["id"], 0)
        t_first = time.perf_counter()
        warm = []
        for _ in range(3):
            t0 = time.perf_counter()
            j = await c.create_job(body)
            await c.wait(j["id"])
            await c.output(j["id"], 0)
            warm.append(time.perf_counter() - t0)
        second = {}
        if with_second:
            t0 = time.perf_counter()
            j = await c.create_job({**body, "model": "second"}, wait_start_s=0)
            if (await c.wait(j["id"]))["status"] != "succeeded":
                raise SystemExit("the second model's job failed")
            await c.output(j["id"], 0)
            second = {"second_model_image_s": time.perf_counter() - t0}
    return {**second, "socket_s": t_socket - t_spawn, "admitted_s": t_admitted - t_spawn,
            "first_image_s": t_first - t_spawn,
            "png_bytes": len(png), "warm_image_s": statistics.median(warm),
            "first_minus_compute_s": (t_first - t_spawn) - statistics.median(warm)}


def one_start(args: argparse.Namespace, body: dict[str, Any], state: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        sock = Path(tmp) / "d.sock"
        log = Path(tmp) / "serve.log"
        models = ["--model", f"sd={args.folder or args.model}"]
        if args.second:
            models += ["--model", f"second={args.second}", "--preload", "sd"]
        preimport = ["--preimport", args.preimport] if args.preimport else []
        argv = [sys.executable, "-m", "diffusiond", "serve", "--socket", str(sock), "--state-dir", state,
                *models, "--device", args.device, "--dtype", args.dtype, *preimport, *shlex.split(args.serve_extra)]
        t_spawn = time.perf_counter()
        with process(argv, log) as proc:
            try:
                r: dict[str, Any] = asyncio.run(
                    asyncio.wait_for(first_image(proc, sock, body, t_spawn, bool(args.second)), 120))
            except BaseException:
                print(log.read_text()[-3000:], file=sys.stderr)
                raise
        # where the start went: the engine's listening and ready lines, the worker's phases
        text = log.read_text()
        r["spawn_to_ready_ms"] = {m[1]: float(m[2]) for m in re.finditer(r"ready: (\S+) on \S+ in \d+ ms, (\d+) ms "
                                                                          "after its spawn", text)}
        r["log"] = "".join(f"  {line[:400]}\n" for line in log.read_text().splitlines()
                           if " ready in " in line or "listening on" in line or "ready: admitting" in line)
        return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--folder", help="a diffusers folder")
    what.add_argument("--model", help="a model spec (tiny, synthetic, random:sd15, ...)")
    ap.add_argument("--second", help="a second model's spec, loaded on demand after the first model's images")
    ap.add_argument("--preimport", choices=("auto", "on", "off"), help="serve --preimport (default: serve's)")
    ap.add_argument("--size", default="512x512")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda", help="serve --device (cuda here, where serve defaults to auto)")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--serve-extra", default="", help="more serve arguments, one string")
    args = ap.parse_args()
    body = {"prompt": "a lighthouse at dusk", "size": args.size, "steps": args.steps, "seed": 1,
            "output_format": "png"}
    runs = []
    # One state dir for every start, as a user's daemon has across restarts: from the second start on,
    # the daemon knows the model (its defaults and limits) and admits the first job before it has loaded.
    with tempfile.TemporaryDirectory(prefix="bench-cold-state-") as state:
        for i in range(args.starts):
            r = one_start(args, body, state)
            print(f"start {i}: {r.pop('log')}{r}", file=sys.stderr)
            runs.append(r)
    print(json.dumps({"folder": args.folder, "model": args.model, "second": args.second,
                      "preimport": args.preimport, "device": args.device, "body": body, "runs": runs,
                      "warm_cache_first_minus_compute_s": statistics.median(r["first_minus_compute_s"]
                                                                            for r in runs[1:] or runs)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
