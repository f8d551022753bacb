"""GPU tests of residency's moves (skipped without CUDA; run on the H200 through the device tool).

A model that leaves its device must really give the memory back, and one that comes back must make
the same pictures: the moves go through page-locked host buffers (``pipelines/hostcopy.py``), so a
wrong swap of a parameter's storage would show as different bytes or memory still held.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import pytest
import torch

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import weight_bytes
from diffusiond.pipelines.registry import load_pipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]

PARAMS = BatchParams(width=64, height=64, steps=3, guidance=5.0)


def _run(pipe: object) -> torch.Tensor:
    out = pipe.run(PARAMS, [RequestSpec(request_id="r", prompt="a lighthouse", seed=3)], lambda *a: True)  # type: ignore[attr-defined]
    return out[0].float().cpu()


def test_gpu_leaving_frees_the_device_and_coming_back_makes_the_same_pictures(model_cache: object) -> None:
    pipe = load_pipeline("tiny", device="cuda:0", dtype="float16")
    before = _run(pipe)
    nbytes = weight_bytes(pipe)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(3):  # the pinned buffers are made once and reused
        pipe.sleep()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert held - torch.cuda.memory_allocated() >= 0.9 * nbytes, "the weights left the device"
        pipe.wake()  # type: ignore[attr-defined]
        assert torch.equal(_run(pipe), before)
    host = [p for c in pipe._pipe.components.values() if isinstance(c, torch.nn.Module)  # type: ignore[attr-defined]
            for p in c.parameters()]
    assert all(p.device.type == "cuda" for p in host)
    pipe.sleep()  # type: ignore[attr-defined]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in host), "away, the weights wait in pinned memory"
    pipe.wake()  # type: ignore[attr-defined]


# Against a real daemon on the GPU ------------------------------------------------------------------
G = 1024**3
FAST = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 2, "seed": 3}


async def test_gpu_a_real_out_of_memory_fails_that_job_and_the_worker_goes_on(daemon_factory: Any) -> None:
    """The worker's allocator may take 2 GiB (fault ``memory_fraction``): tiny at 4096x4096 really runs out
    (the VAE's activations alone are GiBs), the retry after emptying the cache too; the job ends with
    ``out_of_memory`` naming the shape, and the same worker serves the next job."""
    from daemonkit import health, http, submit, wait_job

    fraction = 2 * G / torch.cuda.get_device_properties(0).total_memory
    d = daemon_factory("--model", "tiny", "--device", "cuda:0", "--test-fault", f"memory_fraction={fraction:.5f}",
                       "--job-timeout", "300")
    async with http(d.socket) as s:
        pid = (await health(s))["workers"][0]["pid"]
        assert (await wait_job(s, (await submit(s, FAST))["id"], 300))["status"] == "succeeded"
        big = await wait_job(s, (await submit(s, {**FAST, "width": 4096, "height": 4096}))["id"], 300)
        assert big["status"] == "failed", big
        assert big["error"]["code"] == "out_of_memory", big["error"]
        assert "4096x4096" in big["error"]["message"] and "batch of 1" in big["error"]["message"], big["error"]
        after = await wait_job(s, (await submit(s, FAST))["id"], 300)
        assert after["status"] == "succeeded", after
        h = await health(s)
        assert h["workers"][0]["pid"] == pid and h["workers"][0]["state"] == "ready", h
    text = d.log_path.read_text(errors="replace")
    assert "ran out of memory; retrying" in text and "CUDA out of memory" in text


_HOG = """
import sys, time, torch
hog = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("held", flush=True)
time.sleep(600)
"""


async def test_gpu_another_program_taking_memory_sends_an_idle_model_away_within_a_second(
        daemon_factory: Any) -> None:
    """Other programs come first: a second process takes 16 GiB so less than the reserve is free; the idle
    model leaves its device within about a second (NVML polled every 0.5 s), a new job waits for memory,
    and runs once the other program is gone."""
    pytest.importorskip("pynvml", reason="the pressure watch reads NVML (pip install 'diffusiond[gpu]')")
    from daemonkit import get, http, submit, wait_job

    free, _ = torch.cuda.mem_get_info(0)
    reserve = free - 12 * G  # free now, beside the daemon (~1-2 GiB); 16 GiB more taken: 4+ GiB short
    assert reserve > G, f"the GPU has too little free memory for this test ({free / G:.1f} GiB)"
    d = daemon_factory("--model", "tiny", "--device", "cuda:0", "--keep-alive", "-1", "--reserve-memory",
                       str(reserve), "--job-timeout", "300")

    async def residency(s: Any) -> str:
        status, body = await get(s, "/v1/models")
        assert status == 200, body
        return str(body["data"][0]["residency"])

    async with http(d.socket) as s:
        assert (await wait_job(s, (await submit(s, FAST))["id"], 300))["status"] == "succeeded"
        assert await residency(s) == "device"
        hog = await asyncio.create_subprocess_exec(sys.executable, "-c", _HOG, str(16 * G),
                                                   stdout=asyncio.subprocess.PIPE)
        try:
            assert hog.stdout is not None
            assert (await asyncio.wait_for(hog.stdout.readline(), 120)).strip() == b"held"
            t0 = time.monotonic()
            while await residency(s) == "device":
                assert time.monotonic() - t0 < 3, "the idle model did not leave its device"
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            print(f"the idle model left the device {took:.2f} s after the other program took its memory")
            assert took <= 1.5, f"it took {took:.2f} s to leave"
            job = await submit(s, FAST)
            await asyncio.sleep(1.5)
            _status, body = await get(s, f"/v1/jobs/{job['id']}")
            assert body["status"] == "queued" and body.get("stage") == "waiting_for_memory", body
        finally:
            hog.kill()
            await hog.wait()
        done = await wait_job(s, job["id"], 120)
        assert done["status"] == "succeeded", done
