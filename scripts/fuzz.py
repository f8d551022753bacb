#!/usr/bin/env python3
"""The long fuzzing run (issue 26): tests/fuzzkit.py's families, hundreds of thousands of inputs,
against a daemon this script starts (tiny, two LoRAs built in code, ``--input-dir``, ``--web`` on
127.0.0.1) or one given by ``--socket`` (its web listener found over the socket, or ``--web URL``).

The suite runs a few dozen inputs per family; defects that need a rare combination (a mutated
header in one format, a field name that is not UTF-8 next to a huge field) show up only in runs
this long. The figures it prints (inputs per surface, answers by status, 5xx count) are the ones
docs/reliability.md quotes, so they are counted exactly: every input once, under its surface and
its answer (``error:...`` when there was no answer at all).

    scripts/fuzz.py                       # 250,000 inputs, 4 processes, a daemon of its own
    scripts/fuzz.py -n 5000 --surfaces urls,web_auth --out summary.json --examples bad.json
    scripts/fuzz.py --socket /run/diffusiond/diffusiond.sock --input-dir /srv/inputs

Several processes each run Hypothesis's generation on their own surface and seed and send as they
draw, one connection per request: the daemon sees ``--jobs`` connections at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import fuzzkit  # noqa: E402
from fuzzkit import Ctx, Target  # noqa: E402

CHUNK = 200  # inputs per task: small enough that progress moves, large enough to amortize set-up
KEEP_EXAMPLES = 50  # 5xx (and other oracle failures) saved with their inputs
KEEP_PER_CAUSE = 3


def _cause(surface: str, status: int | str, body: bytes) -> str:
    return f"{surface} {status} {body[:80]!r}"


def run_chunk(ctx: Ctx, surface: str, n: int, seed: int) -> dict[str, Any]:
    """Draw up to ``n`` inputs of one surface with Hypothesis and send each; the tally of what came back."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    strategy = fuzzkit.strategies(ctx)[surface]
    tally: dict[str, Any] = {"surface": surface, "inputs": 0, "status": Counter(), "problems": 0, "examples": [],
                             "causes": Counter(), "slowest_s": 0.0}

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(req=strategy)
    def one(req: fuzzkit.Req) -> None:
        if tally["inputs"] >= n:
            return
        tally["inputs"] += 1
        try:
            ans = fuzzkit.send(ctx.target, req)
        except Exception as exc:  # no answer at all: counted, and kept as an example
            key = f"error:{type(exc).__name__}"
            tally["status"][key] += 1
            tally["problems"] += 1
            _keep(tally, req, key, repr(exc).encode(), [f"no answer: {exc!r}"])
            return
        tally["status"][str(ans.status)] += 1
        tally["slowest_s"] = max(tally["slowest_s"], ans.elapsed_s)
        found = fuzzkit.problems(req, ans)
        if found:
            tally["problems"] += 1
            _keep(tally, req, ans.status, ans.body, found)
        with contextlib.suppress(Exception):
            fuzzkit.cleanup(ctx.target, req, ans)

    one()
    sick = fuzzkit.health_problem(ctx.target)
    tally["health"] = sick
    tally["status"] = dict(tally["status"])
    tally["causes"] = dict(tally["causes"])
    return tally


def _keep(tally: dict[str, Any], req: fuzzkit.Req, status: int | str, body: bytes, found: list[str]) -> None:
    cause = _cause(req.surface, status, body)
    tally["causes"][cause] += 1
    if tally["causes"][cause] <= KEEP_PER_CAUSE and len(tally["examples"]) < KEEP_EXAMPLES:
        tally["examples"].append({"surface": req.surface, "input": req.describe(), "status": status,
                                  "answer": body[:1000].decode(errors="replace"), "problems": found})


def run(ctx: Ctx, total: int, *, jobs: int = 4, seed: int = 0, surfaces: list[str] | None = None,
        examples_path: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Fuzz ``total`` inputs spread evenly over ``surfaces`` (default: all that apply) with
    ``jobs`` processes; returns the summary (and writes the kept examples to ``examples_path``)."""
    names = surfaces or list(fuzzkit.strategies(ctx))
    quota = {s: total // len(names) + (1 if i < total % len(names) else 0) for i, s in enumerate(names)}
    done = dict.fromkeys(names, 0)
    planned = dict.fromkeys(names, 0)
    exhausted: set[str] = set()  # Hypothesis drew fewer than asked: it has no more distinct inputs there
    summary: dict[str, Any] = {"inputs": 0, "5xx": 0, "problems": 0, "jobs": jobs, "seed": seed,
                               "surfaces": {s: {"inputs": 0, "status": {}, "problems": 0, "slowest_s": 0.0}
                                            for s in names}, "health": [], "causes": {}}
    examples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    next_seed = seed * 1_000_003

    def todo() -> str | None:
        open_ = [s for s in names if planned[s] < quota[s] and s not in exhausted]
        return min(open_, key=lambda s: planned[s] / quota[s]) if open_ else None

    def move_quota(s: str) -> None:
        """An exhausted surface's remaining inputs go to the others, so the total is what was asked."""
        spare, quota[s] = quota[s] - planned[s], planned[s]
        others = [o for o in names if o not in exhausted] or []
        for i, o in enumerate(others):
            quota[o] += spare // len(others) + (1 if i < spare % len(others) else 0)

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        running: dict[Future[dict[str, Any]], tuple[str, int]] = {}
        while True:
            while len(running) < jobs * 2 and (s := todo()) is not None:
                n = min(CHUNK, quota[s] - planned[s])
                planned[s] += n
                next_seed += 1
                running[pool.submit(run_chunk, ctx, s, n, next_seed)] = (s, n)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                s, n = running.pop(fut)
                tally = fut.result()
                got = tally["inputs"]
                planned[s] -= n - got  # short chunks are planned again
                if got < n and s not in exhausted:
                    exhausted.add(s)
                    move_quota(s)
                done[s] += got
                entry = summary["surfaces"][s]
                entry["inputs"] += got
                entry["problems"] += tally["problems"]
                entry["slowest_s"] = max(entry["slowest_s"], round(tally["slowest_s"], 3))
                for code, c in tally["status"].items():
                    entry["status"][code] = entry["status"].get(code, 0) + c
                for cause, c in tally["causes"].items():
                    summary["causes"][cause] = summary["causes"].get(cause, 0) + c
                summary["inputs"] += got
                summary["problems"] += tally["problems"]
                summary["5xx"] += sum(c for code, c in tally["status"].items() if code.startswith("5"))
                if tally["health"]:
                    summary["health"].append(tally["health"])
                examples.extend(tally["examples"][: max(0, KEEP_EXAMPLES - len(examples))])
            if progress:
                rate = summary["inputs"] / max(time.monotonic() - t0, 1e-9)
                print(f"\r{summary['inputs']}/{total} inputs, {summary['5xx']} 5xx, {summary['problems']} problems, "
                      f"{rate:.0f}/s", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    summary["exhausted"] = sorted(exhausted)
    summary["elapsed_s"] = round(time.monotonic() - t0, 1)
    summary["examples_kept"] = len(examples)
    if examples_path is not None:
        examples_path.write_text(json.dumps(examples, indent=1))
    return summary


def _web_from_url(url: str) -> tuple[int, str | None]:
    parts = urlsplit(url)
    if parts.hostname != "127.0.0.1" or parts.port is None:
        raise SystemExit(f"--web must be http://127.0.0.1:PORT/?token=...; this script talks to loopback only: {url}")
    return parts.port, (parse_qs(parts.query).get("token") or [None])[0]


def _external_ctx(args: argparse.Namespace, tmp: Path) -> Ctx:
    plain = Target(args.socket)
    port, token = _web_from_url(args.web) if args.web else (None, None)
    if port is None:
        ans = fuzzkit.request(plain, "GET", "/v1/admin/web")
        if ans.status == 200:
            port, token = _web_from_url(ans.json()["url"])
    target = Target(args.socket, port, token)
    listing = fuzzkit.request(target, "GET", "/v1/loras")
    loras = tuple(e["name"] for e in listing.json()["data"]) if listing.status == 200 else ()
    input_dir = Path(args.input_dir) / "fuzzkit" if args.input_dir else None
    return fuzzkit.make_ctx(target, input_dir, tmp / "crafted-loras", None, loras)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--inputs", type=int, default=250_000)
    p.add_argument("--jobs", type=int, default=4, help="processes, each with its own connection (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--surfaces", help=f"comma-separated, of: {', '.join(fuzzkit.FAMILIES)}")
    p.add_argument("--socket", help="fuzz this running daemon instead of starting one")
    p.add_argument("--web", help="its web listener, as `diffusiond web-url` prints it (127.0.0.1 only)")
    p.add_argument("--input-dir", help="the running daemon's --input-dir: fuzz files go in its fuzzkit/ folder")
    p.add_argument("--out", type=Path, help="write the summary here too (JSON)")
    p.add_argument("--examples", type=Path, default=Path("fuzz-examples.json"),
                   help="the first 5xx and other failures, with their inputs (default fuzz-examples.json)")
    args = p.parse_args(argv)
    surfaces = args.surfaces.split(",") if args.surfaces else None
    unknown = set(surfaces or ()) - set(fuzzkit.FAMILIES)
    if unknown:
        p.error(f"unknown surfaces: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="diffusiond-fuzz-") as tmpdir:
        tmp = Path(tmpdir)
        with contextlib.ExitStack() as stack:
            ctx = _external_ctx(args, tmp) if args.socket else stack.enter_context(own_daemon(tmp))
            print(f"fuzzing {ctx.target.socket}" + (f" and 127.0.0.1:{ctx.target.web_port}" if ctx.target.web_port
                                                     else ""), file=sys.stderr)
            summary = run(ctx, args.inputs, jobs=args.jobs, seed=args.seed, surfaces=surfaces,
                          examples_path=args.examples)
    text = json.dumps(summary, indent=1, sort_keys=True)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if summary["5xx"] or summary["problems"] or summary["health"] else 0


@contextlib.contextmanager
def own_daemon(tmp: Path) -> Any:
    """A daemon set up as the suite's: LoRAs built on tiny, crafted files, the web listener."""
    import os

    from daemonkit import Daemon
    from lorakit import build_lora

    cache = os.environ.get("DIFFUSIOND_CACHE") or str(tmp / "cache")
    os.environ["DIFFUSIOND_CACHE"] = cache
    print("building the LoRAs on tiny...", file=sys.stderr)
    loras = {"ink": build_lora(tmp / "ink", seed=1), "dots": build_lora(tmp / "dots", seed=2, text_encoder=False)}
    args, inputs, crafted = fuzzkit.daemon_args(tmp, loras)
    d = Daemon(tmp / "d.sock", args, tmp / "d.log", env={"DIFFUSIOND_CACHE": cache, "OMP_NUM_THREADS": "1"})
    try:
        d.start()
        port = fuzzkit.web_port_of(Target(str(d.socket)))
        yield fuzzkit.make_ctx(Target(str(d.socket), port, fuzzkit.FUZZ_TOKEN), inputs, crafted, loras["ink"])
    finally:
        d.stop()
        text = d.log_path.read_text(errors="replace")
        kept = Path.cwd() / "fuzz-daemon.log"  # the temp dir goes: a log with tracebacks is worth reading
        if "Traceback" in text:
            kept.write_text(text)
        print(f"daemon log: {len(text)} bytes, {text.count('Traceback')} tracebacks"
              + (f" (kept in {kept})" if "Traceback" in text else ""), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
