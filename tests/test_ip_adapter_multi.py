"""Several IP-Adapters in one request, end to end: a real daemon on ``tiny`` with two adapters built in code.

``style`` is ipadapterkit.py's adapter; ``grain`` another one with its own image encoder, of another
embedding width (8, not 16), so the two cannot share an encoder: the worker encodes each picture
with its own adapter's. Refusals of entries among several: test_ip_adapter.py. Outputs are compared
as raw float32 ``npy`` bytes, so "equal" means bit for bit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, http, shared_daemon, submit, wait_job
from ipadapterkit import build_ip_adapter, entry, output

FAST = {"model": "tiny", "width": 64, "height": 64, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy", "output_dtype": "float32"}  # float: tiny's uint8 pictures saturate


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, ip_adapter_file: Path) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("ip-multi-daemon")
    grain = build_ip_adapter(root / "grain", seed=5, projection_dim=8)
    args = ["--model", "tiny", "--workers", "1", "--max-batch", "4", "--batch-wait-ms", "400", "--job-timeout", "300",
            "--ip-adapter", f"style={ip_adapter_file}", "--ip-adapter", f"grain={grain}"]
    d: Daemon
    with shared_daemon(root, args, model_cache) as d:
        yield d.socket


async def run(s: aiohttp.ClientSession, *entries: dict[str, Any], **extra: Any) -> bytes:
    return await output(s, FAST, *entries, **extra)


async def test_two_adapters_steer_together_and_at_scale_zero_give_the_plain_output(sock: Path) -> None:
    async with http(sock) as s:
        plain = await run(s)
        style = await run(s, entry("style", 1))
        grain = await run(s, entry("grain", 2))
        both = await run(s, entry("style", 1), entry("grain", 2))
        again = await run(s, entry("style", 1), entry("grain", 2))  # the set is still loaded
        zero = await run(s, entry("style", 1, 0.0), entry("grain", 2, 0.0))
        twice = await run(s, entry("style", 1), entry("style", 3))  # one adapter, two pictures
        after = await run(s)
        no_cfg = [await run(s, *e, guidance_scale=1.0) for e in ([], [entry("style", 1), entry("grain", 2)])]
    assert len({plain, style, grain, both}) == 4, "an adapter of the pair changed nothing"
    assert again == both
    assert zero == plain  # each IP attention is added times its scale: 0 adds exact zeros
    assert twice not in (plain, style, both)
    assert after == plain  # both came out of the UNet
    assert no_cfg[1] != no_cfg[0]  # without guidance the embeddings have no negative half, and still act


async def test_requests_with_different_sets_or_orders_at_once_are_not_batched_together(sock: Path) -> None:
    """Sent in the same moment to a worker that batches for 400 ms: each output equals its solo run."""
    sets = [[entry("style", 1), entry("grain", 2)], [entry("grain", 2), entry("style", 1)],
            [entry("style", 1), entry("grain", 2, 0.5)], [entry("style", 1), entry("grain", 4)],
            [entry("style", 1)], []]
    async with http(sock) as s:
        solo = [await run(s, *e) for e in sets]
        together = await asyncio.gather(*(run(s, *e) for e in sets))
        jobs = [await wait_job(s, (await submit(s, {**FAST, "ip_adapter": e}))["id"]) for e in sets[:2]]
    assert list(together) == solo
    assert len({solo[0], *solo[2:]}) == 5
    recorded = [[(e["name"], e["scale"]) for e in j["request"]["ip_adapter"]] for j in jobs]
    assert recorded == [[("style", 1.0), ("grain", 1.0)], [("grain", 1.0), ("style", 1.0)]]
