"""The CLI and client against a small stand-in daemon that speaks the docs/api.md job contract
over a real Unix socket: generate and its files, failures, timeouts and Ctrl-C, status, models and
cancel; the client's exceptions (one root, nothing of aiohttp's or asyncio's leaks); and a reader
that stops reading. test_cli.py has the CLI's checks that need no daemon (end-to-end tests against
the real daemon live elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from diffusiond.cli import main
from diffusiond.client import AsyncClient, ClientError, ClientTimeout, DaemonError, DaemonUnreachable

# generate and friends against a stand-in daemon ----------------------------------------------
FAILURES: dict[str, Any] = {  # prompt -> the error the job fails with
    "fail": {"code": "worker_crashed", "message": "the worker died", "stage": "computing"},
    "late": {"code": "deadline_exceeded", "message": "job j_1 passed its deadline of 3 s", "stage": "queued"},
    "plain": "the worker ran out of memory",  # an error given as a plain string, not an object
}


class StubDaemon:
    """Just enough of docs/api.md's job endpoints to drive the client; the prompt picks the behaviour."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.requests: list[tuple[str, str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.subscribed = threading.Event()
        self.deleting = threading.Event()
        self.admitted = threading.Event()
        self.refused = threading.Event()  # a POST answered "still starting"
        self.starting = False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def job_json(self, job_id: str, status: str, **extra: Any) -> dict[str, Any]:
        return {"id": job_id, "status": status, "stage": "queued", "progress": {"step": 0, "total": 4},
                "outputs": [], "error": None, "timings_ms": {}, "model": "tiny", "created": 0, **extra}  # fmt: skip

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("POST", request.path, body))
        if body["prompt"] == "starting":  # a daemon loading its models, as it answers every submit then
            self.starting = True
            self.refused.set()
            err = {"code": "unavailable", "message": "diffusiond is starting"}
            return web.json_response({"error": err}, status=503)
        if body["prompt"] == "reject":
            err = {"code": "invalid_request", "message": "width must be a multiple of 8", "field": "width"}
            return web.json_response({"error": err}, status=400)
        job_id = f"j_{len(self.jobs) + 1}"
        self.jobs[job_id] = body
        if body["prompt"] == "slow-admit":  # admitted, and the answer that names it on its way
            self.admitted.set()
            await asyncio.sleep(1.0)
        return web.json_response(self.job_json(job_id, "queued"), status=202)

    async def events(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["id"]
        body = self.jobs[job_id]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text = "".join(f"event: progress\ndata: {json.dumps({'step': s, 'total': 4})}\n\n" for s in range(1, 3))
        if body["prompt"] in FAILURES:
            err = FAILURES[body["prompt"]]
            text += f"event: error\ndata: {json.dumps(self.job_json(job_id, 'failed', error=err))}\n\n"
        elif body["prompt"] not in ("hang", "stuck", "slow-admit"):
            n = body.get("n", 1)
            outputs = [{"index": k, "url": f"/v1/jobs/{job_id}/outputs/{k}", "content_type": "image/png",
                        "seed": 100 + k, "bytes": 6} for k in range(n)]  # fmt: skip
            text += f"event: done\ndata: {json.dumps(self.job_json(job_id, 'succeeded', outputs=outputs))}\n\n"
        data = text.encode()
        for i in range(0, len(data), 7):  # awkward chunks on the wire too
            await resp.write(data[i : i + 7])
        self.subscribed.set()
        if body["prompt"] in ("hang", "stuck", "slow-admit"):
            await asyncio.sleep(3600)
        return resp

    async def output(self, request: web.Request) -> web.Response:
        return web.Response(body=b"PNG-" + request.match_info["k"].encode() + b"\n", content_type="image/png")

    async def delete(self, request: web.Request) -> web.Response:
        job_id = request.match_info["id"]
        self.requests.append(("DELETE", request.path, None))
        if self.jobs.get(job_id, {}).get("prompt") == "stuck":  # a daemon that no longer answers
            self.deleting.set()
            await asyncio.sleep(3600)
        if job_id == "j_done":
            return web.json_response({"error": {"code": "conflict", "message": "finished"}}, status=409)
        if job_id not in self.jobs:
            return web.json_response({"error": {"code": "not_found", "message": f"no job {job_id}"}}, status=404)
        return web.json_response(self.job_json(job_id, "cancelled"))

    async def get_job(self, request: web.Request) -> web.Response:
        return web.json_response(self.job_json(request.match_info["id"], "succeeded"))

    async def health(self, request: web.Request) -> web.Response:
        worker = {"id": "tiny-0", "model": "tiny", "device": "cpu", "state": "ready", "pid": 42, "restarts": 0}
        starting = {"id": "tiny-1", "model": "tiny", "device": "cpu", "state": "starting", "pid": None, "restarts": 0}
        return web.json_response({"status": "ok", "version": "0.1.0", "workers": [worker, starting], "queue_depth": 0,
                                  "jobs": {"succeeded": 3}, "arena_bytes_in_use": 1 << 20,
                                  "preload": {"state": "running", "models": ["tiny"]}})  # fmt: skip

    async def ready(self, request: web.Request) -> web.Response:
        if self.starting:
            return web.json_response({"ready": False, "reason": "starting"}, status=503)
        return web.Response(text="ready")

    async def models(self, request: web.Request) -> web.Response:
        defaults = {"width": 128, "height": 128, "steps": 4, "guidance_scale": 5.0}
        return web.json_response({"data": [  # flux: still loading for the first time (its defaults are null)
            {"id": "tiny", "task": "text-to-image", "device": "cpu", "state": "ready", "defaults": defaults},
            {"id": "flux", "task": "text-to-image", "device": "cpu", "state": "starting", "edits": []}]})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/jobs", self.create)
        app.router.add_get("/v1/jobs/{id}", self.get_job)
        app.router.add_delete("/v1/jobs/{id}", self.delete)
        app.router.add_get("/v1/jobs/{id}/events", self.events)
        app.router.add_get("/v1/jobs/{id}/outputs/{k}", self.output)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/v1/models", self.models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.UnixSite(self._runner, self.path).start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> StubDaemon:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[StubDaemon]:
    with StubDaemon(str(tmp_path / "d.sock")) as daemon:
        yield daemon


def test_generate_writes_indexed_files(stub: StubDaemon, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "cat.png"
    argv = ["generate", "a cat", "--socket", stub.path, "-o", str(out), "-n", "3", "--size", "64x128", "--seed", "5"]
    assert main(argv) == 0
    assert stub.requests[0][2] == {"prompt": "a cat", "n": 3, "width": 64, "height": 128, "seed": 5,
                                   "output_format": "png"}  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{tmp_path / f'cat-{k}.png'}  seed={100 + k}" for k in range(3)]
    assert [(tmp_path / f"cat-{k}.png").read_bytes() for k in range(3)] == [b"PNG-%d\n" % k for k in range(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cat-0.png", "cat-1.png", "cat-2.png", "d.sock"]


def test_generate_json_and_default_name(
    stub: StubDaemon, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "a dog", "--socket", stub.path, "--json"]) == 0
    assert stub.requests[0][2] == {"prompt": "a dog"}
    result = json.loads(capsys.readouterr().out)
    assert result["job"]["status"] == "succeeded"
    assert result["files"] == [{"path": "j_1.png", "seed": 100, "bytes": 6}]
    assert (tmp_path / "j_1.png").read_bytes() == b"PNG-0\n"


def test_no_audio_asks_the_daemon_to_leave_the_sound_track_out(
    stub: StubDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "a drum", "--socket", stub.path, "--no-audio"]) == 0
    assert stub.requests[0][2] == {"prompt": "a drum", "audio": False}  # issue 30; left out, the model's default


def test_generate_failure_exits_1_with_the_daemons_message(stub: StubDaemon, capsys: Any) -> None:
    assert main(["generate", "fail", "--socket", stub.path]) == 1
    assert "error: job j_1 failed: the worker died (worker_crashed, stage computing)" in capsys.readouterr().err


@pytest.mark.parametrize(("prompt", "line"), [
    ("late", "error: job j_1 passed its deadline of 3 s (deadline_exceeded, stage queued)\n"),  # the id said once
    ("plain", "error: job j_1 failed: the worker ran out of memory\n"),  # the daemon's words, not dropped
])
def test_generate_failure_line_names_the_job_once_with_the_daemons_message(
        stub: StubDaemon, capsys: Any, prompt: str, line: str) -> None:
    assert main(["generate", prompt, "--socket", stub.path]) == 1
    err = capsys.readouterr().err
    assert err.endswith(line), err  # the whole line: the id in it once


def test_generate_rejected_exits_1(stub: StubDaemon, capsys: Any) -> None:
    assert main(["generate", "reject", "--socket", stub.path]) == 1
    err = capsys.readouterr().err
    assert "width must be a multiple of 8" in err and "field width" in err


def test_generate_timeout_cancels(stub: StubDaemon, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("diffusiond.commands.generate.CANCEL_GRACE_S", 0.0)
    assert main(["generate", "hang", "--socket", stub.path, "--timeout", "0.5"]) == 1
    assert "did not finish within 0.5 s" in capsys.readouterr().err
    assert ("DELETE", "/v1/jobs/j_1", None) in stub.requests


def test_a_connect_timeout_without_timeout_exits_3_and_leaves_the_job_alone(
    stub: StubDaemon, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stubbed where the timeout comes from: on Linux a Unix socket's connect is done or refused at once, under
    uvloop and asyncio alike (a full backlog is EAGAIN, DaemonUnreachable), so the 30 s connect bound cannot be
    made to pass for real. Without --timeout the user bounded nothing: no cancel of their job, and the
    ClientTimeout's own message, not a TypeError's traceback from formatting the missing bound."""

    async def slow(client: AsyncClient, job_id: str, *args: Any) -> dict[str, Any]:
        raise ClientTimeout(client.socket_path, f"connecting for GET /v1/jobs/{job_id}/events", 30.0)

    monkeypatch.setattr("diffusiond.commands.generate.follow", slow)
    assert main(["generate", "hang", "--socket", stub.path]) == 3
    err = capsys.readouterr().err
    assert f"error: connecting for GET /v1/jobs/j_1/events (daemon at {stub.path}) took longer than 30 s" in err, err
    assert not any(method == "DELETE" for method, _, _ in stub.requests)


def test_ctrl_c_cancels_the_job(stub: StubDaemon, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "generate", "hang", "--socket", stub.path],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert stub.subscribed.wait(60)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"generate ignored Ctrl-C for 30 s; its stderr: {err!r}")
    assert proc.returncode == 130, err
    assert "cancelled job j_1" in err
    assert ("DELETE", "/v1/jobs/j_1", None) in stub.requests


def test_ctrl_c_between_the_daemons_admission_and_its_answer_still_cancels_the_job(
        stub: StubDaemon, tmp_path: Path) -> None:
    """The interrupt cancelled the submit with the daemon's 202 unread: no job id, so no cancel, and the daemon
    ran the job for nobody."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "generate", "slow-admit", "--socket", stub.path],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert stub.admitted.wait(60)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "cancelled job j_1" in err, err
    assert ("DELETE", "/v1/jobs/j_1", None) in stub.requests


def test_ctrl_c_while_the_daemon_is_starting_submits_nothing_more(stub: StubDaemon, tmp_path: Path) -> None:
    """Nothing was admitted when Ctrl-C came between two offers of the job: generate stops offering it and exits at
    once, rather than offer it again for the grace a submit's answer is given, a job admitted then running for
    nobody."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "generate", "starting", "--socket", stub.path],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert stub.refused.wait(60)
        posts = sum(method == "POST" for method, _, _ in stub.requests)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    assert sum(method == "POST" for method, _, _ in stub.requests) == posts, stub.requests


def test_a_second_ctrl_c_exits_when_the_daemon_does_not_answer_the_cancel(stub: StubDaemon, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "generate", "stuck", "--socket", stub.path],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert stub.subscribed.wait(60)
        proc.send_signal(signal.SIGINT)
        assert stub.deleting.wait(30), "the first Ctrl-C did not send the cancel"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # the cancel is given up on, bounded, not awaited
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "the daemon did not confirm the cancel of job j_1" in err and "diffusiond cancel j_1" in err, err


def test_status_models_cancel(stub: StubDaemon, capsys: Any) -> None:
    assert main(["status", "--socket", stub.path]) == 0
    out = capsys.readouterr().out
    assert "0.1.0" in out and "tiny-0" in out and "jobs in memory: succeeded=3" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["tiny-1", "tiny", "cpu", "starting", "-", "0"] in rows, out  # no pid yet: "-", not "None"
    assert ": ok, ready, preloading tiny" in out, out  # ready means admitting (issue 27): what still loads is said
    assert main(["status", "--socket", stub.path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] is True
    assert main(["status", "--socket", stub.path, "--wait", "5", "--json"]) == 0  # ready at once: no wait
    assert json.loads(capsys.readouterr().out)["ready"] is True
    assert main(["models", "--socket", stub.path]) == 0
    lines = capsys.readouterr().out.splitlines()  # edits "?" while not known, not "-" (none)
    assert lines[0].split() == ["id", "task", "device", "state", "offload", "edits", "defaults", "approximations"]
    assert lines[1].split() == ["tiny", "text-to-image", "cpu", "ready", "-", "-", "128x128,", "4", "steps,",
                                "guidance", "5", "-"], lines
    assert lines[2].split() == ["flux", "text-to-image", "cpu", "starting", "-", "?", "?", "-"], lines
    assert lines[3] == "?: not known until the model has loaded once", lines
    assert main(["cancel", "j_done", "--socket", stub.path]) == 1
    assert "job j_done already finished (succeeded)" in capsys.readouterr().err
    assert main(["cancel", "j_404", "--socket", stub.path]) == 1
    assert "no job j_404" in capsys.readouterr().err


# exceptions: one root, nothing of aiohttp's or asyncio's leaks --------------------------------
def test_client_exceptions_share_one_root() -> None:
    assert issubclass(DaemonError, ClientError) and issubclass(DaemonUnreachable, ClientError)
    assert issubclass(ClientTimeout, ClientError) and issubclass(ClientTimeout, TimeoutError)


@pytest.fixture
def silent_socket(tmp_path: Path) -> Iterator[str]:
    """A socket that accepts connections (the kernel's backlog does) and never answers."""
    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        s.listen(16)
        yield path


def test_a_daemon_that_does_not_answer_exits_3_with_a_one_line_timeout(
    silent_socket: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("diffusiond.cli.QUICK_TIMEOUT_S", 0.3)
    assert main(["status", "--socket", silent_socket]) == 3
    err = capsys.readouterr().err
    assert err == f"error: GET /health (daemon at {silent_socket}) took longer than 0.3 s\n", err


def test_status_wait_on_a_daemon_that_does_not_answer_gives_up_when_the_wait_ends(
    silent_socket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each ask of the wait took the 30 s request bound whatever --wait said, and its timeout ended the wait."""
    assert main(["status", "--socket", silent_socket, "--wait", "0.5"]) == 3
    err = capsys.readouterr().err
    assert err == f"error: waiting for the daemon to be ready (daemon at {silent_socket}) took longer than 0.5 s\n", err


def test_client_timeout_is_a_client_error(silent_socket: str) -> None:
    async def ask() -> None:
        async with AsyncClient(silent_socket, timeout=0.2) as client:
            await client.models()

    with pytest.raises(ClientTimeout) as info:
        asyncio.run(ask())
    assert info.value.seconds == 0.2 and info.value.what == "GET /v1/models"


def test_wait_past_its_timeout_raises_client_timeout(stub: StubDaemon) -> None:
    async def wait() -> None:
        async with AsyncClient(stub.path) as client:
            job = await client.create_job({"prompt": "hang"})
            await client.wait(job["id"], timeout=0.3)

    with pytest.raises(ClientTimeout, match=r"waiting for job j_1 .* took longer than 0\.3 s"):
        asyncio.run(wait())


def test_wait_returns_a_failed_job_rather_than_raising(stub: StubDaemon) -> None:
    async def wait() -> dict[str, Any]:
        async with AsyncClient(stub.path) as client:
            job = await client.create_job({"prompt": "fail"})
            seen: list[str] = []
            final = await client.wait(job["id"], on_event=lambda name, data: seen.append(name))
            assert seen == ["progress", "progress", "error"]
            return final

    assert asyncio.run(wait())["status"] == "failed"


def test_something_that_is_not_http_on_the_socket_is_unreachable(tmp_path: Path) -> None:
    path = str(tmp_path / "garbage.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()

    async def ask() -> None:
        async with AsyncClient(path, timeout=10) as client:
            await client.health()

    try:
        with pytest.raises(DaemonUnreachable):
            asyncio.run(ask())
    finally:
        thread.join(10)
        server.close()


# a reader that stops reading ------------------------------------------------------------------
@pytest.mark.parametrize("args", [["status"], ["models", "--json"]], ids=" ".join)
def test_a_closed_pipe_on_stdout_exits_141_without_a_traceback(stub: StubDaemon, args: list[str]) -> None:
    """``diffusiond status | head -1`` once head has gone: the read end is closed before the CLI
    writes a byte, so the write fails every time, not only when the timing is unlucky."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "diffusiond", *args, "--socket", stub.path],
                            stdout=write, stderr=subprocess.PIPE, text=True)  # fmt: skip
    os.close(write)
    os.close(read)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert err == "", err
