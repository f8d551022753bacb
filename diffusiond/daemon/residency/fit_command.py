"""``diffusiond fit SPEC``: which configurations of a model fit a device, before anything is loaded.

A user with a 24 GB card and a 34 GB model wants to know whether it runs, and how, without a load that
fails after minutes. The arithmetic is ``daemon/residency/fit.py``'s, over the files' headers (safetensors,
GGUF), and the daemon's ``offload=auto`` takes the same list's first exact entry; this module only prints
it. No torch or numpy (tests/test_cli_imports.py): the headers are read with the standard library.

It lives beside the arithmetic rather than in ``commands/`` because it is no client of a daemon: it reads
files as the engine's residency does, and ``commands/`` may reach the daemon only through the client
(tests/test_layout.py). ``cli.py`` dispatches to it lazily, as it does to ``serve``.

Exit codes: 0 when a configuration fits (or no budget was given: then it only lists), 1 when none fits (the
list of what each needed is printed), 2 when the spec cannot be sized (no files, a corrupt header).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from diffusiond.daemon.residency.budget import resolve
from diffusiond.daemon.residency.fit import choose_offload, fit, tried
from diffusiond.daemon.residency.sizes import WeightsError, default_dtype
from diffusiond.daemon.residency.units import format_bytes, parse_size
from diffusiond.daemon.residency.working import Shape
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import not_a_model_file

MIN_SIDE, MAX_SIDE = 8, 16384
"""The sides ``--size`` takes: a latent's least, and four times the daemon's default request limit (the
daemon's own is its configuration's ``limits.max_size``, which this command does not read)."""
MAX_BATCH = 256  # a bound on the estimate's input, as MAX_SIDE is: an estimate past it is past any device
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2  # commands/__init__.py's codes (the daemon may not import them)


def _size(text: str, flag: str) -> int:
    size = parse_size(text)
    if size.nbytes is None:
        raise ValueError(f"{flag} {text!r}: give bytes (24GiB, 20G, 8000000000), not a share of the device")
    return size.nbytes


def _shape(text: str, batch: str = "1") -> Shape:
    """``--size`` and ``--batch``, within what any model makes: a side past ``MAX_SIDE`` gives an estimate past
    any device, as a batch past ``MAX_BATCH`` does."""
    w, x, h = text.partition("x")
    if not (x and w.isascii() and w.isdigit() and h.isascii() and h.isdigit()):
        raise ValueError(f"--size {text!r}: expected WxH, e.g. 1024x1024")
    if not (MIN_SIDE <= int(w) <= MAX_SIDE and MIN_SIDE <= int(h) <= MAX_SIDE):
        raise ValueError(f"--size {text!r}: width and height must each be {MIN_SIDE} to {MAX_SIDE} pixels")
    if not (batch.isascii() and batch.isdigit() and 1 <= int(batch) <= MAX_BATCH):
        raise ValueError(f"--batch {batch[:40]!r}: give a whole number of images from 1 to {MAX_BATCH}")
    return Shape(int(w), int(h), int(batch))


def _check_file(spec: str) -> None:
    """A file that is no model file (``fit /etc/passwd``) is said to be one, not to be missing."""
    head = Path(spec.partition(",")[0]).expanduser()
    if head.is_file() and head.suffix.lower() not in (".safetensors", ".gguf"):
        raise ValueError(not_a_model_file(spec, "fit can size"))


def run(args: argparse.Namespace) -> int:
    dtype = args.dtype or default_dtype(args.device)  # serve's default for that device
    try:
        device = "cpu" if args.device == "cpu" else "cuda:0"  # a share is of the device serve would use
        budget = resolve(args.device_memory, None, device).nbytes if args.device_memory else None
        working = _size(args.working, "--working") if args.working is not None else None
        shape = _shape(args.size, args.batch)
        _check_file(args.spec)
        report = fit(args.spec, dtype=dtype, budget=budget, working=working, shape=shape, on_cpu=args.device == "cpu")
    except (WeightsError, PipelineError, ValueError) as exc:
        print(f"diffusiond fit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    at, rows, notes = report.components, report.configurations, report.notes
    chosen, why = choose_offload(report)
    fitting = report.fitting
    if args.json:
        print(json.dumps({"spec": args.spec, "dtype": dtype, "budget": budget, "components": at,
                          "configurations": [asdict(c) | {"needs": c.needs} for c in rows],
                          "fits": bool(fitting), "auto": chosen if fitting else None, "notes": list(notes)}))
    else:
        total = sum(at.values())
        print(f"{args.spec}: {format_bytes(total)} of weights at {dtype} "
              f"({', '.join(f'{k} {format_bytes(v)}' for k, v in at.items())})"
              + (f"; budget {format_bytes(budget)}" if budget is not None else ""))
        keys = ["config", "option", "on device", "working", "in host", "fits", "approximations"]
        cells = [keys] + [[c.name, c.option, format_bytes(c.device_bytes), format_bytes(c.working_bytes),
                           format_bytes(c.host_bytes), "-" if c.fits is None else "yes" if c.fits else "no",
                           ",".join(c.approximations) or "-"] for c in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(keys))]
        print("\n".join("  ".join(v.ljust(wd) for v, wd in zip(r, widths, strict=True)).rstrip() for r in cells))
        for c in rows:
            if c.resident_blocks is not None:  # how many blocks stay: what the daemon would set resident_blocks to
                print(f"{c.name}: {c.note}")
        for note in notes:
            print(f"note: {note}")
        if budget is not None and fitting:
            where = "" if shape == Shape(1024, 1024) else (
                f" (at {shape}; the daemon's offload=auto chooses at its 1024x1024, batch 1 estimate)")
            print(f"offload=auto would run it with {why}{where}")
    if budget is not None and not fitting:
        print(f"diffusiond fit: nothing fits {format_bytes(budget)}: {tried(report)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
