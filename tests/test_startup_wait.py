"""A request that arrives while the daemon is still loading its models is served, not refused, so
that `diffusiond serve &` followed at once by `diffusiond generate` works, as does a
socket-activated first request. On a first start (the model's defaults not yet known) the daemon
holds the request until the model has loaded; later starts accept it at once (test_durable.py).
The CLI and the Python client also still resubmit on a 503 'starting' from an older daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from daemonkit import Daemon

from conftest import ROOT


def start_slow(tmp: Path, model_cache: Path, delay_ms: int) -> Daemon:
    d = Daemon(tmp / "d.sock", ["--model", "tiny", "--test-fault", f"load_delay_ms={delay_ms}"], tmp / "d.log",
               env={"DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"})
    d.spawn()
    assert d.proc is not None
    deadline = time.monotonic() + 60
    while not d.socket.exists():
        assert time.monotonic() < deadline and d.proc.poll() is None, d.log()
        time.sleep(0.05)
    return d


def test_generate_right_after_serve_waits_for_the_models(tmp_path: Path, model_cache: Path) -> None:
    d = start_slow(tmp_path, model_cache, 3000)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "diffusiond", "generate", "a lighthouse", "--socket", str(d.socket),
             "-o", str(tmp_path / "out.png"), "--seed", "1"],
            capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr + d.log()
        assert (tmp_path / "out.png").stat().st_size > 0
    finally:
        d.stop()


def test_the_python_client_waits_too(tmp_path: Path, model_cache: Path) -> None:
    from diffusiond import Client

    d = start_slow(tmp_path, model_cache, 2000)
    try:
        with Client(str(d.socket)) as c:
            [image] = c.generate("a lighthouse", seed=1)
            assert image.size == (128, 128)
    finally:
        d.stop()
