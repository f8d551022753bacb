"""Which live versions each output ran with (issue 29): a job of several outputs split across batches
with an update between them, its outputs' own versions in its view and in their files, and the same
after a restart of the daemon.

First in process against fake workers (tests/enginekit.py), where the worker's COMPUTE_DONE frames
say whatever versions the case needs; then end to end on tiny, where a real update lands between the
two batches of one job. That ordering is made, not hoped for: a long job keeps the worker busy while
the job's first batch waits behind it on the worker and its second in the engine's queue; a sleep
then holds the engine's queue (nothing is dispatched while the daemon sleeps), the long job is
cancelled so the first batch runs and the worker goes to sleep, the updates are applied to the
sleeping worker, and only the wake lets the second batch go.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest
from daemonkit import Daemon, cancel, get, health, http, submit, until, wait_job
from enginekit import Harness
from PIL import Image

from diffusiond.client import AsyncClient
from diffusiond.daemon.edge import views
from diffusiond.daemon.state.store import SqliteStore
from diffusiond.ipc.messages import ComputeDone
from diffusiond.protocol import JobStatus

SIZE = 64
TINY = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk",
        "output_format": "png"}


def png_text(data: bytes) -> dict[str, Any]:
    return dict(Image.open(io.BytesIO(data)).info)


# in process ---------------------------------------------------------------------------------------
async def test_each_output_keeps_its_own_batchs_versions_in_its_view_its_file_and_its_record(
        tmp_path: Path) -> None:
    h = Harness(max_batch=1, store=SqliteStore(tmp_path))
    await h.engine.start()
    job = h.submit(n=2)
    await h.engine.store.add(job)  # what admission does before the 202
    first, second = h.worker.executed  # one output per batch: the worker holds both
    w = h.worker
    w.send(ComputeDone(first.batch_id, 5.0, lora_versions={"trainer": 3}, weight_versions={}))
    assert job.lora_versions == {"trainer": 3} and job.weight_versions == {}  # so far, one batch has run
    w.output(first, 0)
    # an update was applied between the two batches
    w.send(ComputeDone(second.batch_id, 5.0, lora_versions={"trainer": 4}, weight_versions={"unet": 2}))
    w.output(second, 0)
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED

    def seen(view: dict[str, Any]) -> list[Any]:
        return [view["lora_versions"], view["weight_versions"],
                [(o["index"], o["lora_versions"], o["weight_versions"]) for o in view["outputs"]]]

    want = [None, None, [(0, {"trainer": 3}, None), (1, {"trainer": 4}, {"unet": 2})]]
    assert seen(views.job(job)) == want
    texts = []
    for k in range(2):
        async with h.engine.open_output(job, k) as r:  # with a state dir, the output is its file, read in pieces
            assert r.file is not None
            texts.append(png_text(b"".join([piece async for piece in r.file.pieces(1 << 20)])))
            r.complete = True
    assert [t["lora_versions"] for t in texts] == ["trainer:3", "trainer:4"]
    assert "weight_versions" not in texts[0] and texts[1]["weight_versions"] == "unet:2"
    await h.close()

    store = SqliteStore(tmp_path)  # as the next start reads it
    assert await store.open() == []
    back = await store.load(job.id)
    assert back is not None and seen(views.job(back)) == want
    await store.close()


async def test_outputs_that_agree_give_the_job_their_versions() -> None:
    h = Harness(max_batch=1)
    await h.engine.start()
    job = h.submit(n=2)
    for batch in h.worker.executed:
        h.worker.send(ComputeDone(batch.batch_id, 5.0, lora_versions={"trainer": 5}, weight_versions={"unet": 1}))
        h.worker.output(batch, 0)
    await h.settle(job)
    view = views.job(job)
    assert view["lora_versions"] == {"trainer": 5} and view["weight_versions"] == {"unet": 1}
    assert [o["lora_versions"] for o in view["outputs"]] == [{"trainer": 5}] * 2
    await h.close()


# end to end ---------------------------------------------------------------------------------------
def serve_args(state: Path) -> list[str]:
    # one output per batch, one worker: a job of two outputs runs as two batches, one after the other
    return ["--model", "tiny", "--workers", "1", "--max-batch", "1", "--job-timeout", "300",
            "--state-dir", str(state)]


async def split_job(sock: Path, dots_state: dict[str, Any]) -> tuple[dict[str, Any], int, int, int]:
    """A job of two outputs whose first batch ran before an update of a live adapter and of a component,
    and whose second ran after both; the job's view, and the adapter's versions before and after and
    the component's after (the values put back are tiny's own: only the versions change)."""
    from safetensors import safe_open

    from diffusiond.pipelines.tiny import ensure_tiny

    with safe_open(str(ensure_tiny() / "unet" / "diffusion_pytorch_model.safetensors"), "np") as f:
        original = f.get_tensor("conv_out.weight")
    live = [{"name": "split", "weight": 1.0}]
    async with AsyncClient(str(sock)) as c, http(sock) as s:
        before = await c.update_lora("split", dots_state)
        blocker = await submit(s, {**TINY, "steps": 500, "output_format": "npy", "prompt": "in the way"})

        async def computing() -> bool:
            return (await get(s, f"/v1/jobs/{blocker['id']}"))[1]["progress"]["step"] >= 1

        await until(computing, 120, "the long job to compute")
        job = await submit(s, {**TINY, "n": 2, "seed": 11, "loras": live})

        async def split() -> bool:  # output 0 waits on the worker, output 1 in the engine's queue
            h = await health(s)
            return h["workers"][0]["batches_in_flight"] == 2 and h["queue_depth"] == 1

        await until(split, 60, "the job's first batch to reach the worker and its second to wait")
        async def post(path: str) -> tuple[int, str]:
            async with s.post(path) as r:
                return r.status, await r.text()

        sleeping = asyncio.ensure_future(post("/v1/admin/sleep"))  # it answers once nothing runs

        async def paused() -> bool:
            return bool((await health(s))["sleeping"])

        await until(paused, 30, "the sleep to hold the queue")
        status, _ = await cancel(s, blocker["id"])
        assert status == 200
        assert (await sleeping)[0] == 200  # the first batch has finished, and nothing else has left the queue
        assert [o["index"] for o in (await get(s, f"/v1/jobs/{job['id']}"))[1]["outputs"]] == [0]
        after = await c.update_lora("split", {k: v * 3 for k, v in dots_state.items()})
        component = await c.update_weights("tiny", "unet", {"conv_out.weight": original})
        assert (await post("/v1/admin/wake"))[0] == 200
        done = await wait_job(s, job["id"], timeout=120)
    assert done["status"] == "succeeded", done
    assert after == before + 1
    return done, before, after, component


@pytest.fixture
def dots_state(lora_files: dict[str, Path]) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(lora_files["dots"] / "pytorch_lora_weights.safetensors"))


async def test_a_job_split_across_an_update_records_each_outputs_own_versions(
        daemon_factory: Any, tmp_path: Path, dots_state: dict[str, Any]) -> None:
    d: Daemon = daemon_factory(*serve_args(tmp_path / "state"))
    done, before, after, component = await split_job(d.socket, dots_state)
    outputs = done["outputs"]
    assert [o["lora_versions"] for o in outputs] == [{"split": before}, {"split": after}]
    assert [o["weight_versions"] for o in outputs] == [None, {"unet": component}]
    assert outputs[0]["batch"] != outputs[1]["batch"]
    # the job as a whole: no one version is true of both outputs
    assert done["lora_versions"] is None and done["weight_versions"] is None
    async with http(d.socket) as s:
        texts = []
        for o in outputs:
            async with s.get(o["url"]) as r:
                texts.append(png_text(await r.read()))
        # a job whose outputs all ran after the updates: the job's versions are theirs
        again = await wait_job(s, (await submit(s, {**TINY, "n": 2, "seed": 11,
                                                      "loras": [{"name": "split", "weight": 1.0}]}))["id"])
    assert [t["lora_versions"] for t in texts] == [f"split:{before}", f"split:{after}"]
    assert "weight_versions" not in texts[0] and texts[1]["weight_versions"] == f"unet:{component}"
    assert again["lora_versions"] == {"split": after} and again["weight_versions"] == {"unet": component}
    assert [o["lora_versions"] for o in again["outputs"]] == [{"split": after}] * 2


async def test_a_durable_jobs_versions_survive_a_restart(
        daemon_factory: Any, tmp_path: Path, dots_state: dict[str, Any]) -> None:
    state = tmp_path / "state"
    first: Daemon = daemon_factory(*serve_args(state))
    done, before, after, component = await split_job(first.socket, dots_state)
    async with http(first.socket) as s:
        agreed = await wait_job(s, (await submit(s, {**TINY, "seed": 3,
                                                       "loras": [{"name": "split", "weight": 1.0}]}))["id"])
    assert agreed["lora_versions"] == {"split": after}
    first.stop()  # SIGTERM: a clean stop; the jobs are finished and live on in the state dir

    second: Daemon = daemon_factory(*serve_args(state))
    async with http(second.socket) as s:
        status, back = await get(s, f"/v1/jobs/{done['id']}")
        _, agreed_back = await get(s, f"/v1/jobs/{agreed['id']}")
    assert status == 200, back
    keys = ("lora_versions", "weight_versions")
    assert [[o[k] for k in keys] for o in back["outputs"]] == \
        [[{"split": before}, None], [{"split": after}, {"unet": component}]]
    assert [back[k] for k in keys] == [None, None]
    assert [agreed_back[k] for k in keys] == [{"split": after}, {"unet": component}]
    assert [[o[k] for k in keys] for o in agreed_back["outputs"]] == [[{"split": after}, {"unet": component}]]
