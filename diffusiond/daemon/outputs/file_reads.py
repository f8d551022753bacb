"""Reads of the files a durable job keeps in the state dir, against DELETE and retention removing them.

Every such read (an output's file, a saved trajectory array, a saved sound track) goes through ``FileReads.read``
(the whole file) or ``FileReads.open`` (an output sent over HTTP a piece at a time): one that starts
after its job's deletion began is refused, one under way keeps retention off its job until its next pass
(``state/history.py``), and a file gone meanwhile is a 404 naming the output, never a 500. A file whose
size is not the one its record holds is a ``500 state_failed`` naming it: the daemon writes its files whole, so
only damage from outside (a truncation, a file put in its place) makes them differ, and a short body served as
a 200 would pass for the output.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from pathlib import Path

from diffusiond.daemon.errors import OutputNotFound, StateWriteFailed
from diffusiond.daemon.state.store import Store

log = logging.getLogger(__name__)


class FileReads:
    def __init__(self, executor: Executor, store: Store) -> None:
        self.executor = executor
        self.store = store
        self.reading: dict[str, int] = {}  # job id -> reads of its files under way
        self.deleting: set[str] = set()  # jobs being deleted: no new read starts

    @asynccontextmanager
    async def open(self, job_id: str, file: str, what: str, size: int | None) -> AsyncIterator[FileRead]:
        """The file, open, for a read in pieces; counted in ``reading`` until the block ends (the whole response,
        so retention leaves its job alone meanwhile). Its size is checked before a byte is sent."""
        self._start(job_id, what)
        try:
            opening = self.executor.submit(_open, self._path(file))
            try:
                fd, actual = await asyncio.wrap_future(opening)
            except FileNotFoundError:
                raise self._gone(job_id, what) from None
            except asyncio.CancelledError:  # the client left while the pool opened it: close what it opens
                opening.add_done_callback(_close_opened)
                raise
            read = FileRead(self.executor, fd, actual, str(self._path(file)))
            try:
                if size is not None and actual != size:
                    raise self._damaged(job_id, file, what, actual, size)
                yield read
            finally:
                read.close()
        finally:
            self._end(job_id)

    async def read(self, job_id: str, file: str, what: str, size: int | None) -> bytes:
        """The whole file; ``what`` names it for the 404 (``output 0``, ``the latents of output 0``), ``size`` is
        its size as recorded when it was written (None: not known, not checked)."""
        self._start(job_id, what)
        try:
            data: bytes = await asyncio.get_running_loop().run_in_executor(self.executor, self.store.read_output, file)
        except FileNotFoundError:
            raise self._gone(job_id, what) from None
        finally:
            self._end(job_id)
        if size is not None and len(data) != size:
            raise self._damaged(job_id, file, what, len(data), size)
        return data

    def _start(self, job_id: str, what: str) -> None:
        if job_id in self.deleting:
            raise OutputNotFound(f"{what} of job {job_id} is being deleted")
        self.reading[job_id] = self.reading.get(job_id, 0) + 1

    def _end(self, job_id: str) -> None:
        self.reading[job_id] -= 1
        if not self.reading[job_id]:
            del self.reading[job_id]

    def _path(self, file: str) -> Path:
        return self.store.outputs_dir / file if self.store.outputs_dir is not None else Path(file)

    @staticmethod
    def _gone(job_id: str, what: str) -> OutputNotFound:
        return OutputNotFound(f"the file of {what} of job {job_id} is gone from the state dir (deleted, or its "
                              "retention ended)")

    def _damaged(self, job_id: str, file: str, what: str, actual: int, size: int) -> StateWriteFailed:
        path = self._path(file)
        log.warning("%s (%s of job %s) has %d bytes, not the %d it was written with: damaged outside diffusiond",
                    path, what, job_id, actual, size)
        return StateWriteFailed(
            f"the file of {what} of job {job_id}, {path}, is damaged: it has {actual} bytes, not the {size} "
            f"it was written with (truncated or replaced outside diffusiond); restore it, or delete the job "
            f"(DELETE /v1/jobs/{job_id}) and submit it again")


class FileShrank(OSError):
    """A file got shorter while it was sent (truncated outside diffusiond): the client's body is cut."""


class FileRead:
    """An open output file, read a piece at a time off the loop (``pieces``).

    The descriptor is what is read, never the path again: a DELETE of the job or retention's pass that
    unlinks the file while it is read removes its name only, and Linux keeps its bytes until the last
    descriptor closes, so this reader gets all of them and the disk space comes back at ``close``. A
    truncation from outside is a read that comes up short: ``FileShrank``, which cuts the connection."""

    def __init__(self, executor: Executor, fd: int, size: int, path: str) -> None:
        self.executor = executor
        self.fd = fd
        self.size = size
        self.path = path
        self._reading: concurrent.futures.Future[bytes] | None = None  # the read in the pool, if any

    async def pieces(self, piece: int) -> AsyncIterator[bytes]:
        """The file's bytes, ``piece`` at a time, each read once the caller asks for it (no read-ahead)."""
        off = 0
        while off < self.size:
            self._reading = self.executor.submit(os.pread, self.fd, min(piece, self.size - off), off)
            data = await asyncio.wrap_future(self._reading)
            if not data:
                raise FileShrank(f"{self.path} ended at {off} of its {self.size} bytes (truncated outside diffusiond)")
            off += len(data)
            yield data

    def close(self) -> None:
        """Close the descriptor, once a read still running in the pool for a handler that was cancelled is done
        (closed earlier, its number could be another file's by the time ``pread`` runs)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        if self._reading is None:
            os.close(fd)
        else:  # called at once when the read is done (or was cancelled before it started)
            self._reading.add_done_callback(lambda _: os.close(fd))


def _close_opened(opening: concurrent.futures.Future[tuple[int, int]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        os.close(opening.result()[0])


def _open(path: Path) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fd, os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise
