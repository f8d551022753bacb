"""What a job's own view says about how it runs, against one real daemon: ``compiled`` of a batch that runs
eager on a ``--compile``d model (a ControlNet's), ``progress.total`` of an image-to-image job before its
first event (the steps diffusers really runs at its strength), and the first load of a never-seen model
that fails (``model_load_failed`` with the worker's reason)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from controlkit import png
from daemonkit import Daemon, get, http, shared_daemon, sse, submit, wait_job


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, controlnet_dir: Path) -> Any:
    root = tmp_path_factory.mktemp("odds")
    broken = root / "broken"  # a pipeline's index and none of its parts: from_pretrained refuses it
    broken.mkdir()
    (broken / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    (root / "toml").write_text(
        'max_batch = 1\npreload = ["fast", "t"]\n'
        '[[models]]\nname = "fast"\nspec = "tiny"\ncompile = "default"\noptions = { compile_backend = "eager" }\n'
        '[[models]]\nname = "t"\nspec = "tiny"\n'
        f'[[models]]\nname = "b"\nspec = "{broken}"\n'
        f'[controlnets]\nedges = "{controlnet_dir}"\n')
    with shared_daemon(root, ["--config", str(root / "toml")], model_cache) as daemon:
        yield daemon


SMALL = {"prompt": "a red fox", "width": 64, "height": 64, "steps": 2, "seed": 1}


async def test_a_control_job_on_a_compiled_model_says_it_ran_uncompiled(d: Daemon) -> None:
    """Its batch runs eager (docs/api.md, --compile): ``compiled`` null, where a plain job's is the mode."""
    async with http(d.socket) as s:
        plain = await wait_job(s, (await submit(s, {"model": "fast", **SMALL}))["id"], timeout=300)
        body = {"model": "fast", **SMALL, "control": [{"name": "edges", "image": png(1)}]}
        controlled = await wait_job(s, (await submit(s, body))["id"], timeout=300)
    assert plain["status"] == controlled["status"] == "succeeded", (plain, controlled)
    assert plain["compiled"] == "default", plain
    assert controlled["compiled"] is None, controlled


async def test_an_image_to_image_job_counts_the_steps_it_runs_before_its_first_event(d: Daemon) -> None:
    """At strength 0.3 of 4 steps an SD model runs int(4 * 0.3) = 1 step: the job says 1 from admission
    (held here by a sleep, so no event has come), as its events then do, never 4 and then 1."""
    body = {"model": "t", **SMALL, "steps": 4, "image": png(2), "strength": 0.3}
    async with http(d.socket) as s:
        async with s.post("/v1/admin/sleep") as r:
            assert r.status == 200, await r.text()
        try:
            job = await submit(s, body)
            _, queued = await get(s, f"/v1/jobs/{job['id']}")
        finally:
            async with s.post("/v1/admin/wake") as r:
                assert r.status == 200, await r.text()
        events = await sse(s, job["id"])
        done = await wait_job(s, job["id"], timeout=300)
    assert queued["status"] == "queued" and queued["progress"] == {"step": 0, "total": 1}, queued
    assert done["status"] == "succeeded" and done["progress"] == {"step": 1, "total": 1}, done
    totals = {e["total"] for name, e in events if name == "progress"}
    assert totals == {1}, events


async def test_a_never_seen_model_whose_first_load_fails_is_model_load_failed_with_the_reason(d: Daemon) -> None:
    """Its first request loads it to learn its defaults (``described``); that load failing is the model's
    fault, said as a known model's failed load is, not ``no_worker``. The next request tries again."""
    async with http(d.socket) as s:
        for _ in range(2):
            async with s.post("/v1/jobs", json={"model": "b", **SMALL}) as r:
                status, body = r.status, await r.json()
            assert status == 503, body
            err = body["error"]
            assert err["code"] == "model_load_failed", err
            assert "model 'b' could not be loaded" in err["message"], err
            assert "cannot load StableDiffusionPipeline" in err["message"], err
        assert (await wait_job(s, (await submit(s, {"model": "t", **SMALL}))["id"]))["status"] == "succeeded"


async def test_a_compiling_edit_keeps_its_total_from_the_compile_mark_on(d: Daemon) -> None:
    """The worker marks a new compiled shape with a step-0 event before the pipeline has counted its steps:
    the job's total (1 step at strength 0.3 of 4) holds through that mark, never the 4 asked for."""
    body = {"model": "fast", **SMALL, "width": 96, "steps": 4, "image": png(3), "strength": 0.3}
    async with http(d.socket) as s:
        job = await submit(s, body)
        events = await sse(s, job["id"])
        done = await wait_job(s, job["id"], timeout=300)
    assert done["status"] == "succeeded", done
    assert any(name == "status" and e.get("stage") == "compiling" for name, e in events), events
    totals = {e["total"] for name, e in events if name == "progress"}
    assert totals == {1}, events
