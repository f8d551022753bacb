"""Input images on their way to a worker: one sealed memfd per job, passed by SCM_RIGHTS.

The output path keeps bulk data out of frames (the arena); inputs do the same the other way. The
engine decodes an edit's image (and mask) once, at admission, into an ``InputBuffer``: a memfd
holding the uint8 arrays back to back, written with ``pwrite`` (never mapped writable) and then
sealed against any change (write, grow, shrink, and further seals). An EXECUTE frame carries a
duplicate of the fd for each job in the batch, and the requests' ``InputRef`` say where in it
their arrays lie. The worker maps it read-only, copies the arrays out and closes it at once, so a
job's input costs one decode and one copy, however many outputs it has and wherever it runs.

The seals mean the worker reads exactly what admission validated: nothing that holds the fd (the
engine included) can change the bytes after the fact. memfd memory has no name and is freed by the
kernel when the last fd and mapping go, so a crash on either side leaks nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Sequence

import numpy as np

from diffusiond.ipc.arena import ALIGN, memfd
from diffusiond.ipc.errors import ArenaError
from diffusiond.ipc.input_refs import InputRef
from diffusiond.ipc.tensors import TensorDesc, as_numpy

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


class InputBuffer:
    """An edit's input image and optional mask in a sealed memfd (the engine's side)."""

    def __init__(self, image: np.ndarray | None, mask: np.ndarray | None = None, *,
                 controls: Sequence[np.ndarray] = (), references: Sequence[np.ndarray] = (),
                 pictures: Sequence[np.ndarray] = (), name: str = "diffusiond-input") -> None:
        """``image`` None: a text-to-image request that brings ControlNet images (``controls``) or
        IP-Adapter reference images (``references``) only. ``pictures``: an edit's input pictures before
        ``image``, for a model that takes several."""
        self.name = name
        given = [a for a in (image, mask, *controls, *references, *pictures) if a is not None]
        arrays = [np.ascontiguousarray(a, dtype=np.uint8) for a in given]
        descs: list[TensorDesc] = []
        offset = 0
        for a in arrays:
            descs.append(TensorDesc(dtype="uint8", shape=tuple(a.shape), nbytes=a.nbytes, slot_id=0, offset=offset))
            offset += (a.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.nbytes = max(offset, 1)
        self.fd = memfd(name, self.nbytes)
        try:
            for a, d in zip(arrays, descs, strict=True):
                view = memoryview(a.tobytes()) if not a.flags.c_contiguous else memoryview(a.data).cast("B")
                done = 0
                while done < len(view):
                    done += os.pwrite(self.fd, view[done:], d.offset + done)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(self.fd)
            raise
        it = iter(descs)
        self.image = next(it) if image is not None else None
        self.mask = next(it) if mask is not None else None
        self.controls = tuple(next(it) for _ in controls)
        self.references = tuple(next(it) for _ in references)
        self.pictures = tuple(it)

    def ref(self, fd_index: int) -> InputRef:
        """The descriptor a request carries when this buffer is fd ``fd_index`` of its frame."""
        return InputRef(fd=fd_index, image=self.image, mask=self.mask, controls=self.controls,
                        references=self.references, pictures=self.pictures)

    def with_references(self, references: Sequence[np.ndarray]) -> InputBuffer:
        """A new sealed buffer holding this one's arrays and then ``references``: a job's input travels
        as one fd, so an edit's image and mask, or control images, share it with the job's IP-Adapter
        reference images. Read back from the memfd (already sealed), so the copy is what was validated."""
        ref = self.ref(0)
        own = _sealed_view([self.fd], ref, [d for d in (ref.image, ref.mask) if d is not None])
        image = own[0] if ref.image is not None else None
        mask = own[-1] if ref.mask is not None else None
        return InputBuffer(image, mask, controls=read_controls([self.fd], ref),
                           references=[*read_references([self.fd], ref), *references],
                           pictures=read_pictures([self.fd], ref), name=self.name)

    def dup(self) -> int:
        """A new fd for one frame (the channel closes it once sent, whatever becomes of the job)."""
        if self.fd < 0:
            raise ArenaError("input buffer is closed")
        return os.dup(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _sealed_view(fds: Sequence[int], ref: InputRef, descs: Sequence[TensorDesc]) -> list[np.ndarray]:
    """Copies of ``descs`` in the memfd ``ref`` names, refusing memory not sealed against writes: the
    worker must compute on what the engine validated, not on bytes someone may still change."""
    if not 0 <= ref.fd < len(fds):
        raise ArenaError(f"input refers to fd {ref.fd}; the frame brought {len(fds)}")
    fd = fds[ref.fd]
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if not seals & fcntl.F_SEAL_WRITE:
        raise ArenaError("input memory is not sealed against writes")
    size = os.fstat(fd).st_size
    need = max((d.offset + d.nbytes for d in descs), default=0)
    if need > size:
        raise ArenaError(f"input descriptor needs {need} bytes; the memfd holds {size}")
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            return [as_numpy(view, d).copy() for d in descs]
        finally:
            view.release()


def read_inputs(fds: Sequence[int], ref: InputRef) -> tuple[np.ndarray, np.ndarray | None]:
    """The worker's side: copies of an edit's image and mask that ``ref`` points at in ``fds``."""
    if ref.image is None:
        raise ArenaError("an edit's input came without its image")
    arrays = _sealed_view(fds, ref, [ref.image] if ref.mask is None else [ref.image, ref.mask])
    return arrays[0], arrays[1] if ref.mask is not None else None


def read_controls(fds: Sequence[int], ref: InputRef) -> list[np.ndarray]:
    """The worker's side: copies of a request's ControlNet images, in its ``controls`` order."""
    return _sealed_view(fds, ref, ref.controls)


def read_references(fds: Sequence[int], ref: InputRef) -> list[np.ndarray]:
    """The worker's side: copies of a request's IP-Adapter reference images, in its ``ip_adapters`` order."""
    return _sealed_view(fds, ref, ref.references)


def read_pictures(fds: Sequence[int], ref: InputRef) -> list[np.ndarray]:
    """The worker's side: copies of an edit's input pictures before its image, in the request's order."""
    return _sealed_view(fds, ref, ref.pictures)
