"""Zero-copy outputs for programs on the daemon's machine: map the shared memory an output lies in.

The client side of the output socket (``daemon/edge/handoff.py`` says how the daemon side works and
why it is safe). ``OutputMapper.array(job_id, k)`` asks the daemon for output ``k`` of a job,
receives the file descriptor of the sealed memory it lies in, maps the pages that hold it
read-only, and returns a numpy array over them: no byte is copied between the GPU's copy into
shared memory and your program reading the array (``torch.from_numpy`` keeps it that way).

The daemon keeps that memory for you until every array over it (views and tensors made from it
included) has been garbage-collected: then the mapping is closed and the daemon told. ``close()``
keeps the connection for the arrays still alive, until the last of them goes. If your program
dies, the kernel closes the connection and the daemon takes the memory back.

``OutputMapper.trajectory(job_id, k)`` does the same for the arrays of an output's trajectory
(latents, log_probs, timesteps, sigmas: docs/api.md, "Trajectories"), all over one mapping.

``ZeroCopyUnavailable`` means there is no such path here (a daemon reached over TCP, on another
machine, or of another user): use the HTTP npy stream, as ``diffusiond.Client`` does by itself.

``connect`` and ``receive`` are the output socket's connection and message loop; live updates (``weights.py``)
go over the same socket with them.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Iterator
from typing import Literal

import numpy as np

from diffusiond.client.errors import ClientError, DaemonError
from diffusiond.ipc.channel import recv_with_fds
from diffusiond.ipc.errors import IPCError
from diffusiond.ipc.frames import FrameDecoder, FrameEncoder
from diffusiond.ipc.messages import Fetch, Lease, Refused, Unpin
from diffusiond.ipc.tensors import numpy_dtype
from diffusiond.protocol import default_socket_path, output_socket_path

_PAGE = mmap.ALLOCATIONGRANULARITY
# Map the pages in one go instead of one fault per 4 KiB page on first read: the memory is already
# resident (the worker wrote it), so this only fills page tables, several times faster in bulk.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class ZeroCopyUnavailable(ClientError):
    """No output socket to reach (or it refused us): fetch outputs over HTTP instead."""


class OutputMapper:
    """One connection to a daemon's output socket; safe to share between threads."""

    def __init__(self, socket_path: str | None = None, *, timeout: float | None = 30.0) -> None:
        self.path = output_socket_path(socket_path or default_socket_path())
        try:
            self._sock = connect(self.path, timeout)
        except OSError as exc:
            raise ZeroCopyUnavailable(f"no output socket at {self.path} ({exc.strerror or exc})") from None
        self._lock = threading.Lock()
        self._unpins: collections.deque[int] = collections.deque()
        self._encoder = FrameEncoder()
        self._decoder = FrameDecoder()
        self.closed = False  # no fetch more: close() was called, or a fetch failed (``_hang_up``)
        self._sock_open = True
        self._live = 0  # leases mapped and not yet unpinned: a failed fetch keeps the socket for them
        self._pid = os.getpid()  # a forked child's copy must not unpin its parent's arrays
        self._why = "close() was called"

    def __enter__(self) -> OutputMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """No fetch more. The connection ends once every array handed out is gone (at once if none lives), and the
        daemon then takes back what it held: closed under a live array, it gave back the memory the array reads,
        and the next job wrote into it."""
        with self._locked():
            self.closed = True
            if not self._live:
                self._close_sock()

    def _close_sock(self) -> None:
        if self._sock_open and os.getpid() == self._pid:
            self._sock_open = False
            self._sock.close()

    def array(self, job_id: str, k: int) -> np.ndarray:
        """Output ``k`` of a finished npy job, as a read-only array over the daemon's memory."""
        lease, fd = self._lease(Fetch(job_id, k))
        return self._map(lease, fd)

    def trajectory(self, job_id: str, k: int, part: Literal["trajectory", "audio"] = "trajectory"
                   ) -> dict[str, np.ndarray]:
        """The side arrays of output ``k`` (its trajectory, and its sound track ``audio``, which share a region;
        ``part`` says which the job must have): name -> read-only array over the daemon's memory, every array in
        one mapping, kept until the last of them is dropped."""
        lease, fd = self._lease(Fetch(job_id, k, part))
        region = self._map(lease, fd)  # uint8, its byte 0 at lease.tensor.offset
        base = lease.tensor.offset
        try:
            return {name: region[d.offset - base : d.offset - base + d.nbytes].view(numpy_dtype(d.dtype))
                    .reshape(d.shape) for name, d in lease.arrays.items()}
        except (ValueError, TypeError, KeyError) as exc:  # arrays that do not fit the region
            raise ZeroCopyUnavailable(f"the lease from {self.path} does not describe its region: {exc}") from None

    def _lease(self, fetch: Fetch) -> tuple[Lease, int]:
        with self._locked():
            if os.getpid() != self._pid:
                raise ZeroCopyUnavailable("an OutputMapper does not cross a fork (its arrays are its parent's): make "
                                          "a new one in this process")
            if self.closed:
                raise ZeroCopyUnavailable(f"this OutputMapper is closed ({self._why}); make a new one")
            # Any failure below leaves the stream out of step with our requests: an answer that came late
            # (a timeout), half a frame (an OSError mid-read), or bytes that do not decode. The next FETCH
            # would read this one's answer and map another job's output as its own, so the
            # connection goes; the daemon takes back whatever it leased on it.
            try:
                self._sock.sendall(self._encoder.encode(fetch))
                msg, fds = receive(self._sock, self._decoder)
                self._send_unpins()
            except TimeoutError:
                raise self._hang_up(f"the output socket {self.path} did not answer in time") from None
            except OSError as exc:
                raise self._hang_up(f"the output socket {self.path} failed: {exc}") from None
            except IPCError as exc:
                raise self._hang_up(f"the output socket {self.path} sent a bad frame: {exc}") from None
            if isinstance(msg, Lease) and len(fds) == 1:
                # counted here, under the lock that received it: counted in ``_map`` instead, a hang-up or a
                # close() in another thread in between saw no lease live and closed the connection under it
                self._live += 1  # until its UNPIN is sent (``_send_unpins``), whichever way it goes
                return msg, fds[0]
            for fd in fds:
                os.close(fd)
            if not isinstance(msg, Refused):
                raise self._hang_up(f"unexpected answer from {self.path}: {type(msg).__name__}")
            if (msg.job_id, msg.index) != (fetch.job_id, fetch.index):  # REFUSED names what it refuses
                raise self._hang_up(f"the output socket {self.path} answered for output {msg.index} of job "
                                    f"{msg.job_id}, not the one asked for")
        raise DaemonError(msg.status, msg.code, msg.message)

    def _hang_up(self, why: str) -> ZeroCopyUnavailable:
        """No fetch more on this connection (the lock is held), said to this call and every later one. Its socket
        stays open while arrays it handed out live, for their UNPINs: closed, it gave the daemon back the memory
        under them, which it then reused while they were read."""
        self.closed = True
        self._why = why
        if not self._live:
            self._close_sock()
        return ZeroCopyUnavailable(f"{why}; this OutputMapper is closed now (make a new one)")

    def _map(self, lease: Lease, fd: int) -> np.ndarray:
        desc = lease.tensor
        start = desc.offset - desc.offset % _PAGE
        length = desc.offset + desc.nbytes - start
        try:
            mm = mmap.mmap(fd, max(length, 1), mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ, offset=start)
        except (OSError, ValueError) as exc:  # ENOMEM, a lease past the memfd's end
            self._unpin(lease.lease)  # nothing maps it: the daemon may have it back now
            raise ZeroCopyUnavailable(f"cannot map the output from {self.path}: {exc}") from None
        finally:
            os.close(fd)  # the mapping keeps the memory
        # Every array over this memory (views, slices, tensors made from them) holds the mapping
        # alive through its buffer; when the last one goes, the mapping is unmapped and collected,
        # and only then is the daemon told it may reuse the memory.
        # the mapper itself, not a weak reference: collected with arrays alive, its socket closed and the daemon
        # reused their memory
        release = weakref.finalize(mm, OutputMapper._unpin, self, lease.lease)
        try:
            raw = np.frombuffer(mm, dtype=np.uint8, count=desc.nbytes, offset=desc.offset - start)
            return raw.view(numpy_dtype(desc.dtype)).reshape(desc.shape)
        except (ValueError, TypeError, KeyError) as exc:  # a lease that does not fit its memory
            release()  # no array escapes: the daemon may have the memory back now
            raise ZeroCopyUnavailable(f"the lease from {self.path} does not fit its memory: {exc}") from None

    def _unpin(self, lease: int) -> None:
        """Called by the garbage collector, in whatever thread it runs, perhaps inside ``array``
        of this very mapper: so never wait for the lock. Whoever holds it sends the queue. Not in a forked child:
        the lease is its parent's."""
        if os.getpid() != self._pid:
            return
        self._unpins.append(lease)
        self._drain()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, and on its release the UNPINs queued while it was held: an ``_unpin`` that found it taken
        left its lease to the holder, which may have sent the queue already; unsent, the daemon kept the slot
        pinned until this mapper's next fetch, for as long as the program was idle (or forever, after a fetch
        that failed)."""
        try:
            with self._lock:
                yield
        finally:
            self._drain()

    def _drain(self) -> None:
        while self._unpins and self._lock.acquire(blocking=False):
            try:
                self._send_unpins()
            finally:
                self._lock.release()

    def _send_unpins(self) -> None:
        while self._unpins:
            lease = self._unpins.popleft()
            self._live -= 1
            if not self._sock_open:
                continue  # closed: the daemon took back everything this connection held
            try:
                self._sock.sendall(self._encoder.encode(Unpin(lease)))
            except OSError as exc:  # the daemon is gone, and with it what we held
                self.closed, self._why = True, f"the output socket {self.path} failed: {exc}"
                self._close_sock()
        if self.closed and not self._live:  # closed, or hung up after a failed fetch: the last array is gone
            self._close_sock()


def connect(path: str, timeout: float | None) -> socket.socket:
    """A connection to the output socket at ``path``, for a mapper and for a live update (``weights.py``), which
    waits for a socket not bound yet where a mapper falls back to HTTP at once."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def receive(sock: socket.socket, decoder: FrameDecoder) -> tuple[object, list[int]]:
    """The next message on the output socket and the fds that came with it (the caller's to close); on any
    failure, the fds that came are closed here, as no message names them."""
    fds: list[int] = []
    try:
        while True:
            data, got = recv_with_fds(sock)
            fds.extend(got)
            if not data:
                raise ConnectionResetError("the daemon closed the output socket before answering")
            frames = decoder.feed(data)
            if frames:
                _kind, _seq, _nfds, msg = frames[0]
                return msg, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
