"""Restart-to-warm: seconds from `diffusiond serve ARGS...` starting to GET /ready answering 200 with the
start's preload done (`"preload": {"state": "done"}`), i.e. every preloaded model loaded (and, with --compile
and --warmup, compiled): issue 31's compile-time figure. Since issue 27 a bare 200 means only "admitting",
which comes before any model has loaded.

Usage: python scripts/ready_time.py SOCKET LOG -- SERVE_ARGS...   (prints one JSON line)
Run it twice with the same XDG_STATE_HOME to see a cold and then a warm compile cache.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def is_ready(sock: str) -> bool:
    """GET /ready over the Unix socket, stdlib only (the GPU machine has no extra HTTP client): 200 and the
    preload done."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(sock)
            s.sendall(b"GET /ready HTTP/1.0\r\nHost: d\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError:
        return False
    head, _, body = data.partition(b"\r\n\r\n")
    if head.split(b" ")[1:2] != [b"200"]:
        return False
    try:
        return bool(json.loads(body)["preload"]["state"] == "done")
    except (ValueError, KeyError, TypeError):
        return False


def main(argv: list[str]) -> int:
    sock, log, _, *serve = argv
    Path(sock).unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "diffusiond", "serve", "--socket", sock, *serve],
                                stdout=out, stderr=subprocess.STDOUT)
    ready = None
    try:
        while proc.poll() is None and ready is None:
            if is_ready(sock):
                ready = time.perf_counter() - t0
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    print(json.dumps({"serve": serve, "ready_s": None if ready is None else round(ready, 1),
                      "exit": proc.returncode}))
    return 0 if ready is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
