"""Side regions (issues 29, 30): an output's trajectory and sound track, in shared memory beside it.

A side region is held, pinned and given back apart from its output's slot: an encoded output's slot goes
back as soon as it is encoded, while its trajectory stays for the job's retention (a trainer maps or fetches
it later), and an LTX-2 output's sound track must outlive the encoder that muxes it. So it has its own
owner, which ``slots.Outputs`` holds as ``trajectories``: every side region goes back to its worker from
here, now or (while pinned) at the last unpin. A region that holds room a worker needs is spilled (copied
once into engine memory, off the loop); one a durable job saved in the state dir is read from its files
(``trajectory_files.py``) once memory no longer holds it.

``pin``, ``unpin`` and ``view`` are what another reader of a region (the mp4 encoder's sound track in
``sound.py``) needs, so none reaches into this class.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any

from diffusiond.daemon.core.jobs import Item
from diffusiond.daemon.errors import NotShared, OutputNotFound, OutputReleased
from diffusiond.daemon.outputs import trajectory_files
from diffusiond.daemon.outputs.encoders import npy_header
from diffusiond.daemon.outputs.file_reads import FileReads
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.ipc.sidearrays import TrajectoryDesc
from diffusiond.ipc.tensors import TensorDesc, numpy_dtype
from diffusiond.protocol import AUDIO_ARRAY, SIDE_ARRAYS, TRAJECTORY_ARRAYS

log = logging.getLogger(__name__)


class Trajectories:
    def __init__(self, executor: Executor, files: FileReads) -> None:
        self.executor = executor
        self.files = files
        self.store = files.store
        self.held: set[Item] = set()  # items whose side region holds shared memory
        self._spilling: set[Item] = set()  # regions being copied out of it

    def hold(self, item: Item, trajectory: TrajectoryDesc) -> None:
        """The item's side region landed in shared memory with its output: it is ours until ``free``."""
        item.trajectory = trajectory
        self.held.add(item)

    @asynccontextmanager
    async def open(self, item: Item, name: str) -> AsyncIterator[tuple[bytes, memoryview]]:
        """One array of an output's trajectory as an npy header and its bytes, pinned while read.
        Unlike an npy output it is not consumed: it stays until the job's retention ends."""
        desc = self._array(item, name)
        if desc is None:  # no longer in memory, saved in the state dir
            yield b"", memoryview(await trajectory_files.read(item, name, self.files))
            return
        self.pin(item)
        payload = self.view(item, desc)
        try:
            yield npy_header(numpy_dtype(desc.dtype), desc.shape), payload
        finally:
            payload.release()
            self.unpin(item)

    async def save(self, item: Item) -> None:
        """Write the item's arrays beside its output's file (a durable job's: ``trajectory_files.py``)."""
        self.pin(item)
        try:
            await trajectory_files.write(item, lambda desc: self.view(item, desc), self.executor, self.store)
        finally:
            self.unpin(item)

    def lease(self, item: Item, audio: bool = False) -> tuple[TensorDesc, dict[str, TensorDesc], int, int]:
        """Pin a trajectory for a program on this machine that maps it: its region, its arrays, the fd
        they lie in and its size. It goes back at ``unlease`` only if the job's retention ended
        meanwhile: a trajectory may be mapped again, as long as the job is kept."""
        traj = self._region(item, audio)
        if traj is None:
            raise NotShared(f"the side arrays of output {item.index} of job {item.job.id} are not in shared memory "
                            "(spilled under arena pressure, or kept in the state dir); fetch its arrays over HTTP")
        assert item.worker is not None
        shared = item.worker.share(traj.region)
        if shared is None:
            raise NotShared("this kernel cannot seal shared memory against writes (Linux 5.1+), so "
                            "trajectories are not handed out by fd; fetch them over HTTP")
        self.pin(item)
        return traj.region, dict(traj.arrays), *shared

    def unlease(self, item: Item) -> None:
        self.unpin(item)

    def _region(self, item: Item, audio: bool = False) -> TrajectoryDesc | None:
        """The item's side region while in shared memory (None once spilled), for its trajectory or (``audio``)
        its sound track, which share it (ipc/sidearrays.py); errors name what is missing."""
        item.check_ready()
        job = item.job
        if audio and not job.request.audio_rate:
            raise OutputNotFound(f"job {job.id} has no sound track (its model makes none, or it was sent with "
                                 "\"audio\": false)")
        if not audio and job.request.trajectory is None:
            raise OutputNotFound(f"job {job.id} asked for no trajectory; send \"trajectory\": "
                                 "{\"latents\": true, \"log_probs\": true} with the job")
        if item.trajectory is None and item.trajectory_data is None and not item.trajectory_files:
            raise OutputReleased(f"the {'sound track' if audio else 'trajectory'} of output {item.index} of job "
                                 f"{job.id} is no longer kept (its retention ended, or the daemon restarted without "
                                 "a state dir to keep it)")
        return item.trajectory if item.trajectory_data is None else None

    def _array(self, item: Item, name: str) -> TensorDesc | None:
        """The array's place in memory; None when only its file in the state dir holds it."""
        if name not in SIDE_ARRAYS:
            raise OutputNotFound(f"a trajectory has no array {name!r}; its arrays are {', '.join(TRAJECTORY_ARRAYS)}")
        self._region(item, audio=name == AUDIO_ARRAY)
        arrays = item.trajectory.arrays if item.trajectory is not None else trajectory_files.listed(item)
        if name not in arrays:
            raise OutputNotFound(f"the trajectory of job {item.job.id} has no {name} (its request left them out); "
                                 f"it has {', '.join(arrays)}")
        return item.trajectory.arrays[name] if item.trajectory is not None else None

    def view(self, item: Item, desc: TensorDesc) -> memoryview:
        """The bytes of one of the item's side arrays (in the arena, or spilled); pin the item while it is used."""
        assert item.trajectory is not None
        if item.trajectory_data is not None:
            start = desc.offset - item.trajectory.region.offset
            return memoryview(item.trajectory_data)[start : start + desc.nbytes]
        assert item.worker is not None
        return item.worker.buffer(desc)[desc.offset : desc.offset + desc.nbytes]

    def pin(self, item: Item) -> None:
        item.trajectory_pins += 1

    def unpin(self, item: Item) -> None:
        item.trajectory_pins -= 1
        if item.trajectory_pins == 0 and item.trajectory_release_pending:
            item.trajectory_release_pending = False
            self.free(item)

    def free(self, item: Item) -> None:
        """Forget the item's trajectory and give its region back to its worker (unless spilled, when it
        went back already), now or (while pinned) at the last unpin."""
        if item.trajectory is None:
            return
        if item.trajectory_pins:
            item.trajectory_release_pending = True
            return
        traj, spilled = item.trajectory, item.trajectory_data is not None
        item.trajectory = item.trajectory_data = None
        self.held.discard(item)
        if not spilled and item.worker is not None:
            item.worker.return_slot(traj.region)

    def spillable(self, worker: WorkerLink) -> list[Item]:
        """The worker's regions that spilling would free arena room of, oldest first."""
        items = [i for i in self.held if i.worker is worker and i.done and not i.trajectory_pins
                 and i not in self._spilling and i.trajectory is not None
                 and not i.trajectory.region.dedicated]  # its own memfd frees no arena
        return sorted(items, key=lambda i: i.enqueued_at)

    def regions(self, worker: WorkerLink) -> list[tuple[Item, TensorDesc]]:
        """The worker's arena ranges that regions held here take (those being spilled free theirs by themselves)."""
        return [(i, i.trajectory.region) for i in self.held if i.worker is worker and i.trajectory is not None
                and i.trajectory_data is None and not i.trajectory.region.dedicated and i not in self._spilling]

    def spill(self, item: Item) -> Coroutine[Any, Any, None]:
        """Copy a trajectory out of the arena (it held room a worker needs); HTTP reads it from here on. Marked as
        being spilled now, so that no later choice takes it again; copied by the coroutine, a loop iteration later."""
        self._spilling.add(item)
        return self._spill(item)

    async def _spill(self, item: Item) -> None:
        if item.trajectory is None or item.trajectory_data is not None:
            self._spilling.discard(item)  # given back since it was chosen (retention, the engine stopping)
            return
        assert item.worker is not None
        region = item.trajectory.region
        item.trajectory_pins += 1
        try:
            view = item.worker.buffer(region)[region.offset : region.offset + region.nbytes]
            try:
                data = await asyncio.get_running_loop().run_in_executor(self.executor, view.tobytes)
            finally:
                view.release()
        finally:
            item.trajectory_pins -= 1
            self._spilling.discard(item)
        if item.trajectory_pins == 0 and item.trajectory_release_pending:
            item.trajectory_release_pending = False
            self.free(item)
            return
        if item.trajectory is None or item.trajectory_data is not None or item.trajectory_pins:
            return  # gone meanwhile, or mapped by a lease now: it stays where it is
        item.trajectory_data = data
        self.held.discard(item)
        item.worker.return_slot(region)
        log.info("spilled the trajectory of %s (%d bytes) out of the arena", item.request_id, len(data))
