"""The store on its own (no daemon): what its record of a job promises across a restart.

Each test opens a ``SqliteStore`` on a temporary state dir, closes it, and opens it again the way
a restarted daemon does."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.state.statedir import StateDirError
from diffusiond.daemon.state.store import SqliteStore
from diffusiond.ipc.messages import Capabilities
from diffusiond.protocol import JobStatus, Stage

REQ = JobRequest(model="tiny", prompt="a fox", n=2, width=64, height=64, steps=2, guidance=1.0,
                 output_format="png", seed=5)


def job(req: JobRequest = REQ) -> Job:
    j = Job(req)
    j.items = [Item(j, k, seed=100 + k) for k in range(req.n)]
    return j


async def reopened(root: Path) -> tuple[SqliteStore, list[Job]]:
    store = SqliteStore(root)
    return store, await store.open()


async def test_an_unfinished_job_comes_back_whole_and_in_order(tmp_path: Path) -> None:
    store, left = await reopened(tmp_path)
    assert left == []
    first, second = job(), job(JobRequest(**{**REQ.__dict__, "prompt": "second", "n": 1}))
    await store.add(first)
    await store.add(second)
    first.status = JobStatus.RUNNING
    store.update(first)
    await store.close()

    store, left = await reopened(tmp_path)
    assert [j.id for j in left] == [first.id, second.id]
    back = left[0]
    assert back.request == REQ and back.status == JobStatus.RUNNING and back.created == first.created
    assert [(i.index, i.seed, i.stage) for i in back.items] == [(0, 100, Stage.QUEUED), (1, 101, Stage.QUEUED)]
    await store.close()


async def test_a_job_ends_once_even_if_a_later_write_says_otherwise(tmp_path: Path) -> None:
    store, _ = await reopened(tmp_path)
    j = job()
    await store.add(j)
    for k, item in enumerate(j.items):
        item.file, item.nbytes = store.write_output(j.id, k, "png", [b"\x89PNG" + bytes([k]) * 10])
        item.stage = Stage.DONE
    assert j.end(JobStatus.SUCCEEDED)
    store.update(j)
    j.status, j.error = JobStatus.FAILED, {"code": "shutting_down", "message": "late", "stage": "done"}
    store.update(j)  # a record that ended does not move again
    await store.close()

    store, left = await reopened(tmp_path)
    assert left == []
    back = await store.load(j.id)
    assert back is not None and back.status == JobStatus.SUCCEEDED and back.error is None
    want = [(f"{j.id}-0.png", 14, True), (f"{j.id}-1.png", 14, True)]
    assert [(i.file, i.nbytes, i.done) for i in back.items] == want
    assert store.read_output(f"{j.id}-1.png") == b"\x89PNG" + b"\x01" * 10
    await store.delete(back)
    assert await store.load(j.id) is None and sorted(p.name for p in (tmp_path / "outputs").iterdir()) == []
    await store.close()


async def test_request_fields_added_later_are_carried_and_old_rows_still_read(tmp_path: Path) -> None:
    store, _ = await reopened(tmp_path)
    j = job()
    await store.add(j)
    await store.close()
    con = sqlite3.connect(tmp_path / "jobs.db")  # a row written by a newer version, and one by an older
    (raw,) = con.execute("SELECT request FROM jobs WHERE id = ?", (j.id,)).fetchone()
    newer = {**json.loads(raw), "a_field_from_a_newer_version": {"x": 1}}
    older = {k: v for k, v in json.loads(raw).items() if k not in ("scheduler", "output_dtype")}
    con.execute("UPDATE jobs SET request = ? WHERE id = ?", (json.dumps(newer), j.id))
    con.execute("INSERT INTO jobs (id, created, model, status, stage, request, seeds) VALUES (?, 1, 'tiny', "
                "'queued', 'queued', ?, '[1, 2]')", ("j_old", json.dumps(older)))
    con.commit()
    con.close()
    store, left = await reopened(tmp_path)
    assert [j.request for j in left] == [REQ, REQ]
    await store.close()


async def test_retention_by_size_takes_the_oldest_finished_first(tmp_path: Path) -> None:
    store, _ = await reopened(tmp_path)
    jobs = [job() for _ in range(4)]
    for j in jobs:
        await store.add(j)
    for j in jobs[:3]:  # three finished with 2 x 100 bytes each; the last one still queued
        for k, item in enumerate(j.items):
            item.file, item.nbytes = store.write_output(j.id, k, "png", [b"x" * 100])
            item.stage = Stage.DONE
        j.end(JobStatus.SUCCEEDED)
        store.update(j)
    assert [j.id for j in await store.expired(0, 450)] == [jobs[0].id]  # 600 bytes -> 400
    assert [j.id for j in await store.expired(0, 100)] == [j.id for j in jobs[:3]]
    assert await store.expired(0, 0) == []  # no limit
    await store.close()


async def test_capabilities_are_remembered_for_the_next_start(tmp_path: Path) -> None:
    store, _ = await reopened(tmp_path)
    caps = Capabilities(width=128, height=128, steps=2, guidance=1.0)
    store.remember("tiny=tiny", caps)
    await store.close()
    store, _ = await reopened(tmp_path)
    assert await store.capabilities() == {"tiny=tiny": caps}
    await store.close()


async def test_capabilities_an_older_diffusiond_wrote_are_not_taken_for_the_models_own(tmp_path: Path) -> None:
    """A row without a field added since (min_steps) would read as its default, 1, and admit the one-step job that
    a Qwen-Image or LTX-Video model makes NaN of; the model's capabilities stay unknown until it loads."""
    store, _ = await reopened(tmp_path)
    store.remember("qwen=Qwen/Qwen-Image", Capabilities(width=128, height=128, steps=2, guidance=1.0, min_steps=2))
    await store.close()
    with sqlite3.connect(tmp_path / "jobs.db") as con:
        (row,) = con.execute("SELECT capabilities FROM models").fetchone()
        older = {k: v for k, v in json.loads(row).items() if k != "min_steps"}
        con.execute("UPDATE models SET capabilities = ?", (json.dumps(older),))
    con.close()
    store, _ = await reopened(tmp_path)
    assert await store.capabilities() == {}
    await store.close()


async def test_the_lock_is_held_until_close(tmp_path: Path) -> None:
    store, _ = await reopened(tmp_path)
    with pytest.raises(StateDirError, match=r"in use by another diffusiond \(pid \d+\)"):
        await SqliteStore(tmp_path).open()
    await store.close()
    again, _ = await reopened(tmp_path)
    await again.close()


async def test_an_edit_is_recorded_without_its_input_and_flagged_after_a_crash(tmp_path: Path) -> None:
    import dataclasses

    class FakeInput:  # stands for inputs.EditInput: decoded pixels in shared memory, not storable
        def close(self) -> None:
            pass

    store, _ = await reopened(tmp_path)
    edit = job(dataclasses.replace(REQ, edit=FakeInput()))  # type: ignore[arg-type]
    plain = job()
    await store.add(edit)
    await store.add(plain)
    await store.close()
    store, left = await reopened(tmp_path)
    assert [j.id for j in left] == [edit.id, plain.id]
    assert store.lost_inputs == {edit.id}  # the engine ends it failed (input_lost) instead of running it
    assert left[0].request.edit is None and left[0].request.prompt == REQ.prompt
    await store.close()


async def test_outputs_versions_are_kept_and_a_record_without_them_still_reads(tmp_path: Path) -> None:
    store, _ = await reopened(tmp_path)
    j, old = job(), job()
    for record in (j, old):
        await store.add(record)
        for k, item in enumerate(record.items):
            item.file, item.nbytes = store.write_output(record.id, k, "png", [b"\x89PNG"])
            item.stage = Stage.DONE
            item.lora_versions, item.weight_versions = {"trainer": 3 + k}, ({"unet": 1} if k else {})
        record.end(JobStatus.SUCCEEDED)
        store.update(record)
    await store.close()
    con = sqlite3.connect(tmp_path / "jobs.db")  # as a daemon that kept no versions wrote it, and one damaged
    (raw,) = con.execute("SELECT outputs FROM jobs WHERE id = ?", (old.id,)).fetchone()
    outputs = [{k: v for k, v in o.items() if not k.endswith("_versions")} for o in json.loads(raw)]
    outputs[1]["lora_versions"] = ["not", "a", "mapping"]
    con.execute("UPDATE jobs SET outputs = ? WHERE id = ?", (json.dumps(outputs), old.id))
    con.commit()
    con.close()

    store, _ = await reopened(tmp_path)
    back, old_back = await store.load(j.id), await store.load(old.id)
    assert back is not None and old_back is not None
    assert [(i.lora_versions, i.weight_versions) for i in back.items] == [({"trainer": 3}, {}),
                                                                         ({"trainer": 4}, {"unet": 1})]
    assert back.lora_versions is None  # the outputs differ: the job as a whole names none
    assert [(i.done, i.lora_versions, i.weight_versions) for i in old_back.items] == [(True, None, None)] * 2
    assert old_back.lora_versions is None and old_back.weight_versions is None
    await store.close()


async def test_a_saved_trajectory_read_racing_its_deletion_is_a_404_not_a_500(tmp_path: Path) -> None:
    """A saved trajectory array (or sound track) read as DELETE or retention removes its job's
    files is refused from the deletion's start, and one whose file went meanwhile is OutputNotFound (404), as an
    output's file read is; its reads under way keep retention off the job."""
    from concurrent.futures import ThreadPoolExecutor

    from diffusiond.daemon.errors import OutputNotFound
    from diffusiond.daemon.outputs.file_reads import FileReads
    from diffusiond.daemon.outputs.trajectories import Trajectories
    from diffusiond.ipc.sidearrays import TrajectorySpec

    store, _ = await reopened(tmp_path)
    saved = job(JobRequest(**{**REQ.__dict__, "trajectory": TrajectorySpec()}))
    item = saved.items[0]
    item.stage = Stage.DONE
    file, _size = store.write_output(saved.id, 0, "latents.npy", [b"npy bytes"])
    item.trajectory_files = {"latents": {"file": file, "bytes": 9, "shape": [1], "dtype": "float32"}}
    with ThreadPoolExecutor(1) as executor:
        files = FileReads(executor, store)
        trajectories = Trajectories(executor, files)
        async with trajectories.open(item, "latents") as (_, payload):
            assert bytes(payload) == b"npy bytes" and files.reading == {}
        files.deleting.add(saved.id)
        with pytest.raises(OutputNotFound, match="being deleted"):
            async with trajectories.open(item, "latents"):
                pass
        files.deleting.clear()
        (tmp_path / "outputs" / file).unlink()  # removed between the job's lookup and the read
        with pytest.raises(OutputNotFound, match="gone from the state dir"):
            async with trajectories.open(item, "latents"):
                pass
        assert files.reading == {}
    await store.close()
