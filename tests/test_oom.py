"""Out of memory is a job's problem, not the daemon's (issue 27, point 7), against a real daemon.

The worker's test-only fault ``oom=N`` (worker/faults.py) makes its first N forwards raise
``MemoryError`` (CPU) before they start, so the retry path runs without a huge allocation: the first
attempt fails, the retry (in halves for a batch) runs; what still fails ends with ``out_of_memory``
and the worker, the same process, goes on serving. The real allocation failure is in
``test_gpu_residency.py``.
"""

from __future__ import annotations

from typing import Any

from daemonkit import get, health, http, submit, wait_job

FAST = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2, "seed": 7}


async def _outputs(s: Any, job: dict[str, Any]) -> list[bytes]:
    got = []
    for k in range(len(job["outputs"])):
        async with s.get(f"/v1/jobs/{job['id']}/outputs/{k}") as r:
            assert r.status == 200, await r.text()
            got.append(await r.read())
    return got


async def test_first_forward_out_of_memory_is_retried_and_the_job_succeeds(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--test-fault", "oom=1", "--job-timeout", "120")
    async with http(d.socket) as s:
        pid = (await health(s))["workers"][0]["pid"]
        first = await wait_job(s, (await submit(s, FAST))["id"])
        assert first["status"] == "succeeded", first
        again = await wait_job(s, (await submit(s, FAST))["id"])  # no fault left: a plain run
        assert again["status"] == "succeeded", again
        assert await _outputs(s, first) == await _outputs(s, again), "the retry makes the same picture"
        assert (await health(s))["workers"][0]["pid"] == pid, "no worker was replaced"
    assert "ran out of memory; retrying" in d.log_path.read_text(errors="replace")


async def test_a_batch_out_of_memory_is_retried_in_halves_with_the_same_pictures(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--test-fault", "oom=1", "--max-batch", "4", "--job-timeout", "120")
    body = {**FAST, "n": 3}
    async with http(d.socket) as s:
        split = await wait_job(s, (await submit(s, body))["id"])
        assert split["status"] == "succeeded", split
        whole = await wait_job(s, (await submit(s, body))["id"])  # one batch of 3, no fault left
        assert whole["status"] == "succeeded", whole
        assert await _outputs(s, split) == await _outputs(s, whole), "halves give what the batch gives"
    assert "retrying as two halves" in d.log_path.read_text(errors="replace")


async def test_persistent_out_of_memory_fails_only_that_job_and_the_next_succeeds(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--test-fault", "oom=2", "--job-timeout", "120")
    async with http(d.socket) as s:
        pid = (await health(s))["workers"][0]["pid"]
        failed = await wait_job(s, (await submit(s, {**FAST, "width": 96}))["id"])
        assert failed["status"] == "failed", failed
        error = failed["error"]
        assert error["code"] == "out_of_memory", error
        for words in ("96x64", "batch of 1", "smaller size", "--device-memory", "offloading"):
            assert words in error["message"], (words, error["message"])
        nxt = await wait_job(s, (await submit(s, FAST))["id"])
        assert nxt["status"] == "succeeded", nxt
        h = await health(s)
        assert h["workers"][0]["pid"] == pid and h["workers"][0]["state"] == "ready", h
        status, models = await get(s, "/v1/models")
        assert status == 200, models


async def test_out_of_memory_in_both_halves_fails_the_batch_and_the_daemon_goes_on(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--test-fault", "oom=3", "--max-batch", "4", "--job-timeout", "120")
    async with http(d.socket) as s:
        failed = await wait_job(s, (await submit(s, {**FAST, "n": 2}))["id"])
        assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory", failed
        assert "in halves" in failed["error"]["message"], failed["error"]
        nxt = await wait_job(s, (await submit(s, {**FAST, "n": 2}))["id"])
        assert nxt["status"] == "succeeded", nxt


async def test_halves_keep_each_jobs_sound_track_on_its_own_output(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``audio`` is per request, not in the batch key: a batch of a silent LTX-2 job and one with its sound track,
    retried in halves, gives the sound track to the job that asked for it, and none to the other."""
    from ltx2kit import build_ltx2

    folder = build_ltx2(tmp_path / "ltx2")
    d = daemon_factory("--model", f"ltx2={folder}", "--test-fault", "oom=1", "--max-batch", "2", "--batch-wait-ms",
                       "3000", "--job-timeout", "120")
    body = {"model": "ltx2", "prompt": "a drum", "width": 64, "height": 64, "steps": 2, "num_frames": 9,
            "output_format": "npy"}
    async with http(d.socket) as s:
        silent = await submit(s, {**body, "seed": 3, "audio": False})
        sound = await submit(s, {**body, "seed": 4})
        silent, sound = await wait_job(s, silent["id"], timeout=120), await wait_job(s, sound["id"], timeout=120)
        assert silent["status"] == sound["status"] == "succeeded", (silent, sound)
        assert silent["outputs"][0]["batch"] == sound["outputs"][0]["batch"], "one batch, split in halves"
        assert silent["outputs"][0]["audio"] is None, silent["outputs"][0]
        assert sound["outputs"][0]["audio"] is not None, sound["outputs"][0]
        async with s.get(sound["outputs"][0]["audio"]["url"]) as r:
            assert (r.status, r.content_type) == (200, "audio/wav"), await r.text()
        async with s.get(f"/v1/jobs/{silent['id']}/outputs/0/audio") as r:
            assert r.status == 404, await r.text()
    assert "retrying as two halves" in d.log_path.read_text(errors="replace")
