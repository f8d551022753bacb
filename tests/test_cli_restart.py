"""``generate`` through a daemon restart, against real daemons on one state dir: the daemon is
SIGTERMed while ``generate`` follows its job, which it keeps in the state dir. Started again, it runs the job,
and ``generate`` follows it there and writes the file; not started again, ``generate`` gives up after its
bound and names the job, and never tells the user to start a daemon (one answered a moment ago).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemonkit import Daemon, http
from PIL import Image

from conftest import ROOT
from diffusiond.cli import main

ENV = {"OMP_NUM_THREADS": "1"}
Factory = Callable[..., Daemon]


def serve_args(state: Path) -> list[str]:
    # Each copy held 3 s and a drain of 0.5 s: SIGTERM finds the job running and leaves it to the next start.
    return ["--model", "tiny", "--state-dir", str(state), "--max-batch", "1", "--job-timeout", "300",
            "--test-fault", "copy_delay_ms=3000", "--drain-grace-s", "0.5"]


def generate(sock: Path, prompt: str, out: Path) -> list[str]:
    return ["generate", prompt, "--socket", str(sock), "--size", "64x64", "--steps", "2", "--seed", "7",
            "-o", str(out)]


async def running(sock: Path, prompt: str, timeout: float = 120) -> dict[str, Any]:
    async with http(sock) as s:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            async with s.get("/v1/jobs") as r:
                jobs = [j for j in (await r.json())["data"] if j["request"]["prompt"] == prompt]
            if jobs and jobs[0]["status"] == "running":
                return dict(jobs[0])
            await asyncio.sleep(0.05)
    pytest.fail(f"no running job with prompt {prompt!r} after {timeout}s")


def stop(d: Daemon) -> None:
    d.signal(signal.SIGTERM)
    assert d.wait(90) == 0, d.log()
    assert "stays in the state dir" in d.log()


def test_generate_follows_its_job_through_a_restart_and_writes_the_file(
    daemon_factory: Factory, tmp_path: Path
) -> None:
    d = daemon_factory(*serve_args(tmp_path / "state"), env=ENV)
    out = tmp_path / "out6.png"
    env = {k: v for k, v in os.environ.items() if k != "DIFFUSIOND_SOCKET"}
    proc = subprocess.Popen([sys.executable, "-m", "diffusiond", *generate(d.socket, "a red door", out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        job = asyncio.run(running(d.socket, "a red door"))
        stop(d)
        d.start()  # the same socket and state dir, as systemctl restart does
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert f"lost the daemon while following job {job['id']}" in stderr
    assert f"the daemon is back; following job {job['id']} again" in stderr
    assert "Start one" not in stderr and "Transfer" not in stderr and "aiohttp" not in stderr
    assert stdout == f"{out}  seed=7\n"
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (64, 64)


def test_generate_names_its_job_when_the_daemon_does_not_come_back(
    daemon_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, to shorten the 60 s wait; the daemon is a real one, and its job outlives it."""
    monkeypatch.setattr("diffusiond.commands.follow.RECONNECT_S", 2.0)
    d = daemon_factory(*serve_args(tmp_path / "state"), env=ENV)
    caught: list[dict[str, Any]] = []

    def stop_it() -> None:
        caught.append(asyncio.run(running(d.socket, "a blue door")))
        stop(d)

    stopper = threading.Thread(target=stop_it)
    stopper.start()
    try:
        code = main(generate(d.socket, "a blue door", tmp_path / "x.png"))
    finally:
        stopper.join(120)
    err = capsys.readouterr().err
    assert code == 3, err
    (job,) = caught
    assert (f"lost the daemon while following job {job['id']} (it may be stopping or restarting; a queued or "
            f"running job resumes when it starts again): `diffusiond history`, or GET /v1/jobs/{job['id']}") in err
    assert "Start one" not in err and "Transfer" not in err
    assert not (tmp_path / "x.png").exists()


async def test_a_daemon_said_to_be_back_is_followed_again_even_after_the_last_loss_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After its fifth loss generate waited for the daemon, said it was back, and gave up without
    following the job; the losses it allows are waited out, and the one after them gives up at once."""
    import diffusiond.commands.follow as follow
    from diffusiond.client.errors import DaemonUnreachable

    losses = {"n": 0}

    async def events(client: Any, job_id: str, *args: Any) -> dict[str, Any]:
        if losses["n"] < follow.RECONNECTS:
            losses["n"] += 1
            raise DaemonUnreachable("/x.sock", "connection lost")
        return {"id": job_id, "status": "succeeded"}

    async def back(client: Any, job_id: str, deadline: Any) -> None:
        return None

    class Bar:
        def close(self) -> None:
            pass

    monkeypatch.setattr(follow, "follow_events", events)
    monkeypatch.setattr(follow, "_back", back)
    assert (await follow.follow(None, "j_1", Bar()))["status"] == "succeeded"  # type: ignore[arg-type]
    losses["n"] = -1  # one loss more than allowed: given up at once, naming the job
    with pytest.raises(follow.LostDaemon, match="j_1"):
        await follow.follow(None, "j_1", Bar())  # type: ignore[arg-type]
