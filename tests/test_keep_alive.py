"""A request's ``keep_alive`` end to end: values past any sane horizon are forever (and ``diffusiond ps``
still prints them), a batch keeps its model for the longest its jobs asked, the Python client, the CLI
and the Ray gateway carry the field, and ``/metrics`` has each model's bytes per tier.

One daemon for the module. ``--max-batch 2`` with a long ``--batch-wait-ms`` makes two jobs submitted
one after the other share a batch (the first waits for the second), so every generation here is a pair;
a lone job would wait the whole batch wait.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, get, http, shared_daemon, submit, until, wait_job

from diffusiond.daemon.core.flights import longest_keep_alive
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.units import FOREVER, HORIZON_S, parse_duration

JOB = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 1, "seed": 3}
HUGE = [1e17, 1e20, 1e308, 10**30, "99999999999h", "9" * 60]


@pytest.mark.parametrize("value", HUGE)
def test_a_keep_alive_past_a_hundred_years_is_forever(value: str | float) -> None:
    assert parse_duration(value) == FOREVER


def test_a_long_keep_alive_within_the_horizon_stays_a_duration() -> None:
    assert parse_duration(HORIZON_S) == HORIZON_S
    assert parse_duration("8760h") == 8760 * 3600.0  # a year
    with pytest.raises(ValueError, match="not finite"):
        parse_duration(math.inf)  # a request's "inf" is still a clear refusal, not forever


def test_a_batch_keeps_its_model_for_the_longest_its_jobs_asked() -> None:
    r = Residency({"cpu": 1 << 40}, 0, keep_alive_s=300, max_keep_alive_s=600)
    r.add("a", "cpu", 1)
    r.add("t", "cpu", 1, keep_alive_s=1800)  # the admin's TOML: not capped by max_keep_alive

    def longest(model: str, *asked: float | None) -> float | None:
        return longest_keep_alive(list(asked), lambda k: r.keep_alive_for(model, k))

    assert longest("a", 0, 60) == 60
    assert longest("a", 0, None) is None  # the model's default (300) beats 0
    assert longest("a", 60, None) is None
    assert longest("a", 400, None) == 400
    assert longest("a", None, 0, FOREVER) == FOREVER  # capped to 600 later, still the longest
    assert longest("t", 3600, None) is None  # 3600 is capped to 600; the model's own 1800 is longer


def test_ps_prints_a_keep_alive_past_what_the_clock_can_name() -> None:
    """An older daemon (before the horizon) can still answer 1e17: the table says forever, not a trace."""
    from diffusiond.commands.residency import _until

    for until_s in (1e17, 1e20, 1e308):
        assert _until({"keep_alive_until": until_s}) == "forever"
    assert "(in " in _until({"keep_alive_until": time.time() + 60})


def test_the_cli_and_the_client_send_keep_alive_and_the_gateway_batches_regardless() -> None:
    from diffusiond.cli import build_parser
    from diffusiond.client.params import job_body
    from diffusiond.commands.generate import build_body
    from diffusiond.ray import ids

    args = build_parser().parse_args(["generate", "x", "--keep-alive", "10m"])
    assert build_body(args, None)["keep_alive"] == "10m"
    assert "keep_alive" not in build_body(build_parser().parse_args(["generate", "x"]), None)
    assert job_body("x", {"keep_alive": -1}) == {"prompt": "x", "keep_alive": -1}
    # the daemon batches jobs asking different keep-alives, so the gateway must not keep them apart
    assert ids.batch_key({**JOB, "keep_alive": 0}) == ids.batch_key({**JOB, "keep_alive": "1h"})


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("keep-alive"),
                       ["--model", "tiny", "--no-persist", "--max-batch", "2", "--batch-wait-ms", "20000"],
                       model_cache) as d:
        yield d


async def _tiny(s: aiohttp.ClientSession) -> dict[str, Any]:
    status, body = await get(s, "/v1/models")
    assert status == 200, body
    return next(m for m in body["data"] if m["id"] == "tiny")


async def _pair(s: aiohttp.ClientSession, first: Any, second: Any) -> None:
    """Two jobs in one batch, ``first`` heading it; both succeed."""
    ids = [(await submit(s, {**JOB, "keep_alive": k}))["id"] for k in (first, second)]
    jobs = [await wait_job(s, i) for i in ids]
    assert all(j["status"] == "succeeded" for j in jobs), jobs
    assert jobs[0]["outputs"][0]["batch"] == jobs[1]["outputs"][0]["batch"], "the two jobs shared a batch"


def test_huge_keep_alives_keep_the_model_forever_and_ps_still_prints(daemon: Daemon,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from diffusiond.client import AsyncClient
    from diffusiond.commands.residency import ps

    async def go() -> None:
        async with http(daemon.socket) as s:
            await _pair(s, 0, 1e17)  # the head asks 0: the other's "forever" wins
            await _pair(s, 1e308, "99999999999h")

            async def forever() -> dict[str, Any] | None:
                m = await _tiny(s)
                return m if m["keep_alive_forever"] and m["keep_alive_until"] is None else None

            await until(forever, 30, "tiny kept forever after keep_alive 1e17")
            metrics = await (await s.get("/metrics")).text()
        device = [line for line in metrics.splitlines()
                  if line.startswith('diffusiond_model_bytes{device="cpu",model="tiny",tier="device"}')]
        assert device and float(device[0].split()[-1]) > 0, metrics
        assert 'diffusiond_model_bytes{device="cpu",model="tiny",tier="host"} 0.0' in metrics
        await ps(SimpleNamespace(json=False), AsyncClient(daemon.socket))

    asyncio.run(go())
    out = capsys.readouterr().out
    assert "tiny" in out and "forever" in out, out


def test_a_batch_keeps_its_model_for_its_longest_keep_alive_whoever_heads_it(daemon: Daemon) -> None:
    from diffusiond.client import AsyncClient

    async def go() -> None:
        async with http(daemon.socket) as s:
            await _pair(s, 0, "1h")

            async def an_hour() -> bool:
                m = await _tiny(s)
                left = (m["keep_alive_until"] or 0) - time.time()
                return m["residency"] == "device" and 3000 < left <= 3600

            await until(an_hour, 30, "tiny kept for the hour the second job of its batch asked, not 0")
            # the Python client carries the field: its two jobs share a batch too, and the longer one holds
            async with AsyncClient(daemon.socket) as c:
                handles = [await c.submit(JOB["prompt"], size=(64, 64), steps=1, keep_alive=k) for k in (0, "2h")]
                for h in handles:
                    assert (await h.wait(timeout=120))["status"] == "succeeded"

            async def two_hours() -> bool:
                left = ((await _tiny(s))["keep_alive_until"] or 0) - time.time()
                return 6600 < left <= 7200

            await until(two_hours, 30, "tiny kept for the 2h the client asked")

    asyncio.run(go())

