"""Compiled models batch in the sizes they were compiled for (issue 31): powers of two up to --max-batch,
``--batch-sizes``, and ``--warmup WxH:all`` warming each of them before the daemon is ready."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, submit, wait_job

from diffusiond.daemon.config import ConfigError, build_config, load_toml
from diffusiond.daemon.core.inputs import EditInput
from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.core.scheduler import Scheduler, Wait, batch_sizes
from diffusiond.ipc.frames import MAX_FDS
from diffusiond.ipc.inputs import InputBuffer
from diffusiond.protocol import Task

POW2_16 = (1, 2, 4, 8, 16)


def job(n: int = 1, size: int = 64, at: float = 0.0, edit: bool = False) -> Job:
    request = JobRequest(model="m", prompt="p", n=n, width=size, height=size, steps=2, guidance=1.0,
                         output_format="png",
                         edit=EditInput(Task.IMAGE_TO_IMAGE, 0.5, InputBuffer(np.zeros((8, 8, 3), np.uint8)), 64, 64)
                         if edit else None)
    j = Job(request)
    j.items = [Item(j, i, seed=i, enqueued_at=at) for i in range(n)]
    return j


def pow2(max_batch: int = 16, batch_wait_s: float = 0.0) -> Scheduler:
    return Scheduler(queue_size=100, max_batch=max_batch, batch_wait_s=batch_wait_s,
                     sizes={"m": batch_sizes(max_batch, pow2=True)})


def drain(s: Scheduler) -> list[list[Item]]:
    """Batches for an idle worker each time, until the queue is empty."""
    out = []
    while (got := s.next_batch("m", now=0.0)) is not None:
        assert isinstance(got, list)
        out.append(got)
    return out


# the sizes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_batch", "pow2_", "sizes"), [
    (16, True, POW2_16), (1, True, (1,)), (2, True, (1, 2)), (6, True, (1, 2, 4, 6)), (3, False, (1, 2, 3)),
])  # fmt: skip
def test_powers_of_two_up_to_max_batch_and_max_batch_itself(max_batch: int, pow2_: bool,
                                                            sizes: tuple[int, ...]) -> None:
    assert batch_sizes(max_batch, pow2_) == sizes


@pytest.mark.parametrize("queued", range(1, 18))
def test_a_run_of_compatible_items_goes_in_powers_of_two_in_queue_order(queued: int) -> None:
    s = pow2()
    jobs = [job() for _ in range(queued)]
    for j in jobs:
        s.admit(j)
    batches = drain(s)
    sizes = [len(b) for b in batches]
    # the largest size that fits each time: 5 goes as 4 then 1, 17 as 16 then 1
    expected, left = [], queued
    while left:
        expected.append(max(p for p in POW2_16 if p <= left))
        left -= expected[-1]
    assert sizes == expected
    assert [i.job for b in batches for i in b] == jobs  # nobody overtaken
    assert s.depth == 0


def test_the_item_left_over_heads_the_next_batch_and_company_joins_it() -> None:
    s = pow2(max_batch=8)
    first = [job() for _ in range(5)]
    other = job(size=128)  # another key, queued behind the five
    for j in (*first, other):
        s.admit(j)
    assert [i.job for i in s.next_batch("m", now=0.0)] == first[:4]  # type: ignore[union-attr]
    late = job()  # compatible with the fifth, admitted after the 128 job
    s.admit(late)
    # the fifth still heads the queue: it starts the next batch, and the later compatible job joins it
    assert [i.job for i in s.next_batch("m", now=0.0)] == [first[4], late]  # type: ignore[union-attr]
    assert [i.job for i in s.next_batch("m", now=0.0)] == [other]  # type: ignore[union-attr]


def test_a_jobs_outputs_split_at_a_power_of_two_and_the_job_stays_queued_until_all_left() -> None:
    s = pow2(max_batch=8)
    j = job(n=7)
    s.admit(j)
    assert len(s.next_batch("m", now=0.0)) == 4 and s.depth == 1  # type: ignore[arg-type]
    assert [len(b) for b in drain(s)] == [2, 1] and s.depth == 0


def test_a_busy_worker_still_gets_only_max_batch() -> None:
    s = pow2(max_batch=8)
    for _ in range(7):
        s.admit(job())
    assert s.next_batch("m", now=0.0, partial_ok=False) is None  # 7 < 8: not full, and 4 is not full either
    s.admit(job())
    assert len(s.next_batch("m", now=0.0, partial_ok=False)) == 8  # type: ignore[arg-type]


def test_a_max_batch_that_is_no_power_of_two_is_a_full_batch() -> None:
    s = pow2(max_batch=6)
    for _ in range(11):
        s.admit(job())
    assert len(s.next_batch("m", now=0.0, partial_ok=False)) == 6  # type: ignore[arg-type]
    assert [len(b) for b in drain(s)] == [4, 1]


def test_batch_wait_holds_then_sends_the_largest_power_of_two() -> None:
    s = pow2(max_batch=8, batch_wait_s=0.5)
    for _ in range(3):
        s.admit(job(at=10.0))
    assert isinstance(s.next_batch("m", now=10.1), Wait)
    assert len(s.next_batch("m", now=10.5)) == 2  # type: ignore[arg-type]
    assert isinstance(s.next_batch("m", now=10.6), list)  # its own wait is over too: it goes alone


def test_edits_stay_within_max_fds_and_powers_of_two() -> None:
    s = pow2(max_batch=64)  # room for more edits than a frame carries inputs: MAX_FDS is what bounds a batch
    edits = [job(n=1, edit=True) for _ in range(MAX_FDS + 3)]
    for j in edits:
        s.admit(j)
    try:
        batches = drain(s)
    finally:
        for j in edits:
            assert j.request.edit is not None
            j.request.edit.close()
    assert all(len(b) in batch_sizes(64, True) for b in batches), [len(b) for b in batches]
    assert max(len({i.job.id for i in b}) for b in batches) == MAX_FDS, [len(b) for b in batches]
    assert [(i.job, i.index) for b in batches for i in b] == [(j, 0) for j in edits]


def test_a_model_without_sizes_takes_any_size() -> None:
    s = Scheduler(queue_size=100, max_batch=16, batch_wait_s=0, sizes={"other": POW2_16})
    for _ in range(7):
        s.admit(job())
    assert [len(b) for b in drain(s)] == [7]


# configuration ---------------------------------------------------------------------------------


def sizes_of(values: dict[str, Any]) -> list[tuple[int, ...]]:
    config = build_config({}, {"model": ["tiny"], **values})
    return [config.batch_sizes_of(m) for m in config.models]


def test_compiled_models_default_to_powers_of_two_and_eager_ones_to_any_size(tmp_path: Path) -> None:
    assert sizes_of({"max_batch": 16, "compile": "default"}) == [POW2_16]
    assert sizes_of({"max_batch": 4}) == [(1, 2, 3, 4)]
    assert sizes_of({"max_batch": 4, "compile": "default", "batch_sizes": "any"}) == [(1, 2, 3, 4)]
    assert sizes_of({"max_batch": 6, "batch_sizes": "pow2"}) == [(1, 2, 4, 6)]
    toml = tmp_path / "d.toml"
    toml.write_text('max_batch = 8\nbatch_sizes = "auto"\n[[models]]\nname = "c"\nspec = "tiny"\ncompile = true\n'
                    'warmup = ["64x64:all", "64x64:1"]\n[[models]]\nname = "e"\nspec = "tiny"\n')
    config = build_config(load_toml(toml), {})
    c, e = config.models
    assert (config.batch_sizes_of(c), config.batch_sizes_of(e)) == ((1, 2, 4, 8), tuple(range(1, 9)))
    assert c.warmup == ((64, 64, 1), (64, 64, 2), (64, 64, 4), (64, 64, 8))  # each shape once


def test_warmup_all_is_every_size_that_forms() -> None:
    one = build_config({}, {"model": ["tiny"], "compile": "reduce-overhead", "max_batch": 16,
                            "warmup": "512x512:all"}).models[0]
    assert one.warmup == tuple((512, 512, b) for b in POW2_16)
    anyway = build_config({}, {"model": ["tiny"], "compile": "default", "max_batch": 3, "batch_sizes": "any",
                               "warmup": "64x64:ALL,96x64:2"}).models[0]
    assert anyway.warmup == ((64, 64, 1), (64, 64, 2), (64, 64, 3), (96, 64, 2))


@pytest.mark.parametrize(("values", "words"), [
    ({"batch_sizes": "odd"}, ["batch_sizes 'odd'", "auto, pow2, any"]),
    ({"warmup": "64x64:all"}, ["model 'tiny'", "64x64:all", "not compiled", "--compile"]),
    ({"warmup": "64x64:some", "compile": "default"}, ["warmup '64x64:some'", "WxH:all"]),
    # two sizes of five powers of two each are 10 graphs, over the 8 a module keeps by default
    ({"warmup": "512x512:all,1024x1024:all", "compile": "default", "max_batch": 16},
     ["model 'tiny'", "10 shapes", "1024x1024:16", "compile_shapes=8", "compile_shapes=10"]),
    ({"model": ["tiny,compile_shapes=3"], "warmup": "64x64:all", "compile": "default", "max_batch": 8},
     ["4 shapes", "compile_shapes=3"]),
    ({"model": ["tiny,compile_shapes=x"], "warmup": "64x64:1", "compile": "default"},
     ["model 'tiny'", "compile_shapes='x'", "whole number"]),
])  # fmt: skip
def test_refusals_name_the_setting_and_the_values(values: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        build_config({}, {"model": ["tiny"], **values})
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_a_larger_compile_shapes_takes_the_warm_up() -> None:
    m = build_config({}, {"model": ["tiny,compile_shapes=10"], "compile": "default", "max_batch": 16,
                          "warmup": "512x512:all,1024x1024:all"}).models[0]
    assert len(m.warmup) == 10


def test_serve_flag() -> None:
    from diffusiond.cli import SERVE_FIELDS, build_parser

    args = build_parser().parse_args(["serve", "--batch-sizes", "any", "--warmup", "64x64:all"])
    assert "batch_sizes" in SERVE_FIELDS and (args.batch_sizes, args.warmup) == ("any", "64x64:all")


# a compiled daemon -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("bsz")
    toml = root / "d.toml"
    toml.write_text('max_batch = 4\njob_timeout_s = 300\n'
                    '[[models]]\nname = "c"\nspec = "tiny"\ncompile = "default"\nwarmup = "64x64:all"\n'
                    'options = { compile_backend = "eager" }\n'
                    '[[models]]\nname = "e"\nspec = "synthetic:compute_ms=5"\n')
    with shared_daemon(root, ["--config", str(toml)], model_cache) as d:
        yield d


BODY = {"prompt": "a red fox", "width": 64, "height": 64, "steps": 2, "output_format": "npy"}


def batches(jobs: list[dict[str, Any]]) -> list[int]:
    """The sizes of the batches these jobs' outputs ran in, from the daemon's own record (each output's batch)."""
    counts = collections.Counter(o["batch"] for j in jobs for o in j["outputs"])
    return [counts[b] for b in sorted(counts)]


async def test_warm_up_all_compiles_every_power_of_two_before_ready(daemon: Daemon) -> None:
    log = daemon.log_path.read_text(errors="replace")
    assert [f"warmed up 64x64 batch {b} " in log for b in (1, 2, 4)] == [True] * 3, log[-3000:]
    assert "model c: batches of 1, 2, 4 only (--batch-sizes auto)" in log and "model e: batches of" not in log


async def test_each_model_says_the_batch_sizes_it_forms(daemon: Daemon) -> None:
    async with http(daemon.socket) as s, s.get("/v1/models") as r:
        entries = {m["id"]: m for m in (await r.json())["data"]}
    assert (entries["c"]["batch_sizes"], entries["e"]["batch_sizes"]) == ([1, 2, 4], [1, 2, 3, 4])


async def test_a_compiled_model_batches_in_powers_of_two_and_an_eager_one_in_any_size(daemon: Daemon) -> None:
    async with http(daemon.socket) as s:
        seven = await wait_job(s, (await submit(s, {**BODY, "model": "c", "n": 7}))["id"], timeout=300)
        eager = await wait_job(s, (await submit(s, {**BODY, "model": "e", "n": 7}))["id"], timeout=300)
        # clients at once, of 1 to 3 outputs each: whatever the queue holds, only the warmed sizes form
        ids = await asyncio.gather(*(submit(s, {**BODY, "model": "c", "n": 1 + k % 3, "seed": k}) for k in range(9)))
        crowd = [await wait_job(s, j["id"], timeout=300) for j in ids]
    assert all(j["status"] == "succeeded" for j in [seven, eager, *crowd]), [seven, eager, *crowd]
    assert batches([seven]) == [4, 2, 1]  # an idle worker takes 4; the rest go when it is free again
    assert batches([eager]) == [4, 3]  # eager: any size (here at most max_batch 4)
    assert sum(batches(crowd)) == 18 and set(batches(crowd)) <= {1, 2, 4}, batches(crowd)
    # every size that formed was warmed: no job of the compiled model waited for a compile
    assert [j for j in [seven, *crowd] if "compiling" in j["timings_ms"]] == []
