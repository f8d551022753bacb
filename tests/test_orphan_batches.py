"""A batch whose jobs all ended while its worker computes it: the worker sees a cancel only at its
next step, and one step of a large forward can take minutes, during which the model served no one and the jobs
behind read ``waiting_for_memory``. After ``orphan_grace_s`` the engine kills such a worker; the pool replaces it,
and the batch it had not started goes back to the queue instead of failing. The engine with fake workers here;
tests/test_hardening_shutdown.py has a real daemon's worker inside one long step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from daemonkit import Daemon, gone, submit, until
from enginekit import Harness
from hardeningkit import ENV, client, job_state

from diffusiond.protocol import JobStatus, WorkerState


async def test_a_worker_computing_only_ended_jobs_is_killed_and_the_batch_behind_runs_on_its_replacement() -> None:
    h = Harness(max_batch=1, orphan_grace_s=0.2)
    await h.engine.start()
    stuck = h.submit(timeout_s=0.05)
    behind = h.submit()  # sent to the same worker, waiting behind the stuck batch
    first = h.worker
    assert len(first.executed) == 2
    await h.settle(stuck)
    assert stuck.status == JobStatus.FAILED and first.cancelled == [f"{stuck.id}/0"]
    assert not first.killed  # the grace: a worker that notices at its next step is left alone

    async def replaced() -> None:
        while len(h.spawned) < 2 or h.worker.state != WorkerState.READY or not h.worker.executed:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(replaced(), 5)
    assert first.killed
    assert behind.status != JobStatus.FAILED, behind.error  # requeued, not failed with the killed worker
    [batch] = h.worker.executed
    assert [r.request_id for r in batch.requests] == [f"{behind.id}/0"]
    h.worker.finish(batch)
    await h.settle(behind)
    assert behind.status == JobStatus.SUCCEEDED
    await h.close()


async def test_a_worker_whose_batch_still_serves_a_job_or_that_finishes_in_time_is_left_alone() -> None:
    h = Harness(max_batch=2, batch_wait_ms=50, orphan_grace_s=0.1)
    await h.engine.start()
    ended, alive = h.submit(timeout_s=0.05), h.submit()  # one batch of two
    await h.settle(ended)
    [batch] = h.worker.executed
    assert len(batch.requests) == 2 and ended.status == JobStatus.FAILED
    await asyncio.sleep(0.3)
    assert not h.worker.killed and len(h.spawned) == 1  # the batch still makes ``alive``'s output
    h.worker.finish(batch)
    await h.settle(alive)
    assert alive.status == JobStatus.SUCCEEDED

    late = h.submit(timeout_s=0.05)
    await h.settle(late)
    h.worker.finish(h.worker.executed[-1])  # the worker noticed at its next step and ended the batch
    await asyncio.sleep(0.3)
    assert not h.worker.killed and len(h.spawned) == 1
    await h.close()


async def test_with_no_job_waiting_the_worker_is_left_to_finish_until_one_comes() -> None:
    """A decode or a compile has no step to stop at, and a reload of a large model can cost more than it saves:
    no kill while no one waits for the model; one is due a grace after a job comes."""
    h = Harness(max_batch=1, orphan_grace_s=0.1)
    await h.engine.start()
    stuck = h.submit(timeout_s=0.05)
    await h.settle(stuck)
    await asyncio.sleep(0.4)
    assert not h.worker.killed and len(h.spawned) == 1
    behind = h.submit()
    first = h.worker

    async def killed() -> None:
        while not first.killed:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(killed(), 5)
    assert behind.status != JobStatus.FAILED, behind.error
    await h.close()


async def test_the_batch_behind_that_started_as_the_kill_went_out_is_requeued_not_failed(monkeypatch: Any) -> None:
    """The orphan's COMPUTE_DONE already in the socket when the kill is sent starts the batch behind it, which
    the killed worker never ran: it goes back to the queue with the rest."""
    h = Harness(max_batch=1, orphan_grace_s=0.1)
    await h.engine.start()
    stuck = h.submit(timeout_s=0.05)
    behind = h.submit()
    first = h.worker
    orphan = first.executed[0]

    def kill_after_compute_done() -> None:
        first.compute_done(orphan)  # read before the loss: the batch behind is computing now
        first.killed = True
        first.die()

    monkeypatch.setattr(first, "kill", kill_after_compute_done)
    await h.settle(stuck)

    async def runs_again() -> None:
        while len(h.spawned) < 2 or not h.worker.executed:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(runs_again(), 5)
    assert behind.status != JobStatus.FAILED, behind.error
    h.worker.finish(h.worker.executed[0])
    await h.settle(behind)
    assert behind.status == JobStatus.SUCCEEDED
    await h.close()


async def test_a_real_worker_inside_one_long_step_of_an_ended_job_is_replaced_and_the_next_job_runs(
        daemon_factory: Any) -> None:
    """The review's case on a real daemon: a job past its deadline inside one five-minute step (synthetic), and a
    job behind it for the same model, which used to wait until that step ended."""
    d: Daemon = daemon_factory("--model", "hold=synthetic:compute_ms=300000", "--orphan-grace-s", "1",
                               "--max-batch", "1", "--drain-grace-s", "1", env=ENV)
    [first_pid] = d.worker_pids()
    body = {"model": "hold", "prompt": "one long step", "width": 64, "height": 64, "steps": 1}
    async with client(d.socket) as s:
        stuck = await submit(s, {**body, "timeout_s": 1})
        behind = await submit(s, body)

        async def behind_runs_on_a_new_worker() -> bool:
            job = await job_state(s, behind["id"])
            assert job["status"] in ("queued", "running"), job
            return job["status"] == "running" and first_pid not in d.worker_pids()

        await until(behind_runs_on_a_new_worker, 60, "the job behind to run on the worker that replaced the stuck one")
        ended = await job_state(s, stuck["id"])
        assert ended["status"] == "failed" and ended["error"]["code"] == "deadline_exceeded", ended
        assert gone(first_pid)
        assert "still computes batch" in d.log() and "wait for hold: killing it" in d.log()
        async with s.delete(f"/v1/jobs/{behind['id']}?finished=keep") as r:  # its worker goes the same way
            assert r.status == 200, await r.text()
