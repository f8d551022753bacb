"""A sleep that fails (a worker could not move its model off the device), against the engine with fake workers.

The daemon stays asleep at that level (api.md): its answer must say so and how to get out, with the worker's own
reason. It said ``sleep failed on 1 worker(s): Ack(command=<Kind.SLEEP: 5>, ok=False, message=..., trace=[], ...)``
(or nothing after the colon for a timeout), and nothing of the daemon being left asleep: a client that read the 500 as
"still awake" saw its jobs wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from enginekit import FakeWorker, Harness, until

from diffusiond.daemon.edge import views
from diffusiond.daemon.errors import PowerFailed
from diffusiond.ipc.messages import KIND_OF, Ack, Sleep
from diffusiond.protocol import ErrorCode, JobStatus


@pytest.fixture
def sleep_fails(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Workers refuse SLEEP (their weights put back, as a real one's after a failed move) while the list holds True."""
    failing = [True]
    plain = FakeWorker.command

    async def command(self: FakeWorker, msg: Any, timeout: float, fds: Sequence[int] = ()) -> Ack:
        if isinstance(msg, Sleep) and failing[0]:
            self.commands.append(msg)
            return Ack(KIND_OF[Sleep], False, message="sleep failed: RuntimeError: CUDA error: unspecified launch")
        return await plain(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "command", command)
    return failing


async def test_a_failed_sleep_says_the_daemon_stays_asleep_and_a_wake_brings_its_jobs_back(
        sleep_fails: list[bool]) -> None:
    h = Harness(max_batch=1)
    await h.engine.start()
    try:
        with pytest.raises(PowerFailed) as failed:
            await h.engine.sleep(1)
        message = failed.value.message
        assert failed.value.code == ErrorCode.SLEEP_FAILED
        assert f"{h.worker.name}: sleep failed: RuntimeError: CUDA error" in message and "Ack(" not in message
        assert "asleep at level 1" in message and "diffusiond wake" in message, message
        health = views.health(h.engine)
        assert health["sleeping"] and health["sleep_level"] == 1, "the state the answer names is the one /health shows"

        job = h.submit()  # admitted, and waits for the wake
        await h.settle()
        assert not h.worker.executed and not job.terminal
        await h.engine.wake()  # the way out: the worker whose sleep failed is awake still, and takes the job
        await until(lambda: bool(h.worker.executed))
        h.worker.finish(h.worker.executed[0])
        await h.settle(job)
        assert job.status == JobStatus.SUCCEEDED and not views.health(h.engine)["sleeping"]

        sleep_fails[0] = False  # and a sleep after it works
        assert (await h.engine.sleep(1))["level"] == 1
        await h.engine.wake()
    finally:
        await h.close()
