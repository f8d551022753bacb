"""``generate`` following its job: progress (and previews) from the job's events, through a daemon that stops
and starts again meanwhile.

A daemon stopped by SIGTERM (a restart, ``systemctl restart``, a reboot) keeps its queued and running jobs in
the state dir and runs them when it starts again (docs/architecture.md, "Durable jobs"). A ``generate``
following one of them used to end there, telling the user to start a daemon, and the output it was waiting
for was never written. Now it waits a bounded time for the daemon to come back, follows the
job again, and writes its output as if nothing had happened; if none comes back, it names the job so the
user can fetch the result later.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from diffusiond.client import AsyncClient, ClientTimeout, DaemonError, DaemonUnreachable
from diffusiond.commands.preview import PreviewPane
from diffusiond.commands.progress import ProgressBar
from diffusiond.protocol import ErrorCode, Event

RECONNECT_S = 60.0
"""How long ``generate`` waits for a daemon it lost while following a job: a restart of a daemon with a
few models loads them within it; a daemon that does not come back is reported with the job's id."""
PROBE_S = 5.0
"""Bound on each ask while waiting: a socket that accepts and never answers is no daemon back."""
RECONNECTS = 5
"""Losses in one run before giving up at once: a daemon that keeps crashing is no restart to wait out."""


class LostDaemon(Exception):
    """The daemon went away while ``generate`` followed job ``job_id`` and did not come back in time."""

    def __init__(self, job_id: str, finished: bool = False) -> None:
        self.job_id = job_id
        self.finished = finished
        super().__init__(job_id, finished)

    def __str__(self) -> str:
        return lost_daemon(self.job_id, self.finished)


def lost_daemon(job_id: str, finished: bool = False) -> str:
    """What to tell a user whose daemon went away after it took their job. Not "start one": it answered a
    moment ago, and the job is likely still there. No library's exception text either: aiohttp's words about
    transfer lengths tell a user nothing they can act on."""
    if finished:
        return (f"lost the daemon while fetching the outputs of job {job_id}, which had finished: "
                f"`diffusiond history` once it is back, or GET /v1/jobs/{job_id}/outputs/0")
    return (f"lost the daemon while following job {job_id} (it may be stopping or restarting; a queued or "
            f"running job resumes when it starts again): `diffusiond history`, or GET /v1/jobs/{job_id}")


def _lost(exc: Exception) -> bool:
    """Whether ``exc`` says the daemon is going or gone, rather than refusing something."""
    if isinstance(exc, DaemonUnreachable):
        return True
    return isinstance(exc, DaemonError) and (exc.code == "stream_ended" or (
        exc.status == 503 and exc.code == ErrorCode.UNAVAILABLE))


async def follow(client: AsyncClient, job_id: str, bar: ProgressBar, timeout: float | None = None,
                 pane: PreviewPane | None = None) -> dict[str, Any]:
    """The job's final state, following its events (drawing progress and previews) and, when the daemon
    goes away, waiting up to ``RECONNECT_S`` for it to come back (LostDaemon if it does not). ``timeout``
    bounds the whole, waits included (ClientTimeout)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(RECONNECTS + 1):  # a daemon said to be back is followed again
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return await follow_events(client, job_id, bar, left, pane)
        except (DaemonUnreachable, DaemonError) as exc:
            if not _lost(exc):
                raise
        bar.close()
        if attempt == RECONNECTS:
            break
        print(f"lost the daemon while following job {job_id}; it may be stopping or restarting: waiting up to "
              f"{RECONNECT_S:g} s for it to come back", file=sys.stderr, flush=True)
        await _back(client, job_id, deadline)
        print(f"the daemon is back; following job {job_id} again", file=sys.stderr, flush=True)
    raise LostDaemon(job_id)


async def _back(client: AsyncClient, job_id: str, deadline: float | None) -> None:
    """Return once the daemon answers for the job again; LostDaemon after ``RECONNECT_S``, ClientTimeout
    past ``deadline``, and a DaemonError saying so where it came back without the job."""
    give_up = time.monotonic() + RECONNECT_S
    while True:
        if deadline is not None and time.monotonic() >= deadline:
            raise ClientTimeout(client.socket_path, f"waiting for job {job_id}", None)
        try:
            async with asyncio.timeout(PROBE_S):
                await client.job(job_id)
            return
        except (DaemonUnreachable, ClientTimeout, TimeoutError):
            pass
        except DaemonError as exc:
            if exc.status == 404:
                raise DaemonError(exc.status, exc.code, f"the daemon came back without job {job_id}: it keeps no "
                                  "jobs across a restart when run with --no-persist, nor edits (their input "
                                  "picture is not kept), and another --state-dir holds other jobs") from None
            if not _lost(exc):
                raise
        if time.monotonic() >= give_up:
            raise LostDaemon(job_id)
        await asyncio.sleep(1.0)


async def follow_events(client: AsyncClient, job_id: str, bar: ProgressBar, timeout: float | None = None,
                        pane: PreviewPane | None = None) -> dict[str, Any]:
    """Wait for the job's end through its events, drawing progress (and previews); returns the final job."""

    def draw(name: str, data: dict[str, Any]) -> None:
        if name == Event.PREVIEW:
            if pane is not None:
                pane.show(data)
        elif name == Event.PROGRESS:
            step, total = data.get("step"), data.get("total")
            steps = (step if isinstance(step, int) else None, total if isinstance(total, int) else None)
            bar.update(*steps, stage="computing")  # steps only come while computing
        elif name == Event.STATUS:
            bar.update_from_job(data)
        elif name == Event.DONE:
            bar.complete()

    async def ticking() -> None:  # a stage that lasts with no event still gets its line (progress.py)
        while True:
            await asyncio.sleep(1.0)
            bar.tick()

    ticker = asyncio.create_task(ticking())
    try:
        return await client.wait(job_id, timeout=timeout, on_event=draw)
    finally:
        ticker.cancel()
