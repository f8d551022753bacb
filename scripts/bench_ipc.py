"""IPC micro-benchmark: the frame channel and the arena against pickling over the same socket.

    python scripts/bench_ipc.py [--frames 200000] [--outputs 2000] [--shape 512,512,3]

Two processes joined by an AF_UNIX socketpair, as engine and worker are.
1. Frames per second: the child posts PROGRESS frames as fast as the channel takes them; the
   parent decodes and checks every sequence number.
2. Output latency: the child writes a tensor into an arena slot and posts OUTPUT_READY; the
   parent decodes the descriptor and maps a zero-copy numpy view. Latency = from "written to the
   slot" to "view in the parent's hands" (both read CLOCK_MONOTONIC).
3. Baseline: the same tensor pickled (protocol 5, in-band) and sent length-prefixed over the same
   kind of socket; latency = from "tensor ready" to "unpickled in the parent". Also the pickle
   size of one request's view of a 32-request batch tensor, the amplification seed 001 describes.

pickle appears here only as the baseline being measured; the package itself never imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np
import torch

from diffusiond.ipc import messages as m
from diffusiond.ipc.arena import Arena, MappedView
from diffusiond.ipc.channel import Channel, socketpair
from diffusiond.ipc.tensors import as_numpy, describe, write_tensor


async def child(fd: int, mode: str, count: int, shape: tuple[int, ...]) -> None:
    sock = socket.socket(fileno=fd)
    if mode == "pickle":
        sock.setblocking(True)
        t = torch.randint(0, 256, shape, dtype=torch.uint8)
        for _ in range(count):
            t0 = time.monotonic_ns()
            data = pickle.dumps((t0, t), protocol=5)
            sock.sendall(struct.pack("!Q", len(data)) + data)
            sock.recv(1)  # wait for the ack: one output in flight, like the arena run
        return
    ch = Channel(sock, name="child")
    acks: asyncio.Queue[None] = asyncio.Queue()
    ch.start(lambda f: acks.put_nowait(None), lambda r: None)
    if mode == "frames":
        for i in range(count):
            ch.post(m.Progress(batch_id=0, step=i, total=count))
            if i % 256 == 0:
                await ch.drain()
        await ch.drain()
        await acks.get()
        return
    arena = Arena(64 << 20)
    ch.post(m.Hello(worker_id=0, pid=os.getpid(), arena_bytes=arena.capacity), [arena.fd])
    t = torch.randint(0, 256, shape, dtype=torch.uint8)
    for _ in range(count):
        slot = arena.allocate(t.numel())
        write_tensor(arena.buffer(slot), t)
        t0 = time.monotonic_ns()
        ch.post(m.OutputReady(request_id=str(t0), batch_id=0, tensor=describe(t, slot.id, slot.offset)))
        await acks.get()
        arena.release(slot.id)
    await ch.drain()


async def parent(mode: str, count: int, shape: tuple[int, ...]) -> list[float]:
    mine, theirs = socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "--child", mode, str(theirs.fileno()), str(count),
                             ",".join(map(str, shape))], pass_fds=[theirs.fileno()])
    theirs.close()
    lat: list[float] = []
    if mode == "pickle":
        mine.setblocking(True)
        for _ in range(count):
            (n,) = struct.unpack("!Q", _recv(mine, 8))
            t0, t = pickle.loads(_recv(mine, n))
            lat.append((time.monotonic_ns() - t0) / 1000)
            assert t.shape == shape
            mine.sendall(b"k")
        proc.wait()
        return lat
    done = asyncio.get_running_loop().create_future()
    ch = Channel(mine, name="parent")
    got = 0
    view: MappedView | None = None
    start = time.perf_counter()

    def on_frame(f) -> None:  # type: ignore[no-untyped-def]
        nonlocal got, view, start
        if isinstance(f.msg, m.Hello):
            view = MappedView(f.fds[0], f.msg.arena_bytes)
            return
        got += 1
        if isinstance(f.msg, m.OutputReady):
            arr = as_numpy(view.view, f.msg.tensor)  # type: ignore[union-attr]
            lat.append((time.monotonic_ns() - int(f.msg.request_id)) / 1000)
            assert arr.shape == shape
            ch.post(m.Release([f.msg.tensor.slot_id]))
        if got == count:
            if mode == "frames":
                ch.post(m.Shutdown())
                lat.append(time.perf_counter() - start)
            if not done.done():
                done.set_result(None)

    ch.start(on_frame, lambda r: done.done() or done.set_result(None))
    await done
    await ch.drain()
    await asyncio.to_thread(proc.wait)
    return lat


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, fd, count, shape = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        asyncio.run(child(fd, mode, count, tuple(int(x) for x in shape.split(","))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--outputs", type=int, default=2000)
    ap.add_argument("--shape", default="512,512,3")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    import uvloop

    (elapsed,) = uvloop.run(parent("frames", args.frames, shape))
    arena = uvloop.run(parent("arena", args.outputs, shape))
    pick = uvloop.run(parent("pickle", args.outputs, shape))
    batch = torch.zeros(32, 3, 512, 512)
    view_pickle = len(pickle.dumps(batch[5], protocol=5))
    nbytes = int(np.prod(shape))
    print(f"frames through the channel: {args.frames / elapsed:,.0f} frames/s ({args.frames} PROGRESS frames)")
    print(f"output of {shape} uint8 ({nbytes / 1e6:.2f} MB), {args.outputs} outputs, one in flight:")
    print("| path | p50 | p99 | mean |")
    print("|---|---|---|---|")
    for name, xs in (("arena slot + OUTPUT_READY descriptor", arena), ("pickle over the socket", pick)):
        print(f"| {name} | {pct(xs, 50):.1f} us | {pct(xs, 99):.1f} us | {statistics.mean(xs):.1f} us |")
    from diffusiond.ipc.frames import FrameEncoder

    frame = FrameEncoder().encode(m.OutputReady("j_0123456789abcdef/0", 1, describe(batch[5], 1, 0)))
    print(f"pickle size of one request's view of a 32x3x512x512 float32 batch: {view_pickle / 1e6:.1f} MB "
          f"(the view itself: {batch[5].numel() * 4 / 1e6:.1f} MB; its OUTPUT_READY frame: {len(frame)} bytes)")


if __name__ == "__main__":
    main()
