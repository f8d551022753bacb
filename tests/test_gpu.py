"""GPU tests of the output path, run on the H200 through the device tool (skipped without CUDA).

Ordering is shown by CUDA events timed by the GPU itself, never by wall-clock assertions.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from workerkit import Driver, config

from diffusiond.ipc import messages as m

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]

# 4096x4096x3 float32 = 201 MB per output: a copy long enough to see on a GPU timeline.
BIG = m.BatchParams(width=4096, height=4096, steps=4, guidance=1.0, output_dtype="float32")


def gpu_events(ack: m.Ack) -> dict[tuple[str, int], int]:
    return {(e.name, e.batch_id): e.t_ns for e in ack.gpu_trace}


def gpu_config(mode: str = "async", **kw: object) -> m.WorkerConfig:
    return config("synthetic:compute_ms=60", device="cuda:0", output_mode=mode, trace_gpu=True,
                  arena_bytes=2 << 30, **kw)


async def test_gpu_copy_runs_on_a_side_stream_and_overlaps_the_next_forward() -> None:
    async with Driver(gpu_config()) as d:
        rids = []
        bids = []
        for k in range(4):
            b, r = d.submit(BIG, [k])
            bids.append(b)
            rids += r
        await d.wait(rids)
        t = gpu_events(await d.trace())
    for k, nxt in itertools.pairwise(bids):
        copy_start, copy_end = t[("copy_start", k)], t[("copy_end", k)]
        next_start, next_end = t[("compute_start", nxt)], t[("compute_end", nxt)]
        # the copy of batch k and the forward of batch k+1 were on the GPU at the same time
        assert copy_start < next_end and next_start < copy_end, (k, t)


async def test_gpu_sync_mode_copies_before_the_next_forward() -> None:
    async with Driver(gpu_config("sync")) as d:
        b0, r0 = d.submit(BIG, [0])
        b1, r1 = d.submit(BIG, [1])
        await d.wait(r0 + r1)
        t = gpu_events(await d.trace())
    assert t[("copy_end", b0)] <= t[("compute_start", b1)]


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
async def test_gpu_output_bytes_match_a_plain_cpu_copy(dtype: str) -> None:
    from diffusiond.pipelines import load_pipeline
    from diffusiond.worker.copier import to_output_layout

    params = m.BatchParams(width=1024, height=768, steps=2, guidance=1.0, output_dtype=dtype)  # type: ignore[arg-type]
    pipe = load_pipeline("synthetic:compute_ms=5", device="cuda:0")
    reqs = [m.RequestSpec(request_id=str(i), prompt="p", seed=s) for i, s in enumerate([3, 4, 5])]
    expected = [to_output_layout(o, dtype).cpu().numpy() for o in pipe.run(params, reqs, lambda s, t: True)]
    async with Driver(config("synthetic:compute_ms=5", device="cuda:0")) as d:
        results = await d.run(params, [3, 4, 5])
    for r, e in zip(results, expected, strict=True):
        assert r.array is not None and r.array.dtype == e.dtype and np.array_equal(r.array, e)


async def test_gpu_tiny_model_runs_on_cuda_and_matches_across_modes(model_cache: object) -> None:
    params = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)
    async with Driver(config(device="cuda:0", output_mode="async")) as a:
        out_a = await a.run(params, [1, 2])
    async with Driver(config(device="cuda:0", output_mode="sync")) as s:
        out_s = await s.run(params, [1, 2])
    for x, y in zip(out_a, out_s, strict=True):
        assert x.array is not None and np.array_equal(x.array, y.array)


def test_gpu_arena_is_registered_and_copies_land_exactly() -> None:
    from diffusiond.ipc import cuda_host
    from diffusiond.ipc.arena import Arena
    from diffusiond.ipc.tensors import as_torch, describe, write_tensor

    arena = Arena(64 << 20, on_map=cuda_host.register, on_unmap=cuda_host.unregister)
    assert cuda_host.is_registered(arena.address)
    src = torch.randint(0, 256, (8, 1024, 1024), dtype=torch.uint8, device="cuda")
    view = src[5]  # one request's view of a batch tensor
    slot = arena.allocate(view.numel())
    write_tensor(arena.buffer(slot), view, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(as_torch(arena._view, describe(view, slot.id, slot.offset)), view.cpu())
    arena.release(slot.id)
    arena.close()
    assert not cuda_host.is_registered(arena.address)


# --compile ------------------------------------------------------------------------------------
# Compiled kernels fuse and reorder float operations, so a compiled model's output differs from the
# eager one by rounding (it is exact run to run, and bit-identical when replayed from a CUDA graph).
# The bound is on the mean and on the worst pixel, in uint8 levels. Measured on the H200
# (2026-12-01, float32, 64x64, 4 steps): max 2 on the first tiny; max 6, mean 0.068 on tiny-v2,
# whose VAE is set to reproduce its input and carries a rounding difference in the latents
# further into the pixels. A real error (a wrong scheduler step, a swapped batch item) moves the
# mean by tens of levels.
COMPILE_TOLERANCE_LEVELS = 8
COMPILE_TOLERANCE_MEAN = 0.25
TINY = m.BatchParams(width=64, height=64, steps=4, guidance=5.0)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
async def test_gpu_compiled_output_matches_eager_within_tolerance(model_cache: object, mode: str) -> None:
    async with Driver(config(device="cuda:0")) as eager:
        want = await eager.run(TINY, [1, 2])
    async with Driver(config(device="cuda:0", compile=mode, warmup=[m.WarmupShape(64, 64, 2)]),
                      start_timeout=600) as compiled:
        got = await compiled.run(TINY, [1, 2])
        again = await compiled.run(TINY, [1, 2])
    for w, g, a in zip(want, got, again, strict=True):
        assert w.array is not None and g.array is not None and a.array is not None
        diff = np.abs(w.array.astype(np.int16) - g.array.astype(np.int16))
        assert diff.max() <= COMPILE_TOLERANCE_LEVELS, f"{mode}: max {diff.max()}, mean {diff.mean():.4f}"
        assert diff.mean() <= COMPILE_TOLERANCE_MEAN, f"{mode}: max {diff.max()}, mean {diff.mean():.4f}"
        assert np.array_equal(g.array, a.array)  # run to run, bit for bit
        assert not g.compiling  # the warm-up compiled this shape before READY


def test_gpu_cuda_graph_replays_are_bit_identical_and_compile_once(model_cache: object) -> None:
    from diffusiond.pipelines import load_pipeline
    from diffusiond.pipelines.compile import CompiledPipeline, compilations

    pipe = CompiledPipeline(load_pipeline("tiny", device="cuda:0", dtype="float16"), "reduce-overhead")
    reqs = [m.RequestSpec(request_id=str(i), prompt="a red fox", seed=i) for i in range(2)]
    outs = []
    with torch.inference_mode():
        for k in range(5):
            outs.append(torch.stack(pipe.run(TINY, reqs, lambda _s, _t: True)).cpu())
            if k == 1:  # compiled on the first run, graphs recorded by the second
                compiled = compilations()
    assert compilations() == compiled  # runs 3-5 replay: nothing compiled again
    assert all(torch.equal(outs[1], o) for o in outs[2:])


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_lora_hot_swap_on_an_inductor_compiled_model_never_recompiles(
        model_cache: object, tmp_path: object, mode: str) -> None:
    """The CPU test (test_lora_compiled.py) proves it with the eager backend; this is inductor's
    kernels and, with reduce-overhead, CUDA graphs, whose captured weights must be the slots that
    a swap writes into in place."""
    from pathlib import Path

    from lorakit import build_lora

    from diffusiond.pipelines import load_pipeline
    from diffusiond.pipelines.compile import CompiledPipeline, compilations
    from diffusiond.pipelines.hotswap import HotSwapAdapters, adapters_for
    from diffusiond.pipelines.loras import Adapters

    root = Path(str(tmp_path))
    files = {"a": build_lora(root / "a", seed=11, rank=4, text_encoder=False),
             "b": build_lora(root / "b", seed=12, rank=2, text_encoder=False)}
    a, b = (m.LoraRef("a", 1.0),), (m.LoraRef("b", 0.7),)
    both = (m.LoraRef("a", 0.5), m.LoraRef("b", 1.0))
    reqs = [m.RequestSpec(request_id=str(i), prompt="a red fox", seed=i) for i in range(2)]

    def run(pipe: object) -> np.ndarray:
        with torch.inference_mode():
            out = torch.stack(pipe.run(TINY, reqs, lambda _s, _t: True))  # type: ignore[attr-defined]
        return out.float().mul(255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

    eager = load_pipeline("tiny", device="cuda:0", dtype="float32")
    reference = adapters_for(eager, {}, 2)
    assert type(reference) is Adapters
    for name, path in files.items():
        assert reference.register(name, str(path)) == ""
    want = {}
    for loras in ((), a, b, both):
        reference.activate(loras)
        want[loras] = run(eager)

    pipe = CompiledPipeline(load_pipeline("tiny", device="cuda:0", dtype="float32"), mode)
    adapters = adapters_for(pipe, {}, 2, target_rank=4)
    assert isinstance(adapters, HotSwapAdapters)
    for name, path in files.items():
        assert adapters.register(name, str(path)) == ""
    run(pipe)
    run(pipe)  # compiled on the first run; with reduce-overhead, graphs recorded by the second
    warm = compilations()
    seen: dict[tuple[m.LoraRef, ...], np.ndarray] = {}
    for loras in (a, b, (), a, both, b, ()):
        adapters.activate(loras)
        got = run(pipe)
        diff = np.abs(got.astype(np.int16) - want[loras].astype(np.int16))
        assert diff.max() <= COMPILE_TOLERANCE_LEVELS and diff.mean() <= COMPILE_TOLERANCE_MEAN, \
            f"{mode} {loras}: max {diff.max()}, mean {diff.mean():.4f}"
        if loras in seen:
            assert np.array_equal(seen[loras], got), f"{mode} {loras}: not the same bytes as its first run"
        seen[loras] = got
    assert not np.array_equal(seen[a], seen[()]) and not np.array_equal(seen[a], seen[b])
    assert compilations() == warm, f"{mode}: a switch recompiled ({warm} -> {compilations()})"


@pytest.mark.parametrize("indices", [[0], [1, 2], [0, 2]])
def test_gpu_a_preview_never_synchronizes_the_device(indices: list[int]) -> None:
    """The forward's host thread runs ahead of the GPU; a preview that waited for the GPU would
    stall it at every step it is drawn on (docs/benchmarks.md, previews). Drawing the picture
    and queueing its copy into the registered arena (worker/previews.py) both only launch."""
    import msgspec

    from diffusiond.ipc import cuda_host
    from diffusiond.ipc.arena import Arena, Slot
    from diffusiond.ipc.tensors import as_torch
    from diffusiond.pipelines.previews import LinearPreviewer
    from diffusiond.worker.previews import PreviewOutbox
    from diffusiond.worker.state import SharedState

    class Sdxl:  # what family_of and the factors need of a pipeline
        pass

    previewer = LinearPreviewer(Sdxl(), "sdxl")
    latents = torch.randn(3, 4, 128, 128, device="cuda:0", dtype=torch.float16)
    params = m.BatchParams(width=1024, height=1024, steps=20, guidance=5.0)
    previewer(latents, indices, params, [256] * len(indices))  # first call moves the factors
    arena = Arena(16 << 20, on_map=cuda_host.register, on_unmap=cuda_host.unregister)
    posted: list[m.PreviewReady] = []
    outbox = PreviewOutbox(arena, SharedState(), posted.append, cuda=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pictures = previewer(latents, indices, params, [256] * len(indices))
        for k, picture in enumerate(pictures):
            assert outbox.offer(1, f"r{k}", 5, 20, picture)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [tuple(p.shape) for p in pictures] == [(256, 256, 3)] * len(indices)
    want = previewer(latents[indices], list(range(len(indices))), params, [256] * len(indices))
    assert all(torch.equal(p, w) for p, w in zip(pictures, want, strict=True))
    torch.cuda.synchronize()
    outbox.flush()
    assert len(posted) == len(indices)
    for ready, picture in zip(posted, pictures, strict=True):
        desc = ready.tensor  # read as the engine does; cloned, so no view outlives the arena
        landed = as_torch(arena.buffer(Slot(desc.slot_id, desc.offset, desc.nbytes)),
                          msgspec.structs.replace(desc, offset=0)).clone()
        assert torch.equal(landed, picture.cpu())
    arena.close()  # unregisters: the next case's arena may be mapped at the same address
