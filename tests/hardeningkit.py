"""Helpers the hardening tests share (test_hardening.py, test_hardening_outputs.py,
test_hardening_shutdown.py): the daemons' environment, the job bodies more than one of them sends, and
the client calls they make on a job."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import aiohttp
from daemonkit import get, http, until

ENV = {"OMP_NUM_THREADS": "1"}
TERMINAL = ("succeeded", "failed", "cancelled")

# Job bodies of the shared "race" daemon (test_hardening.py) that the daemons of the SIGTERM and
# sleep/wake tests (test_hardening_shutdown.py) serve too.
TINY = {"model": "tiny", "prompt": "race", "width": 64, "height": 64, "steps": 2}
SLOW = {"model": "slow", "prompt": "race", "width": 64, "height": 64, "steps": 8}  # ~400 ms computing


# helpers --------------------------------------------------------------------------------------
def client(sock: Path) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientSession]:
    """``daemonkit.http`` without the connection cap: race tests keep many streams open."""
    return http(sock, limit=0)


async def job_state(s: aiohttp.ClientSession, job_id: str) -> dict[str, Any]:
    status, job = await get(s, f"/v1/jobs/{job_id}")
    assert status == 200, job
    return job


async def finished(s: aiohttp.ClientSession, job_id: str, timeout: float = 120) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        job = await job_state(s, job_id)
        return job if job["status"] in TERMINAL else None

    return await until(check, timeout, f"job {job_id} to end")


async def fetch(s: aiohttp.ClientSession, url: str) -> bytes:
    async with s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.read()
