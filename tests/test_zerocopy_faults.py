"""The zero-copy path when the output socket's answer cannot be mapped or decoded: the
caller gets ZeroCopyUnavailable (for which ``diffusiond.Client`` falls back to HTTP), never a raw
OSError, ValueError or decode error, and no fd that came with the broken answer stays open.

A fake output socket gives the broken answers; the real daemon's good ones are in test_zerocopy.py."""

from __future__ import annotations

import array
import gc
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from diffusiond.client.zerocopy import OutputMapper, ZeroCopyUnavailable
from diffusiond.ipc.frames import FrameEncoder
from diffusiond.ipc.outsocket import Lease
from diffusiond.ipc.tensors import TensorDesc

MEMFD = "diffusiond-fake-lease"


def fake_leases() -> list[int]:
    """This process's fds that point at a memfd the fake socket sent."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if MEMFD in os.readlink(f"/proc/self/fd/{name}"):
                found.append(int(name))
        except OSError:
            pass
    return found


@contextmanager
def serve_once(path: str, answer: bytes) -> Iterator[None]:
    """Answer the first request on ``path`` with ``answer`` and a 4 KiB memfd attached."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)  # the Fetch
            fd = os.memfd_create(MEMFD)
            os.ftruncate(fd, 4096)
            conn.sendmsg([answer], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            os.close(fd)
            conn.recv(65536)  # until the client hangs up (or sends an Unpin)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        listener.close()


def lease(offset: int, arrays: dict[str, TensorDesc] | None = None) -> bytes:
    desc = TensorDesc(dtype="uint8", shape=(4096,), nbytes=4096, slot_id=0, offset=offset)
    return FrameEncoder().encode(Lease(lease=1, tensor=desc, map_bytes=4096, arrays=arrays or {}), 1)


BEYOND = {"latents": TensorDesc(dtype="float32", shape=(2048,), nbytes=8192, slot_id=0, offset=0)}


@pytest.mark.parametrize(("answer", "part", "match"), [
    (lease(1 << 20), None, "cannot map"),  # a lease past the memfd's end: mmap's ValueError
    (lease(0, BEYOND), "trajectory", "does not describe its region"),  # an array past the region's end
    (b"not a frame at all, just bytes" * 4, None, "bad frame"),  # the decoder's error
], ids=["offset-past-end", "array-past-region", "garbage"])
def test_an_answer_that_cannot_be_mapped_is_zero_copy_unavailable_and_leaks_no_fd(
        tmp_path: Path, answer: bytes, part: str | None, match: str) -> None:
    sock = str(tmp_path / "d.sock")
    with serve_once(sock + ".out", answer), OutputMapper(sock, timeout=10) as m:
        with pytest.raises(ZeroCopyUnavailable, match=match):
            m.trajectory("j", 0) if part else m.array("j", 0)
        gc.collect()  # a mapping made before the error goes with its last reference
        assert fake_leases() == []
