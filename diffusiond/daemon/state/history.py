"""Jobs as a client meets them later: found in memory or in the state dir, paged through newest
first, deleted, and let go by retention.

Apart from the engine core because none of it touches the loop's work (queue, workers, slots): it
reads the engine's job table and the store, and ends a job only through the engine's own
``cancel`` and ``expire``. Deleting and reading never race: a job being deleted is marked in
``Outputs.files.deleting`` first, so no new read of its files starts, and retention skips a job whose
outputs are being read (``Outputs.files.reading``) until its next pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.core.jobs import Job
from diffusiond.daemon.errors import InsufficientStorage, JobNotFound, StateWriteFailed
from diffusiond.daemon.outputs.slots import Outputs
from diffusiond.daemon.state.store import Page, Store
from diffusiond.protocol import JobStatus

log = logging.getLogger(__name__)


class History:
    def __init__(self, config: DaemonConfig, jobs: dict[str, Job], store: Store, outputs: Outputs, *,
                 cancel: Callable[[str], Job], expire: Callable[[str], None]) -> None:
        self.config = config
        self.jobs = jobs  # the engine's table of jobs in memory (every unfinished one is there)
        self.store = store
        self.outputs = outputs
        self._cancel = cancel
        self._expire = expire
        # set once the start's recovery has taken the unfinished jobs into ``jobs`` (``resume.recover``)
        self.recovered = asyncio.Event()

    async def find(self, job_id: str) -> Job:
        """A job in memory, else (a finished one) from the state dir."""
        job = self.jobs.get(job_id)
        if job is None and job_id not in self.outputs.files.deleting:
            job = await self.store.load(job_id)
            if job is not None and not job.terminal:
                # unfinished on disk: the start's recovery is taking it into memory (the socket answers before
                # that ends). Its copy from disk would never change: a client following its events after a
                # restart waited for an end that only the copy in memory reached
                await self.recovered.wait()
                job = self.jobs.get(job_id, job)
        if job is None or job.id in self.outputs.files.deleting:
            raise JobNotFound(f"no job {job_id!r} (unknown, deleted, or its retention ended)")
        return job

    async def page(self, status: JobStatus | None, model: str | None, before: str | None, limit: int) -> Page:
        """Jobs newest first; ``before`` (a job id) continues a page. Jobs in memory are shown as
        they are now, which may be ahead of their record."""
        if not self.store.persistent:
            jobs = sorted(self.jobs.values(), key=lambda j: j.created, reverse=True)
            if before is not None:
                ids = [j.id for j in jobs]
                jobs = jobs[ids.index(before) + 1:] if before in ids else []
            jobs = [j for j in jobs if (status is None or j.status == status)
                    and (model is None or j.request.model == model)]
            return Page(jobs[:limit], jobs[limit - 1].id if len(jobs) > limit else None)
        page = await self.store.page(status.value if status else None, model, before, limit)
        return Page([self.jobs.get(j.id, j) for j in page.jobs], page.next_before)

    async def remove(self, job_id: str) -> tuple[Job, bool]:
        """DELETE: cancel a job that has not finished; forget a finished one, record and outputs.
        Returns the job and whether it was deleted."""
        job = await self.find(job_id)
        if not job.terminal:
            return self._cancel(job_id), False
        await self._delete(job)
        return job, True

    async def _delete(self, job: Job) -> None:
        self.outputs.files.deleting.add(job.id)  # from here on nobody starts reading it
        try:
            self._expire(job.id)
            await self.store.delete(job)
        finally:
            self.outputs.files.deleting.discard(job.id)

    async def retain_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.retention_check_s)
            try:
                await self.retain()
            except Exception:
                log.exception("the retention pass failed; it runs again in %gs", self.config.retention_check_s)

    async def retain(self) -> int:
        """Delete finished jobs past ``keep_days`` or beyond ``keep_gb``, oldest first, except
        those whose outputs a client is reading right now (the next pass takes them)."""
        deleted, failed = 0, []
        for job in await self.store.expired(self.config.keep_days, int(self.config.keep_gb * 1e9)):
            if self.outputs.files.reading.get(job.id):
                continue
            try:
                await self._delete(job)
            except (InsufficientStorage, StateWriteFailed) as exc:
                # on to the next: on a full disk each job's files go before its record, so the later ones
                # make the room the earlier ones' records needed
                failed.append(exc.message)
                continue
            deleted += 1
        if deleted:
            log.info("retention deleted %d finished job(s) and their outputs", deleted)
        if failed:
            log.warning("retention could not delete %d finished job(s) (%s); it tries again in %gs", len(failed),
                        failed[0], self.config.retention_check_s)
        return deleted
