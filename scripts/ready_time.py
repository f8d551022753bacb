"""Restart-to-warm: seconds from `diffusiond serve ARGS...` starting to GET /ready answering 200 with the
start's preload done (`"preload": {"state": "done"}`), i.e. every preloaded model loaded (and, with --compile
and --warmup, compiled): issue 31's compile-time figure. Since issue 27 a bare 200 means only "admitting",
which comes before any model has loaded.

Usage: python scripts/ready_time.py SOCKET LOG -- SERVE_ARGS...   (prints one JSON line)
Run it twice with the same XDG_STATE_HOME (or --state-dir) to see a cold and then a warm compile cache.

Beside the total, the JSON breaks the start down (issue 31): ``admitting_s``, when /ready first answered 200 (the
engine's own start); ``worker`` and ``cache``, the worker's lines of this start's log that time its phases (spawn to
INIT: its imports; the model; the warm-up) and, with --compile, say what the compile cache gave the warm-up.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def is_ready(sock: str) -> bool | None:
    """GET /ready over the Unix socket, stdlib only (the GPU machine has no extra HTTP client): True for 200 and the
    preload done, False for 200 while it loads, None before that."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(sock)
            s.sendall(b"GET /ready HTTP/1.0\r\nHost: d\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    if head.split(b" ")[1:2] != [b"200"]:
        return None
    try:
        return bool(json.loads(body)["preload"]["state"] == "done")
    except (ValueError, KeyError, TypeError):
        return False


def log_lines(log: str, offset: int, *marks: str) -> list[str]:
    """This start's lines of the log (from ``offset``) that contain one of ``marks``, without their time stamps."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [line.partition(" INFO ")[2] or line for line in text.splitlines() if any(m in line for m in marks)]


def main(argv: list[str]) -> int:
    sock, log, _, *serve = argv
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))  # cut short: stop the daemon too
    Path(sock).unlink(missing_ok=True)
    offset = Path(log).stat().st_size if Path(log).exists() else 0
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "diffusiond", "serve", "--socket", sock, *serve],
                                stdout=out, stderr=subprocess.STDOUT)
    ready = admitting = None
    try:
        while proc.poll() is None and ready is None:
            state = is_ready(sock)
            if state is not None and admitting is None:
                admitting = time.perf_counter() - t0
            if state:
                ready = time.perf_counter() - t0
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    print(json.dumps({"serve": serve, "ready_s": None if ready is None else round(ready, 1),
                      "admitting_s": None if admitting is None else round(admitting, 1), "exit": proc.returncode,
                      "worker": log_lines(log, offset, " ready in ", "warmed up "),
                      "cache": log_lines(log, offset, "compile cache: ")}))
    return 0 if ready is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
