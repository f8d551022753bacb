"""The engine's methods for reading what jobs made: outputs, trajectories and previews, by job and index.

The HTTP edge and the output socket reach outputs only through the engine (``Engine`` inherits these),
never through ``Outputs`` itself; they live here so that ``engine.py`` stays the loop and its lifecycle.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from diffusiond.daemon.core.jobs import Item, Job, Preview
from diffusiond.daemon.errors import JobNotFound, OutputNotFound, PreviewNotFound
from diffusiond.daemon.outputs.slots import OutputRead, Outputs
from diffusiond.ipc.tensors import TensorDesc


class OutputAccess:
    """Mixed into ``Engine``, which sets ``jobs`` and ``outputs``."""

    jobs: dict[str, Job]
    outputs: Outputs

    def get(self, job_id: str) -> Job:
        """A job still in memory (one not yet finished always is)."""
        try:
            return self.jobs[job_id]
        except KeyError:
            raise JobNotFound(f"no job {job_id!r} (unknown, or its retention ended)") from None


    def open_output(self, job: Job, k: int) -> AbstractAsyncContextManager[OutputRead]:
        """Read output ``k`` of ``job`` (see ``Outputs.open``)."""
        return self.outputs.open(self._item(job, k))

    def readable_output(self, job: Job, k: int) -> Item:
        """Output ``k`` of ``job`` if a read of it would start (``Outputs.check_readable``), opening nothing:
        HEAD answers from it, and leaves an npy's one delivery for the GET."""
        item = self._item(job, k)
        self.outputs.check_readable(item)
        return item

    def lease_output(self, job_id: str, k: int) -> tuple[Item, TensorDesc, int, int]:
        """Pin output ``k`` of a job for a local client that maps it (the output socket)."""
        item = self._item(self.get(job_id), k)
        return (item, *self.outputs.lease(item))

    def end_lease(self, item: Item) -> None:
        self.outputs.unlease(item)

    def open_trajectory(self, job: Job, k: int, name: str) -> AbstractAsyncContextManager[tuple[bytes, memoryview]]:
        """Read one array of output ``k``'s trajectory: an npy header and its bytes (``Trajectories.open``)."""
        return self.outputs.trajectories.open(self._item(job, k), name)

    def lease_trajectory(self, job_id: str, k: int,
                         audio: bool = False) -> tuple[Item, TensorDesc, dict[str, TensorDesc], int, int]:
        """Pin output ``k``'s trajectory (``audio``: its sound track, in the same memory) for a local client
        that maps it (the output socket)."""
        item = self._item(self.get(job_id), k)
        return (item, *self.outputs.trajectories.lease(item, audio))

    def end_trajectory_lease(self, item: Item) -> None:
        self.outputs.trajectories.unlease(item)

    async def output_bytes(self, job: Job) -> list[bytes]:
        """Every output of a finished job as bytes, for a caller that will not come back for
        them (the synchronous endpoint): what they held in memory is released at once."""
        try:
            return [await self.outputs.read_all(i) for i in job.items]
        finally:
            self.release_outputs(job)

    def release_outputs(self, job: Job) -> None:
        """Give back what a finished job's outputs hold in memory now, for a caller that will not
        fetch them (a synchronous request answered with another job's failure)."""
        self.outputs.expire(job)

    def preview(self, job_id: str, k: int) -> Preview:
        """The latest preview of output ``k`` of a job."""
        job = self.get(job_id)
        item = self._item(job, k)
        if item.preview is None:
            why = ("it did not ask for previews" if job.request.preview is None
                   else f"its first comes after step {job.request.preview.every}")
            raise PreviewNotFound(f"output {k} of job {job_id} has no preview yet ({why})")
        return item.preview

    def _item(self, job: Job, k: int) -> Item:
        if not 0 <= k < len(job.items):
            raise OutputNotFound(f"job {job.id} has outputs 0..{len(job.items) - 1}")
        return job.items[k]
