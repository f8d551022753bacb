"""What durable jobs cost at admission: the 202 latency with the job written to the state dir
(SQLite in WAL mode: ``--state-sync normal``, the default, and ``full``, an fsync per job)
against ``--no-persist``.

    python scripts/bench_admission.py [--jobs 300] [--rounds 3] [--state-dir DIR] [--json]

Starts a daemon on ``tiny`` for each mode, puts it to sleep (so queued jobs stay queued and no
forward pass competes for the CPU), then submits ``--jobs`` jobs one after another over the Unix
socket, each timed from sending the POST to having read the 202. The modes alternate for
``--rounds`` rounds; p50 and p99 are over every submission of a mode. ``--state-dir`` puts the
database on a given filesystem (default: a temporary folder, which is where fsync costs what
it costs on this machine's disk).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class _Conn(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("diffusiond", timeout=600)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def _call(conn: _Conn, method: str, path: str, body: dict[str, object] | None = None) -> tuple[int, bytes]:
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


MODES = ("normal", "full", "no-persist")


def _run_mode(mode: str, jobs: int, state_root: Path, tmp: Path) -> list[float]:
    sock = tmp / f"{mode}.sock"
    state = Path(tempfile.mkdtemp(prefix="state-", dir=state_root))
    args = ["--no-persist"] if mode == "no-persist" else ["--state-dir", str(state), "--state-sync", mode]
    log = open(tmp / f"{sock.stem}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "diffusiond", "serve", "--model", "tiny", "--socket", str(sock),
                             "--queue-size", str(jobs + 50), "--job-timeout", "3600", *args],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited: {(tmp / f'{sock.stem}.log').read_text()}")
            try:
                status, body = _call(_Conn(str(sock)), "GET", "/ready")
                if status == 200 and json.loads(body)["preload"]["state"] == "done":  # admitting and loaded
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the daemon did not get ready in 300 s")
            time.sleep(0.1)
        conn = _Conn(str(sock))
        assert _call(conn, "POST", "/v1/admin/sleep")[0] == 200
        body = {"prompt": "admission", "width": 64, "height": 64, "steps": 2}
        for _ in range(20):  # warm-up: connection, first statements
            _call(conn, "POST", "/v1/jobs", body)
        times = []
        for _ in range(jobs):
            t0 = time.perf_counter()
            status, answer = _call(conn, "POST", "/v1/jobs", body)
            times.append((time.perf_counter() - t0) * 1000)
            if status != 202:
                raise SystemExit(f"POST /v1/jobs answered {status}: {answer[:300]!r}")
        return times
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--state-dir", type=Path, help="where the persisted mode's state dirs go")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as t:
        tmp = Path(t)
        root = args.state_dir or tmp
        root.mkdir(parents=True, exist_ok=True)
        results: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                results[mode] += _run_mode(mode, args.jobs, root, tmp)
    summary = {mode: {"n": len(ts), "p50_ms": round(statistics.median(ts), 3),
                      "p99_ms": round(statistics.quantiles(ts, n=100)[98], 3),
                      "mean_ms": round(statistics.fmean(ts), 3)}
               for mode, ts in results.items()}
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "modes": summary}))
    else:
        for mode, s in summary.items():
            print(f"{mode:>10}: 202 latency p50 {s['p50_ms']:.3f} ms, p99 {s['p99_ms']:.3f} ms, "
                  f"mean {s['mean_ms']:.3f} ms over {s['n']} submissions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
