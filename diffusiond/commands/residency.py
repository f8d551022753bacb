"""``ps``, ``load`` and ``unload``: what is loaded where, and moving a model by hand.

``ps`` is ``ollama ps`` for this daemon: per model, where its weights are (``device``, ``host``,
``disk``, ``loading``), the bytes on the device and in host memory, until when its keep-alive holds
it, whether it is pinned, its outputs queued and running, and how it is made to fit (its offload mode and
the quantizations among its approximations) and run (its attention backend, where not the default), all
from ``GET /v1/models``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from diffusiond.client import AsyncClient, ClientError
from diffusiond.commands import EXIT_FAILED, EXIT_OK
from diffusiond.commands.admin import size, table, took, with_attention

KEYS = ["name", "device", "residency", "on device", "in host", "until", "pinned", "queued", "running", "offload",
        "approximations"]


def _until(m: dict[str, object]) -> str:
    if m.get("keep_alive_forever"):
        return "forever"
    until = m.get("keep_alive_until")
    if not isinstance(until, int | float):
        return "-"
    left = until - time.time()
    try:
        at = time.strftime('%H:%M:%S', time.localtime(until))
    except (OverflowError, OSError, ValueError):  # past what the C library's clock can name (year 9999 or so)
        return "forever"
    return f"{at} (in {max(0, round(left))} s)"


async def ps(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        models = (await client.models()).get("data") or []
    if args.json:
        print(json.dumps(models))
        return EXIT_OK
    rows = [[str(m.get("id", "")), str(m.get("device", "")), str(m.get("residency", "")),
             size(m.get("device_bytes")), size(m.get("host_bytes")), _until(m), "yes" if m.get("pinned") else "no",
             str(m.get("queued", 0)), str(m.get("running", 0)), str(m.get("offload") or "none"), _approx(m)]
            for m in models]
    print(table(*with_attention(rows, KEYS, models)))
    return EXIT_OK


def _approx(m: dict[str, object]) -> str:
    """Each approximation by its method and what it applies to (``fp8-storage(transformer)``); ``--json``
    and ``diffusiond models`` have the full text (``..., computed in bfloat16``)."""
    names = m.get("approximations")
    if not isinstance(names, list) or not names:
        return "-"
    return ", ".join(str(a).split(",")[0] + (")" if "," in str(a) else "") for a in names)


async def load(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        m = await client.load(args.model)
    print(f"{m.get('id', args.model)}: {m.get('residency')} on {m.get('device')}{took(m)}")
    return EXIT_OK


async def unload(args: argparse.Namespace, client: AsyncClient) -> int:
    async with client:
        names = [str(m["id"]) for m in (await client.models()).get("data") or []] if args.all else [args.model]
        if not args.all:
            return _unloaded(args.model, await client.unload(args.model))
        failed = 0
        for name in names:  # each model on its own: one that fails leaves the others to go
            try:
                _unloaded(name, await client.unload(name))
            except ClientError as exc:
                failed += 1
                print(f"error: {name}: {exc}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _unloaded(name: str, m: dict[str, object]) -> int:
    # with work queued or running, it leaves once that is done (docs/api.md)
    pending = "; unload pending: it leaves once its work is done" if m.get("unload") == "pending" else ""
    print(f"{m.get('id', name)}: {m.get('residency')}{took(m)}{pending}")
    return EXIT_OK
