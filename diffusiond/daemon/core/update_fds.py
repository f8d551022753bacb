"""The memfds an update comes in (its parts, issue 29), checked before any worker reads them: how many, each a
sealed memfd the workers can read, and each one's size, which bounds the tensors the header places in it.

Apart from ``weights.py``, which checks the header against these sizes.
"""

from __future__ import annotations

import fcntl
import os
import stat

from diffusiond.daemon.errors import InvalidRequest
from diffusiond.ipc.updates import MAX_PARTS, SEALS


def part_sizes(fds: list[int]) -> list[int]:
    """The size of each of an update's memfds; a count outside 1..MAX_PARTS or an fd that is no file is refused."""
    if not 1 <= len(fds) <= MAX_PARTS:
        raise InvalidRequest(f"an update carries 1 to {MAX_PARTS} memfds (its parts); this one came with "
                             f"{len(fds)}", field="fd")
    sizes = []
    for i, fd in enumerate(fds):
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise InvalidRequest(f"the update's fd {i} cannot be read: {exc.strerror or exc}", field="fd") from None
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"the update's fd {i} is not a memfd (a pipe or socket cannot be read at an "
                                 "offset)", field="fd")
        _readable(fd, i)
        how = ("make it with memfd_create(MFD_ALLOW_SEALING) and, once written, seal it (fcntl F_ADD_SEALS with "
               "F_SEAL_SHRINK | F_SEAL_WRITE), as diffusiond.Client does; the workers read it after the call, and a "
               "worker started later reads it again")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # a file on disk: it cannot be sealed
            raise InvalidRequest(f"the update's fd {i} is a file, not a memfd: {how}", field="fd") from None
        if seals & SEALS != SEALS:
            raise InvalidRequest(f"the update's memfd {i} is not sealed against writes and shrinking: {how}",
                                 field="fd")
        sizes.append(os.fstat(fd).st_size)  # read once sealed: a size read before could still shrink
    return sizes


def _readable(fd: int, i: int) -> None:
    """Refuse an fd the workers cannot read: ``open("/proc/self/fd/N", O_WRONLY)`` of a sealed memfd
    passes every other check, and its first read in a worker fails."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & getattr(os, "O_PATH", 0):
        raise InvalidRequest(f"the update's fd {i} cannot be read (opened with O_PATH): send the memfd itself, as "
                             "memfd_create returns it", field="fd")
    if flags & os.O_ACCMODE == os.O_WRONLY:
        raise InvalidRequest(f"the update's fd {i} was opened write-only, and the workers read it: send the memfd "
                             "itself, as memfd_create returns it (read and write), or one opened for reading",
                             field="fd")
