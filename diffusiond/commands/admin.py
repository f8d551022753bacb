"""The commands that ask a daemon about itself or tell it one thing: status, models, history,
cancel, sleep, wake, web-url.

Each is ``async def command(args, client) -> exit code`` over ``AsyncClient``, so ``cli.py`` runs
them all the same way and maps the client's exceptions to exit codes in one place.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from diffusiond.client import AsyncClient, ClientTimeout, DaemonError, DaemonUnreachable
from diffusiond.commands import EXIT_FAILED, EXIT_OK


def table(rows: list[list[str]], headers: list[str]) -> str:
    cells = [headers, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def size(n: object) -> str:
    """Bytes in the largest unit that keeps a whole number in front (``1.5 GiB``, not ``1536.0 MiB``); ``-``
    for none, or for a field a daemon did not send."""
    if not isinstance(n, int | float) or not n:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def took(answer: dict[str, Any]) -> str:
    """How long a move or a sleep took, as the daemon measured it (``took_ms``)."""
    ms = answer.get("took_ms")
    return f" (took {ms / 1000:.1f} s)" if isinstance(ms, int | float) else ""


async def _until_ready(client: AsyncClient, seconds: float) -> None:
    """``status --wait``: until the daemon is up and admitting, asked from this one process. A script that
    starts a daemon otherwise polls with a new ``status`` process each time, each one an interpreter's
    start (0.6 CPU-seconds here), which slows the very start it waits for on a small machine."""
    deadline = time.monotonic() + seconds
    while True:
        try:  # each ask within the time left (the last one gets a moment): a silent daemon is not up yet
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                if await client.ready():
                    return
        except DaemonUnreachable:
            if time.monotonic() >= deadline:
                raise
        except TimeoutError as exc:  # the client's own ClientTimeout too
            if time.monotonic() >= deadline:
                raise ClientTimeout(client.socket_path, "waiting for the daemon to be ready", seconds) from exc
        if time.monotonic() >= deadline:
            return  # up but not ready: the report below says so, and the exit code is 0 as without --wait
        await asyncio.sleep(0.2)


async def status(args: argparse.Namespace, client: AsyncClient) -> int:
    """The health report in words. /health counts the jobs this daemon process holds in memory: a finished
    one leaves after serve's --retention-s (and none survives a restart), so in one run the counts go down
    while history keeps them all. The line says what it counts, and points at history when it lists more
    ("jobs in this run", "earlier ones" read as the whole run and an earlier one)."""
    async with client:
        if args.wait:
            await _until_ready(client, args.wait)
        health = await client.health()
        ready = await client.ready()
        kept = False if args.json else await _history_kept(client, sum(
            v for v in (health.get("jobs") or {}).values() if isinstance(v, int)))
    if args.json:
        print(json.dumps({**health, "ready": ready}))
        return EXIT_OK
    state = f"{health.get('status', '?')}, {'ready' if ready else 'not ready'}"
    if health.get("sleeping"):
        state += ", sleeping"
    preload = health.get("preload") or {}
    if preload.get("state") == "running":  # ready means admitting (issue 27): say what is not loaded yet
        state += f", preloading {', '.join(preload.get('models') or []) or 'models'}"
    print(f"diffusiond {health.get('version', '?')} at {client.socket_path}: {state}")
    workers = health.get("workers") or []
    if workers:
        keys = ["id", "model", "device", "state", "pid", "restarts"]
        # a starting worker has no pid yet: JSON null, not "None"
        print(table([["-" if w.get(k) is None else str(w[k]) for k in keys] for w in workers], keys))
    else:
        print("no workers")
    print(f"queue depth: {health.get('queue_depth', '?')}")
    jobs = health.get("jobs") or {}
    line = "jobs in memory: " + (", ".join(f"{k}={v}" for k, v in jobs.items() if v) or "none")
    print(line + ("; `diffusiond history` lists more (a finished job leaves memory after serve's --retention-s, "
                  "600 s by default, and at a restart)" if kept else ""))
    if "arena_bytes_in_use" in health:
        print(f"arena in use: {size(health['arena_bytes_in_use'])}")
    return EXIT_OK


async def _history_kept(client: AsyncClient, held: int) -> bool:
    """Whether history lists more jobs than the ``held`` this process has in memory (its newest): ones past
    --retention-s, or from before a restart. A daemon without a history endpoint (an older one) has none to
    show; past a page's bound (1,000) it is not worth the pages to tell."""
    if held >= 1000:
        return False
    try:
        page = await client.history(limit=max(1, held))
    except DaemonError:
        return False
    return bool(page.get("next_before")) if held else bool(page.get("data"))


async def models(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        models = await client.models()
    if args.json:
        print(json.dumps(models))
        return EXIT_OK
    keys = ["id", "task", "device", "state", "offload"]
    data = models.get("data") or []
    # ``defaults`` is null until the model has loaded once (or was remembered): its edits are not known either
    rows = [[str(m.get(k) or "-") for k in keys] + [
        (",".join(m.get("edits") or []) or "-") if m.get("defaults") else "?", _defaults(m.get("defaults")),
        ",".join(m.get("approximations") or []) or "-"] for m in data]
    print(table(*with_attention(rows, [*keys, "edits", "defaults", "approximations"], data)))
    if any(not m.get("defaults") for m in data):
        print("?: not known until the model has loaded once")
    return EXIT_OK


def _defaults(d: dict[str, Any] | None) -> str:
    """What a request that leaves them out gets (generate's --size, --steps, --guidance, --frames, --fps)."""
    if not d:
        return "?"
    video = f", {d['num_frames']} frames at {d['fps']} fps" if "num_frames" in d else ""
    return f"{d.get('width')}x{d.get('height')}, {d.get('steps')} steps, guidance {d.get('guidance_scale'):g}{video}"


def with_attention(rows: list[list[str]], headers: list[str],
                   models: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """The table with an ``attention`` column before its last (approximations), when a model runs another
    attention backend than the default (``attention=`` model option): its outputs then differ from the
    default's, by rounding for an exact kernel, more for SageAttention. Left out when none does."""
    if not any(m.get("attention") for m in models):
        return rows, headers
    cells = [str(m.get("attention") or "-") for m in models]
    return ([[*r[:-1], c, r[-1]] for r, c in zip(rows, cells, strict=True)],
            [*headers[:-1], "attention", headers[-1]])


async def cancel(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        try:
            job = await client.cancel(args.job_id)
        except DaemonError as exc:
            if exc.status != 409:
                raise
            try:
                status = (await client.job(args.job_id)).get("status", "finished")
            except DaemonError:
                status = "finished"
            print(f"job {args.job_id} already finished ({status})", file=sys.stderr)
            return EXIT_FAILED
    print(f"job {job.get('id', args.job_id)} {job.get('status', 'cancelled')}")
    return EXIT_OK


async def history(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        page = await client.history(status=args.status, model=args.model, before=args.before, limit=args.limit)
        unserved = None if args.json or page.get("data") or not args.model else await _unserved(client, args.model)
    if args.json:
        print(json.dumps(page))
        return EXIT_OK
    keys = ["id", "created", "model", "status", "outputs", "attempts", "prompt"]
    rows = [[j.get("id", ""), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.get("created", 0))),
             j.get("model", ""), _status(j),
             str(len(j.get("outputs") or [])), str(j.get("attempts", 1)), _clip(j.get("request", {}).get("prompt", ""))]
            for j in page.get("data") or []]
    print(table(rows, keys) if rows else "no jobs" + (f" ({unserved})" if unserved else ""))
    if page.get("next_before"):
        print(f"more: diffusiond history --before {page['next_before']}")
    return EXIT_OK


async def _unserved(client: AsyncClient, model: str) -> str | None:
    """Why ``history --model NAME`` may be empty: NAME is not served now (a typo, most likely; every other command
    refuses it). Only a hint: history rightly lists an earlier run's model, so no refusal."""
    try:
        served = [str(m.get("id")) for m in (await client.models()).get("data") or []]
    except DaemonError:
        return None
    if model in served:
        return None
    return f"{model!r} is not served now (models: {', '.join(served)}); its jobs from earlier runs would be listed here"


def _status(job: dict[str, Any]) -> str:
    """``failed (deadline_exceeded)``; the error's code only where it says more than the status
    (a cancelled job's code is ``cancelled``)."""
    status = str(job.get("status", ""))
    err = job.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    return f"{status} ({code})" if code and code != status else status


def _clip(text: str, width: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


async def sleep(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        answer = await client.sleep(args.level)
    print(asleep_line(answer, args.level))
    return EXIT_OK


def asleep_line(answer: dict[str, Any], asked: int) -> str:
    """What the sleep did, from where the daemon says each model is now: on a CPU device a level-1 sleep
    moves nothing (its memory is the host's), and a line saying "device memory freed" would be false."""
    level = answer.get("level", asked)
    head = f"daemon asleep at level {level}{took(answer)}"
    if level != asked:
        head += f" (level {level} was in force already)"
    models = answer.get("models")
    if not isinstance(models, dict):  # a daemon from before the answer named them
        return f"{head}; `diffusiond wake` takes it back"
    by: dict[str, list[str]] = {}
    for name, m in models.items():
        where = m.get("residency") if isinstance(m, dict) else None
        key = "cpu" if where in ("device", "loading") and str(m.get("device", "")).startswith("cpu") else where
        by.setdefault(str(key), []).append(name)
    parts = []
    if by.get("host"):
        parts.append(f"device memory freed: {', '.join(by['host'])} in host memory (a wake copies it back)")
    if by.get("disk"):
        parts.append(f"{', '.join(by['disk'])} on disk, no worker left (a wake loads from the files)")
    if by.get("cpu"):
        parts.append(f"nothing freed for {', '.join(by['cpu'])}: on a CPU the weights are in host memory "
                     "already (`diffusiond sleep --level 2` stops its workers)")
    busy = [n for k, names in by.items() if k not in ("host", "disk", "cpu") for n in names]
    stayed = answer.get("stayed")
    stayed = stayed if isinstance(stayed, dict) else {}  # a daemon from before the answer said why
    for n in busy:
        parts.append(f"{n} still on its device ({stayed.get(n) or 'still busy when the drain ended'})")
    return f"{head}: {'; '.join(parts) or 'no model'}; `diffusiond wake` takes it back"


async def wake(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        answer = await client.wake()
    print(f"daemon awake{took(answer)}")
    return EXIT_OK


async def web_url(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:  # a daemon without --web: DaemonError 404 web_off, printed by _main (exit 1)
        url = await client.web_url()
    print(url)
    return EXIT_OK
