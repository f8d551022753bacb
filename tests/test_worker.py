"""The worker process and its async output path, driven through the real channel on CPU."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from workerkit import Driver, config, events

from conftest import memfd_maps, shm_entries
from diffusiond.ipc import messages as m

TINY = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)


@pytest.fixture(autouse=True)
def _cache(model_cache: Path) -> None:
    """Workers inherit DIFFUSIOND_CACHE, so tiny is built once for the session."""


async def test_worker_batches_of_1_and_8_give_per_request_outputs() -> None:
    async with Driver(config()) as d:
        one = await d.run(TINY, [11])
        eight = await d.run(TINY, list(range(100, 108)))
    for r in one + eight:
        assert r.ended is None, r.ended
        assert r.array is not None and r.array.shape == (64, 64, 3) and r.array.dtype == np.uint8
    assert len({r.array.tobytes() for r in eight}) == 8  # type: ignore[union-attr]


async def test_worker_output_bytes_match_the_bare_pipeline() -> None:
    import torch

    from diffusiond.pipelines import load_pipeline
    from diffusiond.worker.copier import to_output_layout

    pipe = load_pipeline("tiny")
    reqs = [m.RequestSpec(request_id="x", prompt="a red fox", seed=42)]
    with torch.inference_mode():
        expected = to_output_layout(pipe.run(TINY, reqs, lambda s, t: True)[0], "uint8").numpy()
    async with Driver(config()) as d:
        (r,) = await d.run(TINY, [42])
    assert np.array_equal(r.array, expected)


def same_image(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Same seed, same image: identical noise, and pixels equal up to one step of 8-bit rounding
    (batched kernels may sum in another order, ~1e-6 apart, which can flip a rounding)."""
    assert a is not None and b is not None
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return int(diff.max()) <= 1 and float((diff == 0).mean()) > 0.999


async def test_worker_seeds_reproduce_across_batch_sizes() -> None:
    async with Driver(config()) as d:
        (alone,) = await d.run(TINY, [7])
        batch = await d.run(TINY, [1, 2, 7, 3])
        (again,) = await d.run(TINY, [7])
    assert np.array_equal(alone.array, again.array)  # same batch shape: bit-exact
    assert same_image(alone.array, batch[2].array)
    assert not same_image(batch[0].array, batch[2].array)


async def test_worker_sync_and_async_modes_give_identical_bytes() -> None:
    seeds = [5, 6, 7]
    async with Driver(config(output_mode="async")) as a:
        out_a = await a.run(TINY, seeds)
    async with Driver(config(output_mode="sync")) as s:
        out_s = await s.run(TINY, seeds)
    for x, y in zip(out_a, out_s, strict=True):
        assert x.array is not None and x.array.tobytes() == y.array.tobytes()  # type: ignore[union-attr]


async def test_worker_compute_starts_next_batch_before_copy_finishes() -> None:
    """Proof by the worker's own event order: with copy_gate the copy of batch k only completes
    once a later forward has started, which can only happen if compute does not wait for copies
    (in sync mode the gate's bounded wait would expire and the order below would be reversed)."""
    params = m.BatchParams(width=32, height=32, steps=2, guidance=1.0)
    async with Driver(config("synthetic:compute_ms=5", fault="copy_gate")) as d:
        bids, rids = [], []
        for k in range(3):
            b, r = d.submit(params, [k])
            bids.append(b)
            rids += r
        await d.wait(rids[:2])
        order = events(await d.trace())
    for k in bids[:2]:
        later_start = min(i for i, (n, b) in enumerate(order) if n == "compute_start" and b > k)
        copy_end = order.index(("copy_end", k))
        assert later_start < copy_end, order


async def test_worker_sync_mode_copies_before_the_next_forward() -> None:
    params = m.BatchParams(width=32, height=32, steps=2, guidance=1.0)
    async with Driver(config("synthetic:compute_ms=5", output_mode="sync")) as d:
        b0, r0 = d.submit(params, [0])
        b1, r1 = d.submit(params, [1])
        await d.wait(r0 + r1)
        order = events(await d.trace())
    assert order.index(("copy_end", b0)) < order.index(("compute_start", b1))


async def test_worker_cancel_mid_run_stops_early_and_frees_slots() -> None:
    params = m.BatchParams(width=32, height=32, steps=400, guidance=1.0)
    async with Driver(config("synthetic:compute_ms=20000")) as d:
        _, rids = d.submit(params, [1, 2])
        await d.wait_for(lambda: d.results[rids[0]].progress)
        d.handle.cancel(rids)
        results = await d.wait(rids)
        ack = await d.trace()
    for r in results:
        assert r.array is None and r.ended is not None and r.ended.status == "cancelled"
        assert "step" in r.ended.message
    assert max(results[0].progress) < 400
    assert ack.slots_in_use == 0 and ack.arena_in_use == 0


async def test_worker_slots_all_come_back_after_a_run() -> None:
    async with Driver(config()) as d:
        for _ in range(3):
            await d.run(TINY, [1, 2, 3, 4])
        ack = await d.trace()
    assert ack.arena_high_water > 0
    assert ack.slots_in_use == 0 and ack.arena_in_use == 0


async def test_worker_holds_slots_until_the_engine_releases_them() -> None:
    async with Driver(config(), release=False) as d:
        results = await d.run(TINY, [1, 2])
        held = await d.trace()
        for r in results:
            assert r.desc is not None
            d.handle.return_slot(r.desc)
        after = await d.trace()
    assert held.slots_in_use == 2 and held.arena_in_use >= 2 * 64 * 64 * 3
    assert after.slots_in_use == 0


async def test_worker_output_larger_than_arena_gets_a_dedicated_memfd() -> None:
    params = m.BatchParams(width=256, height=256, steps=1, guidance=1.0)
    async with Driver(config("synthetic:compute_ms=1", arena_bytes=64 << 10)) as d:
        (r,) = await d.run(params, [3])
        ack = await d.trace()
    assert r.desc is not None and r.desc.dedicated
    assert r.array is not None and r.array.shape == (256, 256, 3)
    assert ack.dedicated_bytes == 0  # released after delivery


async def test_worker_forward_error_fails_the_batch_and_goes_on() -> None:
    bad = m.BatchParams(width=60, height=60, steps=2, guidance=5.0)  # not a multiple of 8
    async with Driver(config()) as d:
        failed = await d.run(bad, [1, 2])
        (ok,) = await d.run(TINY, [3])
    for r in failed:
        assert r.ended is not None and r.ended.status == "failed" and r.ended.stage == "computing"
        assert "8" in r.ended.message
    assert ok.array is not None


async def test_worker_failed_copy_fails_that_request() -> None:
    async with Driver(config(fault="fail_copy")) as d:
        (r,) = await d.run(TINY, [1])
        ack = await d.trace()
    assert r.ended is not None and r.ended.stage == "copying" and "injected copy failure" in r.ended.message
    assert ack.slots_in_use == 0


async def test_worker_whose_finite_check_fails_still_answers_that_job_and_the_next() -> None:
    """The check for NaN outputs raising once must not end the copy thread: before, the batch
    and every later one waited for their timeout."""
    params = m.BatchParams(width=32, height=32, steps=1, guidance=1.0)
    async with Driver(config("synthetic:compute_ms=1", fault="finite_error")) as d:
        first = await d.run(params, [1], prompt="a")
        second = await d.run(params, [2], prompt="a")
    for r in first + second:
        assert r.ended is None and r.array is not None, r.ended


async def test_worker_drain_before_sleep_and_shutdown_waits_for_in_flight_copy() -> None:
    params = m.BatchParams(width=32, height=32, steps=1, guidance=1.0)
    async with Driver(config("synthetic:compute_ms=1", fault="copy_delay_ms=300")) as d:
        b0, r0 = d.submit(params, [1])
        sleep_ack = await d.handle.command(m.Sleep(), timeout=30)
        assert sleep_ack.ok and d.done(r0[0])
        await d.handle.command(m.Wake(), timeout=30)
        freed = await d.handle.command(m.Release([], host_copy=True), timeout=30)  # issue 27: answered, between batches
        assert freed.ok and freed.host_kept == 0 == d.handle.host_kept  # a CPU worker keeps no host copy
        _, r1 = d.submit(params, [2])
        order = events(await d.handle.command(m.Trace(), timeout=30))
        await d.handle.stop(timeout=30)
        assert d.handle.proc is not None and d.handle.proc.returncode == 0
        assert d.done(r1[0]) and d.results[r1[0]].array is not None
    assert order.index(("copy_end", b0)) < order.index(("drain_end_sleep", 0)) < order.index(("sleep", 0))


async def test_worker_sigkill_leaves_nothing_in_dev_shm() -> None:
    before = shm_entries()
    async with Driver(config()) as d:
        await d.run(TINY, [1])
        pid = d.handle.pid
        assert pid is not None and memfd_maps(pid)
        os.kill(pid, signal.SIGKILL)
        reason = await asyncio.wait_for(d.handle.wait_lost(), 30)
    assert "killed by signal SIGKILL" in reason and f"pid {pid}" in reason
    assert d.lost == [reason]
    assert shm_entries() == before
    assert not memfd_maps()  # the engine side unmapped the dead worker's arena


async def test_worker_exits_when_the_engine_goes_away() -> None:
    async with Driver(config()) as d:
        proc = d.handle.proc
        assert proc is not None and d.handle.channel is not None
        d.handle.channel.sock.close()  # the engine's end vanishes, as when the engine is killed
        rc = await asyncio.wait_for(proc.wait(), 30)
    assert rc in (0, 1)


async def test_worker_bad_model_spec_fails_start_with_the_reason() -> None:
    from diffusiond.daemon.workers.link import WorkerStartError

    with pytest.raises(WorkerStartError, match="no-such-model"):
        async with Driver(config("/nonexistent/no-such-model")):
            pass


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("fail_start", "start-up failed: RuntimeError: injected start-up failure"),  # after the model loaded
        ("no_such_fault", "unknown fault 'no_such_fault'"),  # before HELLO
    ],
    ids=["after-load", "before-hello"],
)
async def test_worker_start_up_failure_is_reported_as_fatal_with_the_reason(fault: str, words: str) -> None:
    """Any exception in start-up is FATAL with its message and exit 1, not a worker stuck in
    "starting" until the engine's start timeout."""
    from diffusiond.daemon.workers.link import WorkerStartError

    d = Driver(config(fault=fault))
    with pytest.raises(WorkerStartError, match=words):
        await asyncio.wait_for(d.handle.start(timeout=120), 60)
    assert d.handle.proc is not None
    assert await asyncio.wait_for(d.handle.proc.wait(), 30) == 1


@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("wire", ["uint8", "float16", "float32"])
def test_cpu_output_layout_is_bit_identical_to_the_torch_path(src: str, wire: str) -> None:
    """On CPU the copy thread converts with numpy (no OpenMP team beside the forward); what
    reaches a client must still be exactly what the device path computes, half-way values included."""
    import torch

    from diffusiond.worker.copier import to_output_layout

    g = torch.Generator().manual_seed(0)
    for shape in ((3, 17, 9), (5, 3, 8, 8)):  # an image (C, H, W) and a video (F, C, H, W)
        x = torch.rand(shape, generator=g) * 1.4 - 0.2  # outside [0, 1] too: clamped
        x.view(-1)[:256] = (torch.arange(256) + 0.5) / 255  # exactly half-way between two uint8 levels
        x = x.to(getattr(torch, src))
        ref = x.float().permute(1, 2, 0) if x.dim() == 3 else x.float().permute(0, 2, 3, 1)
        expected = ((ref.clamp(0, 1) * 255).round().to(torch.uint8) if wire == "uint8"
                    else ref.to(getattr(torch, wire))).contiguous().numpy()  # fmt: skip
        got = to_output_layout(x, wire).numpy()
        assert got.dtype == expected.dtype and got.shape == expected.shape and got.flags.c_contiguous
        assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), (src, wire, shape)
