"""A job whose model fits but whose own size no longer does (issue 27), against a real daemon on CPU.

Admission refuses a size its model's measured working memory cannot fit; a job admitted before that
measurement (a guess never refuses) used to wait queued until its deadline once the model's first run
measured it. Here the worker reports a large working set for every batch (the test fault
``working_bytes``, as a GPU's allocator would measure a large size), and a job queued behind the first
run ends ``failed`` with the reason as soon as that run's outputs are in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonkit import Daemon, get, http, shared_daemon, submit, until, wait_job

from diffusiond.daemon.residency.decisions import Evict, TooLarge
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.working import Shape

JOB = {"prompt": "x", "model": "slow", "width": 64, "height": 64, "steps": 2, "output_format": "png"}


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    """A synthetic model whose batches take a second (the first run is still computing when the later jobs
    come), one output per batch, a 64 MiB budget and every batch measured at 1 GiB of working memory."""
    args = ["--model", "slow=synthetic:compute_ms=1000", "--device-memory", "64MiB", "--max-batch", "1",
            "--no-persist", "--test-fault", f"working_bytes={1024**3}"]
    with shared_daemon(tmp_path_factory.mktemp("jobsize"), args, model_cache, {"OMP_NUM_THREADS": "1"}) as daemon:
        yield daemon


def test_a_job_queued_before_its_size_was_measured_too_large_fails_with_the_reason(d: Daemon) -> None:
    async def go() -> None:
        async with http(d.socket) as s:
            first = await submit(s, JOB)

            async def computing() -> bool:
                return (await get(s, f"/v1/jobs/{first['id']}"))[1]["status"] == "running"

            await until(computing, 60, "the first job to run")
            second = await submit(s, JOB)  # in flight beside the first: it runs whatever is measured
            queued = await submit(s, JOB)  # queued: asked about once a batch's outputs are in
            sync = asyncio.ensure_future(s.post("/v1/images/generations", json={  # queued too, its caller waiting
                "model": "slow", "prompt": "x", "size": "64x64", "num_inference_steps": 2}))
            assert (await wait_job(s, first["id"]))["status"] == "succeeded"
            end = await wait_job(s, queued["id"], timeout=60)
            assert end["status"] == "failed", end
            err = end["error"]
            assert err["code"] == "model_too_large", err
            for words in ("this job's size no longer fits", "64x64, batch 1", "1.00 GiB", "budget there is 64.00 MiB",
                          "a smaller size or batch", "a larger --device-memory"):
                assert words in err["message"], (words, err["message"])
            assert (await wait_job(s, second["id"]))["status"] == "succeeded"
            async with await asyncio.wait_for(sync, 60) as r:  # the waiting caller is told as admission would tell it
                body = await r.json()
                assert r.status == 400 and body["error"]["code"] == "model_too_large", body
            async with s.post("/v1/jobs", json=JOB) as r:  # a new job of that size: refused at admission, as before
                body = await r.json()
                assert r.status == 400 and body["error"]["code"] == "model_too_large", body

    asyncio.run(go())


@pytest.mark.parametrize(("peak", "pinned", "refused"), [(5, False, False), (7, False, True), (5, True, True)])
def test_a_size_is_too_large_only_when_evicting_every_other_model_would_not_make_room(
        peak: int, pinned: bool, refused: bool) -> None:
    """What the keeper fails a queued job on (``Residency.plan``'s ``TooLarge``): 4 GiB of weights and the
    measured peak against a 10 GiB budget where b (4 GiB, idle) is on the device; b leaves for it unless pinned."""
    g = 1 << 30
    r = Residency({"cuda:0": 10 * g}, 64 * g)
    r.add("a", "cuda:0", 4 * g)
    r.add("b", "cuda:0", 4 * g, pinned=pinned)
    r.loading_started("b")
    r.loaded("b", 0.0)
    r.measured("a", Shape(64, 64), peak * g)
    plan = r.plan("a", Shape(64, 64))
    assert isinstance(plan, TooLarge) == refused, plan
    assert refused or isinstance(plan, Evict), plan


def test_only_a_run_no_larger_than_the_size_makes_it_too_large() -> None:
    """What the keeper fails a queued job on: 4 GiB of weights and 10 GiB budget. 2 GiB measured at 512x512
    extrapolates past the budget at 1024x1024 but refuses nothing; 7 GiB measured at a larger size (or a larger
    batch) bounds 1024x1024 from above only and refuses nothing either; 7 GiB measured at a size no
    larger in any dimension (768x1024, batch 1) proves it, and the message says where it was measured."""
    g = 1 << 30
    r = Residency({"cuda:0": 10 * g}, 64 * g)
    r.add("a", "cuda:0", 4 * g)
    r.measured("a", Shape(512, 512), 2 * g)
    assert r.estimate("a", Shape(1024, 1024)).nbytes > 6 * g, "the extrapolation alone would not fit"
    assert not isinstance(r.plan("a", Shape(1024, 1024)), TooLarge)
    r.measured("a", Shape(2048, 1024), 7 * g)
    r.measured("a", Shape(1024, 1024, batch=4), 7 * g)
    assert not isinstance(r.plan("a", Shape(1024, 1024)), TooLarge)
    r.measured("a", Shape(768, 1024), 7 * g)
    plan = r.plan("a", Shape(1024, 1024))
    assert isinstance(plan, TooLarge), plan
    assert "measured at 768x1024, batch 1, no larger in any way" in plan.reason, plan.reason


def test_a_size_measured_as_fitting_is_never_refused_for_a_smaller_size_peak() -> None:
    """A small shape may peak higher than a larger one (an upscaler's tiles rode with it): 7 GiB measured at 512x512
    and 1 GiB at 1024x1024 leave 1024x1024 its own 1 GiB, and 768x768 at most that."""
    g = 1 << 30
    r = Residency({"cuda:0": 10 * g}, 64 * g)
    r.add("a", "cuda:0", 4 * g)
    r.measured("a", Shape(512, 512), 7 * g)
    r.measured("a", Shape(1024, 1024), 1 * g)
    for shape in (Shape(1024, 1024), Shape(768, 768)):
        est = r.estimate("a", shape)
        assert est.floor == 1 * g and est.nbytes >= est.floor, (shape, est)
        assert not isinstance(r.plan("a", shape), TooLarge), shape
    how = r.estimate("a", Shape(768, 768)).floor_how
    assert how == ("measured at 512x512, batch 1, no larger in any way, "
                   "capped at what 1024x1024, batch 1 took, no smaller in any way"), how
    assert isinstance(r.plan("a", Shape(512, 1280)), TooLarge)  # nothing measured above it caps 512x512's 7 GiB
