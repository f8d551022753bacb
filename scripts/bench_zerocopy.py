"""Outputs to a local program: by file descriptor (the output socket) against the HTTP npy stream.

    python scripts/bench_zerocopy.py [--frames 100] [--size 1024] [--outputs 6] [--small 300]

Starts a daemon on a synthetic video model (no weights: the outputs are the point), makes raw
uint8 outputs of frames x size x size x 3 bytes (314 MB at the defaults), and hands each one to
this process both ways in the same run, alternating:
- fd: ``OutputMapper.array`` (FETCH -> LEASE with the fd -> read-only mapping -> numpy array);
- HTTP: ``GET /v1/jobs/{id}/outputs/0`` over the Unix socket, read into one preallocated buffer
  that numpy then wraps (the best an HTTP client can do: one copy, out of the socket).
Each is timed from "the job has succeeded" to "a usable array", and again including one full
read of the array (a mapping's pages are touched only when read, so the read is where a lazy
mapping would pay). Then ``--small`` small outputs (64x64) are fetched by fd for the per-output
handoff latency (p50, p99).
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from diffusiond.client.zerocopy import OutputMapper


class _Conn(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("diffusiond", timeout=600)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self.path)


def call(sock: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    c = _Conn(sock)
    c.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status >= 400:
        raise RuntimeError(f"{method} {path}: {r.status} {data[:200]!r}")
    return json.loads(data)


def run_job(sock: str, body: dict[str, Any]) -> str:
    job = call(sock, "POST", "/v1/jobs", {"prompt": "bench", "output_format": "npy", **body})["id"]
    while (state := call(sock, "GET", f"/v1/jobs/{job}"))["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.01)
    if state["status"] != "succeeded":
        raise RuntimeError(f"job {job} {state['status']}: {state['error']}")
    return str(job)


def http_array(sock: str, job: str) -> np.ndarray:
    c = _Conn(sock)
    c.request("GET", f"/v1/jobs/{job}/outputs/0")
    r = c.getresponse()
    buf = bytearray(int(r.headers["Content-Length"]))
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        n = r.readinto(view[got:])
        if not n:
            raise RuntimeError("short read")
        got += n
    head = io.BytesIO(bytes(buf[:4096]))
    np.lib.format.read_magic(head)
    shape, _fortran, dtype = np.lib.format.read_array_header_1_0(head)
    return np.frombuffer(buf, dtype=dtype, offset=head.tell()).reshape(shape)


def read_all(a: np.ndarray) -> int:
    """Touch every byte once, as fast as memory allows (an OR over 8-byte words): the least a
    consumer does, and where a mapping pays for pages it has not touched yet."""
    raw = a.reshape(-1).view(np.uint8)
    words = raw[: raw.size - raw.size % 8].view(np.uint64)
    return int(np.bitwise_or.reduce(words)) | int(np.bitwise_or.reduce(raw[words.size * 8 :], initial=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--outputs", type=int, default=6, help="large outputs each way")
    ap.add_argument("--small", type=int, default=300, help="small outputs for the handoff latency")
    args = ap.parse_args()
    out_bytes = args.frames * args.size * args.size * 3
    tmp = tempfile.mkdtemp(prefix="bench-zerocopy-")
    sock = os.path.join(tmp, "d.sock")
    arena_mb = max(256, 3 * out_bytes >> 20)
    log = open(Path(tmp) / "d.log", "w")  # noqa: SIM115 - the daemon's stderr for as long as it runs
    daemon = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "serve", "--socket", sock, "--model",
         "v=synthetic:task=video,compute_ms=1", "--model", "i=synthetic:compute_ms=1", "--arena-mb", str(arena_mb),
         "--log-level", "warning"], stderr=log)
    try:
        for _ in range(600):
            try:
                if call(sock, "GET", "/health")["status"] == "ok":
                    break
            except (OSError, RuntimeError, ValueError):
                pass
            time.sleep(0.1)
        big = {"model": "v", "width": args.size, "height": args.size, "num_frames": args.frames, "steps": 1}
        fd_times: list[tuple[float, float]] = []
        http_times: list[tuple[float, float]] = []
        with OutputMapper(sock) as m:
            for i in range(args.outputs * 2):
                job = run_job(sock, {**big, "seed": i})
                t0 = time.perf_counter()
                a = m.array(job, 0) if i % 2 == 0 else http_array(sock, job)
                t1 = time.perf_counter()
                read_all(a)
                t2 = time.perf_counter()
                (fd_times if i % 2 == 0 else http_times).append((t1 - t0, t2 - t0))
                del a
            small = []
            jobs = [run_job(sock, {"model": "i", "width": 64, "height": 64, "steps": 1, "n": 16, "seed": j})
                    for j in range(-(-args.small // 16))]
            for job in jobs:
                for k in range(16):
                    t0 = time.perf_counter()
                    a = m.array(job, k)
                    small.append(time.perf_counter() - t0)
                    del a
        small = small[: args.small]
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    mb = out_bytes / 1e6
    fd_h, fd_r = med([t[0] for t in fd_times]), med([t[1] for t in fd_times])
    ht_h, ht_r = med([t[0] for t in http_times]), med([t[1] for t in http_times])
    print(f"{args.outputs} outputs each way of {mb:.0f} MB (uint8 {args.frames}x{args.size}x{args.size}x3), "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}")
    print("| path | to a usable array: median ms | GB/s | with one full read: median ms | GB/s |")
    print("|---|---|---|---|---|")
    for name, h, r in (("fd (output socket)", fd_h, fd_r), ("HTTP npy stream", ht_h, ht_r)):
        print(f"| {name} | {h * 1e3:.2f} | {mb / 1e3 / h:.1f} | {r * 1e3:.1f} | {mb / 1e3 / r:.2f} |")
    print(f"fd / HTTP: {ht_h / fd_h:.0f}x to a usable array, {ht_r / fd_r:.1f}x with one full read")
    q = statistics.quantiles(small, n=100)
    print(f"handoff of a small output (64x64x3) by fd, {len(small)} outputs: p50 {med(small) * 1e6:.0f} us, "
          f"p99 {q[98] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
