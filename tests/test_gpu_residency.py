"""GPU tests of residency's moves (skipped without CUDA; run on the H200 through the device tool).

A model that leaves its device must really give the memory back, and one that comes back must make
the same pictures: the moves go through page-locked host buffers (``pipelines/hostcopy.py``), so a
wrong swap of a parameter's storage would show as different bytes or memory still held. The same holds
for ``offload=stream`` (``pipelines/streaming.py``), whose blocks come in through a ring of device slots
on a side stream while the others compute: a missing wait would show as different bytes.
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


def _run(pipe: object, seed: int = 3) -> torch.Tensor:
    out = pipe.run(PARAMS, [RequestSpec(request_id="r", prompt="a lighthouse", seed=seed)], lambda *a: True)  # type: ignore[attr-defined]
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


def test_gpu_a_released_host_copy_is_unpinned_and_made_again_by_the_next_move(model_cache: object) -> None:
    """Issue 27: residency frees the host copy a woken model keeps when another model needs the room; the weights
    stay on the device, and the next sleep builds and pins the copy again."""
    from diffusiond.ipc import cuda_host

    pipe = load_pipeline("tiny", device="cuda:0", dtype="float16")
    before = _run(pipe)
    pipe.sleep()  # type: ignore[attr-defined]
    copy = pipe._hostcopy  # type: ignore[attr-defined]
    kept, block = copy.nbytes, copy._blocks[0].data_ptr()
    assert kept >= weight_bytes(pipe) and cuda_host.is_registered(block)
    assert copy.release() == 0 and copy.nbytes == kept, "asleep, the block is all the weights have"
    pipe.wake()  # type: ignore[attr-defined]
    assert copy.release() == kept and copy.nbytes == 0 and not cuda_host.is_registered(block)
    assert torch.equal(_run(pipe), before), "freeing the copy left the weights on the device as they were"
    pipe.sleep()  # type: ignore[attr-defined]
    assert copy.nbytes == kept and cuda_host.is_registered(copy._blocks[0].data_ptr())
    pipe.wake()  # type: ignore[attr-defined]
    assert torch.equal(_run(pipe), before)


def test_gpu_offload_stream_makes_the_resident_models_pictures_and_sleeps(model_cache: object) -> None:
    """The daemon's path: ``offload=stream,resident_blocks=K`` through the loader (streamer on the transformer,
    leaf-level group offloading on the encoders and the VAE), byte-equal to the resident model for two calls,
    counted at what it keeps on the device, and the same after a sleep and a wake."""
    from diffusiond.pipelines import offload, stream_plan

    resident = load_pipeline("tiny-flux", device="cuda:0", dtype="bfloat16")
    want = [_run(resident, seed) for seed in (3, 4)]
    del resident
    torch.cuda.empty_cache()
    for k in (0, 1, 2):
        pipe = load_pipeline("tiny-flux", device="cuda:0", dtype="bfloat16",
                             options={"offload": "stream", "resident_blocks": str(k)})
        got = [_run(pipe, seed) for seed in (3, 4)]
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), k
        inner = pipe._pipe  # type: ignore[attr-defined]
        assert weight_bytes(pipe) == stream_plan.plan(*offload.stream_sizes(inner), k).device_bytes
        streamer = pipe._streamer  # type: ignore[attr-defined]
        assert all(p.device.type == "cpu" and p.is_pinned() for b in streamer.blocks for p in b.module.parameters())
        pipe.sleep()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert all(p.device.type == "cpu" for p in inner.transformer.parameters()), "asleep, nothing on the device"
        pipe.wake()  # type: ignore[attr-defined]
        assert torch.equal(_run(pipe, 3), want[0]), k
        del pipe, inner, streamer
        torch.cuda.empty_cache()


@pytest.mark.parametrize(("resident", "depth"), [(0, 1), (0, 3), (3, 2), (2, 4), (6, 1)])
def test_gpu_streamed_blocks_are_byte_equal_across_steps_and_calls(model_cache: object, resident: int,
                                                                   depth: int) -> None:
    """The streamer alone on a deeper transformer (3 double- and 4 single-stream blocks): the ring's cyclic
    order across steps and calls, depth 1 included, against the same transformer resident."""
    import copy

    from diffusers import FluxPipeline, FluxTransformer2DModel

    from diffusiond.pipelines.streaming import BlockStreamer
    from diffusiond.pipelines.tiny_flux import TRANSFORMER, ensure_tiny_flux

    pipe = FluxPipeline.from_pretrained(str(ensure_tiny_flux()), torch_dtype=torch.bfloat16).to("cuda:0")
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(1)
    deep = FluxTransformer2DModel(**{**TRANSFORMER, "num_layers": 3, "num_single_layers": 4}).to(torch.bfloat16)
    streamed = copy.deepcopy(deep)

    def call(transformer: torch.nn.Module, seed: int, steps: int) -> torch.Tensor:
        p = FluxPipeline(**{**pipe.components, "transformer": transformer})
        p.set_progress_bar_config(disable=True)
        with torch.inference_mode():
            out = p(prompt="a lighthouse", height=64, width=64, num_inference_steps=steps, max_sequence_length=32,
                    generator=torch.Generator("cuda:0").manual_seed(seed), output_type="pt")
        return out.images.float().cpu()

    want = [call(deep.to("cuda:0"), seed, steps) for seed, steps in ((1, 3), (2, 2))]
    streamer = BlockStreamer(streamed, "cuda:0", resident, depth)
    got = [call(streamed, seed, steps) for seed, steps in ((1, 3), (2, 2))]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert streamer.copies == streamer.plan.depth + len(streamer.blocks) * 5


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
