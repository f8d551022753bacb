"""A real peer process for IPC tests: owns an arena, writes a pattern, sends its fd.

Run as ``python tests/ipc_peer.py FD NBYTES MODE``; FD is its end of a socketpair.
MODE ``send``: send HELLO with the arena fd, then an OUTPUT_READY describing a pattern, then wait
for SHUTDOWN. MODE ``hold``: same, then sleep until killed (for SIGKILL tests).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import numpy as np

from diffusiond.ipc.arena import Arena
from diffusiond.ipc.channel import Channel
from diffusiond.ipc.messages import Hello, OutputReady, Shutdown
from diffusiond.ipc.tensors import TensorDesc, as_numpy


async def main(fd: int, nbytes: int, mode: str) -> None:
    sock = socket.socket(fileno=fd)
    arena = Arena(nbytes)
    slot = arena.allocate(1000)
    view = arena.buffer(slot)
    pattern = np.arange(1000, dtype=np.uint32).astype(np.uint8)
    view[:] = pattern.tobytes()
    desc = TensorDesc(dtype="uint8", shape=(1000,), nbytes=1000, slot_id=slot.id, offset=slot.offset)
    assert np.array_equal(as_numpy(arena._view, desc), pattern)
    done = asyncio.get_running_loop().create_future()

    def on_frame(frame):  # type: ignore[no-untyped-def]
        if isinstance(frame.msg, Shutdown) and not done.done():
            done.set_result(None)

    def on_close(reason):  # type: ignore[no-untyped-def]
        if not done.done():
            done.set_result(None)

    ch = Channel(sock, name="peer")
    ch.start(on_frame, on_close)
    ch.post(Hello(worker_id=7, pid=os.getpid(), arena_bytes=arena.capacity), [arena.fd])
    ch.post(OutputReady(request_id="r0", batch_id=0, tensor=desc))
    await ch.drain()
    if mode == "hold":
        await asyncio.sleep(3600)
    await done


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
