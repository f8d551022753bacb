"""Requests and checks of the HTTP API tests (test_daemon_api.py, test_daemon_api_queue.py): the quickest real
generation's bodies, POST/GET helpers that return the status with the JSON, a job run to its end, and PNG
decoding and comparison."""

from __future__ import annotations

import io
from typing import Any

import aiohttp
import numpy as np
from daemonkit import wait_job
from PIL import Image

SIZE = 64
STEPS = 2
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": STEPS}
"""A jobs-API body fragment for the quickest real generation."""
IMAGES = {"model": "tiny", "size": f"{SIZE}x{SIZE}", "num_inference_steps": STEPS}
"""The same for the OpenAI-shaped endpoint."""


async def post(session: aiohttp.ClientSession, path: str, body: Any) -> tuple[int, dict[str, Any], Any]:
    """POST a JSON body (or raw bytes); returns status, parsed JSON body and headers."""
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with session.post(path, **kwargs) as r:
        return r.status, await r.json(), r.headers


async def get_json(session: aiohttp.ClientSession, path: str) -> tuple[int, dict[str, Any]]:
    async with session.get(path) as r:
        return r.status, await r.json()


async def fetch(session: aiohttp.ClientSession, path: str) -> tuple[bytes, str]:
    async with session.get(path) as r:
        assert r.status == 200, await r.text()
        return await r.read(), r.content_type


async def run_job(session: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    status, job, headers = await post(session, "/v1/jobs", body)
    assert status == 202, job
    assert headers["Location"] == f"/v1/jobs/{job['id']}"
    return await wait_job(session, job["id"])


def png(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def same_image(a: bytes, b: bytes) -> bool:
    """Same seed, same picture: pixels equal up to one step of 8-bit rounding (a batched forward
    may sum in another order than a lone one; see test_worker.py)."""
    x = np.asarray(png(a), dtype=np.int16)
    y = np.asarray(png(b), dtype=np.int16)
    diff = np.abs(x - y)
    return x.shape == y.shape and int(diff.max()) <= 1 and float((diff == 0).mean()) > 0.999
