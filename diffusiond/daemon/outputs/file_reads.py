"""Reads of the files a durable job keeps in the state dir, against DELETE and retention removing them.

Every such read (an output's file, a saved trajectory array, a saved sound track) goes through ``FileReads.read``:
one that starts after its job's deletion began is refused, one under way keeps retention off its job until its
next pass (``state/history.py``), and a file gone meanwhile is a 404 naming the output, never a 500. A file whose
size is not the one its record holds is a ``500 state_failed`` naming it: the daemon writes its files whole, so
only damage from outside (a truncation, a file put in its place) makes them differ, and a short body served as
a 200 would pass for the output (review45-b 8).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from diffusiond.daemon.errors import OutputNotFound, StateWriteFailed
from diffusiond.daemon.state.store import Store

log = logging.getLogger(__name__)


class FileReads:
    def __init__(self, executor: Executor, store: Store) -> None:
        self.executor = executor
        self.store = store
        self.reading: dict[str, int] = {}  # job id -> reads of its files under way
        self.deleting: set[str] = set()  # jobs being deleted: no new read starts

    async def read(self, job_id: str, file: str, what: str, size: int | None) -> bytes:
        """The whole file; ``what`` names it for the 404 (``output 0``, ``the latents of output 0``), ``size`` is
        its size as recorded when it was written (None: not known, not checked)."""
        if job_id in self.deleting:
            raise OutputNotFound(f"{what} of job {job_id} is being deleted")
        self.reading[job_id] = self.reading.get(job_id, 0) + 1
        try:
            data: bytes = await asyncio.get_running_loop().run_in_executor(self.executor, self.store.read_output, file)
        except FileNotFoundError:
            raise OutputNotFound(f"the file of {what} of job {job_id} is gone from the state dir (deleted, or its "
                                 "retention ended)") from None
        finally:
            self.reading[job_id] -= 1
            if not self.reading[job_id]:
                del self.reading[job_id]
        if size is not None and len(data) != size:
            path = self.store.root / "outputs" / file if self.store.root is not None else file
            log.warning("%s (%s of job %s) has %d bytes, not the %d it was written with: damaged outside diffusiond",
                        path, what, job_id, len(data), size)
            raise StateWriteFailed(
                f"the file of {what} of job {job_id}, {path}, is damaged: it has {len(data)} bytes, not the {size} "
                f"it was written with (truncated or replaced outside diffusiond); restore it, or delete the job "
                f"(DELETE /v1/jobs/{job_id}) and submit it again")
        return data
