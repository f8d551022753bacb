"""The ``diffusiond`` command line against a real daemon, run as a user runs it: a subprocess
(``python -m diffusiond ...``), judged by its exit code (docs/api.md: 0 success, 1 failed or rejected,
2 usage, 3 no daemon), what it prints and the files it writes.

One daemon serves the module (``tiny``, and ``hold``, a synthetic model whose batches never finish
within a test, for a job that must be running when the CLI cancels it); the demo flow starts its
own, the way a person would, through ``diffusiond serve`` and ``$DIFFUSIOND_SOCKET``.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, wait_job
from PIL import Image

from conftest import ROOT
from diffusiond.cli import main

HOLD_MODEL = "hold=synthetic:compute_ms=300000"
HOLD_JOB = ["--model", "hold", "--size", "64x64", "--steps", "500"]
"""A generate that computes until it is cancelled or its deadline passes."""
ENV = {"OMP_NUM_THREADS": "1"}  # see test_daemon_lifecycle.py
FAST = ["--size", "64x64", "--steps", "2"]


@pytest.fixture(scope="module")
def cli_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("cli")
    with shared_daemon(tmp, ["--model", "tiny", "--model", HOLD_MODEL, "--job-timeout", "120"], model_cache, ENV) as d:
        yield d


@pytest.fixture
def sock(cli_daemon: Daemon) -> str:
    assert cli_daemon.proc is not None and cli_daemon.proc.poll() is None, cli_daemon.log()
    return str(cli_daemon.socket)


def cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``diffusiond ARGS`` in a fresh interpreter, with the socket variables of this machine unset."""
    base = {
        k: v for k, v in os.environ.items() if k not in ("DIFFUSIOND_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")
    }
    return subprocess.run(
        [sys.executable, "-m", "diffusiond", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env={**base, **(env or {})},
        timeout=timeout,
        check=False,
    )


def seeds(stdout: str) -> dict[str, int]:
    """``PATH  seed=S`` lines -> {PATH: S}."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)  seed=(\d+)$", stdout, re.M)}


def image(path: Path) -> Image.Image:
    img = Image.open(path)
    img.load()
    return img


# generate -------------------------------------------------------------------------------------
def test_generate_writes_a_png_and_prints_path_and_seed(sock: str, tmp_path: Path) -> None:
    out = tmp_path / "out.png"
    r = cli("generate", "a fox", "--socket", sock, *FAST, "-o", str(out))
    assert r.returncode == 0, r.stderr
    img = image(out)
    assert img.format == "PNG" and img.size == (64, 64)
    printed = seeds(r.stdout)
    assert list(printed) == [str(out)]
    assert not list(tmp_path.glob(".*.part"))  # no half-written leftovers
    # the printed seed reproduces the image
    again = tmp_path / "again.png"
    r = cli("generate", "a fox", "--socket", sock, *FAST, "--seed", str(printed[str(out)]), "-o", str(again))
    assert r.returncode == 0, r.stderr
    assert seeds(r.stdout) == {str(again): printed[str(out)]}
    assert again.read_bytes() == out.read_bytes()


def test_generate_n2_writes_indexed_files(sock: str, tmp_path: Path) -> None:
    out = tmp_path / "out.png"
    r = cli("generate", "a fox", "--socket", sock, *FAST, "-n", "2", "--seed", "40", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert not out.exists()
    first, second = tmp_path / "out-0.png", tmp_path / "out-1.png"
    assert seeds(r.stdout) == {str(first): 40, str(second): 41}
    assert image(first).size == image(second).size == (64, 64)
    assert first.read_bytes() != second.read_bytes()


def test_generate_json(sock: str, tmp_path: Path) -> None:
    r = cli("generate", "a fox", "--socket", sock, *FAST, "--seed", "5", "--json", "-o", str(tmp_path / "j.png"))
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["job"]["status"] == "succeeded" and answer["job"]["id"].startswith("j_")
    (f,) = answer["files"]
    assert f["path"] == str(tmp_path / "j.png") and f["seed"] == 5
    assert f["bytes"] == (tmp_path / "j.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "name", "check"),
    [
        (["-o", "x.jpg"], "x.jpg", "JPEG"),
        (["--format", "webp", "-o", "x.webp"], "x.webp", "WEBP"),
        (["-o", "x.npy"], "x.npy", "npy"),
    ],
)
def test_generate_format_from_flag_or_extension(
    sock: str, tmp_path: Path, args: list[str], name: str, check: str
) -> None:
    r = cli("generate", "a fox", "--socket", sock, *FAST, *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    if check == "npy":
        a = np.load(tmp_path / name, allow_pickle=False)
        assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    else:
        assert image(tmp_path / name).format == check


def test_generate_without_o_names_the_file_after_the_job(sock: str, tmp_path: Path) -> None:
    r = cli("generate", "a fox", "--socket", sock, *FAST, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["files"][0]["path"] == f"{answer['job']['id']}.png"
    assert image(tmp_path / f"{answer['job']['id']}.png").size == (64, 64)


def test_generate_o_dir_slash_writes_default_names_inside_it(sock: str, tmp_path: Path) -> None:
    """Once ``-o outdir/`` wrote a PNG named ``outdir`` when outdir did not exist; now a missing one
    is refused before the job is sent, and an existing one gets ``<job id>.png`` inside."""
    r = cli("generate", "a fox", "--socket", sock, *FAST, "-o", f"{tmp_path}/outdir/")
    assert r.returncode == 2 and "directory" in r.stderr and "does not exist; create it first" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "outdir").mkdir()
    r = cli("generate", "a fox", "--socket", sock, *FAST, "-n", "2", "--json", "-o", f"{tmp_path}/outdir/")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["job"]["id"]
    assert sorted(p.name for p in (tmp_path / "outdir").iterdir()) == [f"{job_id}-0.png", f"{job_id}-1.png"]


def test_generate_image_dash_reads_the_picture_from_stdin(sock: str, tmp_path: Path) -> None:
    """``--image -`` as ``-o -``: once ``--image -: No such file or directory``."""
    picture = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(picture, "PNG")
    out = tmp_path / "edit.png"
    r = subprocess.run([sys.executable, "-m", "diffusiond", "generate", "a fox", "--socket", sock, "--steps", "2",
                        "--image", "-", "-o", str(out)], input=picture.getvalue(), capture_output=True, cwd=ROOT,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr.decode()
    assert image(out).size == (64, 64)  # an edit takes its input's size


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "63x64"], "width must be a multiple of 8 between 64 and 4096, got 63"),
        (["--steps", "501"], "steps must be between 1 and 500, got 501"),
        (["--model", "nope"], "model 'nope' is not served here"),
        (["--frames", "4"], "num_frames is only for text-to-video models"),
    ],
)
def test_rejected_request_exits_1_with_the_daemons_message(
    sock: str, tmp_path: Path, args: list[str], message: str
) -> None:
    r = cli("generate", "a fox", "--socket", sock, "-o", str(tmp_path / "x.png"), *args)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert message in r.stderr
    assert not list(tmp_path.iterdir())


def test_a_refused_format_names_where_it_came_from(sock: str, tmp_path: Path) -> None:
    """A format -o's extension chose was refused as "field output_format: --format", a flag never
    given."""
    clip = tmp_path / "clip.mp4"
    r = cli("generate", "a fox", "--socket", sock, "-o", str(clip), *FAST)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "output_format 'mp4' is not available for text-to-image" in r.stderr, r.stderr
    assert f"field output_format: -o {clip}'s extension (or --format))" in r.stderr, r.stderr
    r = cli("generate", "a fox", "--socket", sock, "--format", "mp4", "-o", str(tmp_path / "clip"), *FAST)
    assert r.returncode == 1 and "field output_format: --format)" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_failed_job_exits_1_with_the_reason_and_stage(sock: str, tmp_path: Path) -> None:
    r = cli("generate", "x", "--socket", sock, *HOLD_JOB, "--timeout", "1", "-o", str(tmp_path / "x.png"))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "passed its deadline of 1s while computing" in r.stderr and "stage computing" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_interrupt_cancels_the_job(sock: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "generate", "interrupt me", "--socket", sock, *HOLD_JOB,
         "-o", str(tmp_path / "x.png")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        job = asyncio.run(_running_job(sock, "interrupt me"))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert f"cancelled job {job['id']}" in err
    assert asyncio.run(_job(sock, job["id"]))["status"] == "cancelled"


async def _running_job(sock: str, prompt: str, timeout: float = 60) -> dict[str, Any]:
    async with http(Path(sock)) as s:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            async with s.get("/v1/jobs") as r:
                jobs = [j for j in (await r.json())["data"] if j["request"]["prompt"] == prompt]
            if jobs and jobs[0]["status"] == "running" and jobs[0]["progress"]["step"] >= 1:
                return jobs[0]
            await asyncio.sleep(0.05)
    pytest.fail(f"no running job with prompt {prompt!r} after {timeout}s")


async def _job(sock: str, job_id: str) -> dict[str, Any]:
    async with http(Path(sock)) as s:
        return await wait_job(s, job_id, timeout=30)


# no daemon ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [["generate", "a fox"], ["status"], ["models"], ["cancel", "j_1"], ["sleep"], ["wake"]],
    ids=lambda c: c[0],
)
def test_no_daemon_exits_3_and_says_how_to_start_one(tmp_path: Path, command: list[str]) -> None:
    path = str(tmp_path / "none.sock")
    r = cli(*command, "--socket", path)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert path in r.stderr and f"diffusiond serve --socket {path}" in r.stderr
    assert r.stdout == ""
    if command[0] == "generate":  # it waited for a daemon that might have been starting, said so once, and gave up
        assert r.stderr.count(f"waiting for a daemon at {path} (No such file or directory; up to 10 s) ...") == 1
        assert "(No such file or directory, still after 10 s)" in r.stderr, r.stderr


def test_generate_waits_for_a_daemon_that_binds_its_socket_a_moment_later(sock: str, tmp_path: Path) -> None:
    """README's ``serve &`` then ``generate`` at once: the path holds first a stale socket file nothing
    listens on (refused), then nothing (ENOENT), then the daemon's socket. generate waits, says so once, and
    writes the image; before, it was exit 3, "start one", for the daemon just started."""
    path = tmp_path / "late.sock"
    out = tmp_path / "late.png"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # bound, never listening: connect() is refused
    gen = subprocess.Popen([sys.executable, "-m", "diffusiond", "generate", "a fox", "--socket", str(path), *FAST,
                            "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert gen.stderr is not None
        first = gen.stderr.readline()  # generate has met the refusal and waits
        assert first.startswith(f"waiting for a daemon at {path} (Connection refused; up to 10 s)"), first
        stale.close()
        path.unlink()
        os.symlink(sock, path)  # the daemon's socket appears at the path
        stdout, stderr = gen.communicate(timeout=120)
    finally:
        stale.close()
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    assert gen.returncode == 0, stderr
    assert seeds(stdout).keys() == {str(out)} and image(out).format == "PNG"
    assert "waiting for a daemon" not in stderr  # once, not a line per attempt


# status, models, cancel, sleep, wake ----------------------------------------------------------
def test_status_and_models(sock: str, cli_daemon: Daemon) -> None:
    r = cli("status", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert f"at {sock}: ok, ready" in r.stdout
    assert re.search(r"^id\s+model\s+device\s+state\s+pid\s+restarts$", r.stdout, re.M)
    for pid in cli_daemon.worker_pids():
        assert re.search(rf"\bready\s+{pid}\s+0$", r.stdout, re.M), r.stdout
    r = cli("status", "--socket", sock, "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["ready"] is True and sorted(w["model"] for w in status["workers"]) == ["hold", "tiny"]

    r = cli("models", "--socket", sock)
    assert r.returncode == 0, r.stderr
    defaults = r"\d+x\d+, \d+ steps, guidance [\d.]+"  # the model's own defaults column
    assert re.search(rf"^tiny\s+text-to-image\s+cpu\s+ready\s+none\s+image-to-image,inpainting\s+{defaults}\s+-$",
                     r.stdout, re.M), r.stdout
    assert re.search(rf"^hold\s+text-to-image\s+cpu\s+ready\s+none\s+-\s+{defaults}\s+-$", r.stdout, re.M), r.stdout
    r = cli("models", "--socket", sock, "--json")
    assert r.returncode == 0, r.stderr
    assert [m["id"] for m in json.loads(r.stdout)["data"]] == ["tiny", "hold"]


def test_cancel(sock: str) -> None:
    r = cli("cancel", "j_0000000000000000", "--socket", sock)
    assert r.returncode == 1
    assert "no job 'j_0000000000000000'" in r.stderr

    async def submit() -> str:
        async with (
            http(Path(sock)) as s,
            s.post(
                "/v1/jobs", json={"model": "hold", "prompt": "cancel me", "width": 64, "height": 64, "steps": 500}
            ) as r,
        ):
            assert r.status == 202
            return str((await r.json())["id"])

    job_id = asyncio.run(submit())
    r = cli("cancel", job_id, "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"job {job_id} cancelled"
    assert asyncio.run(_job(sock, job_id))["status"] == "cancelled"
    r = cli("cancel", job_id, "--socket", sock)
    assert r.returncode == 1
    assert f"job {job_id} already finished (cancelled)" in r.stderr


def test_history_of_a_model_not_served_says_so(sock: str) -> None:
    """"no jobs", exit 0, for a mistyped model, which every other command refuses. History may list an
    earlier run's model, so it stays exit 0, with a hint."""
    r = cli("history", "--model", "nosuch", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("no jobs ('nosuch' is not served now (models: tiny, hold); its jobs from earlier runs would be "
                        "listed here)\n"), r.stdout
    r = cli("history", "--model", "nosuch", "--json", "--socket", sock)
    assert r.returncode == 0 and json.loads(r.stdout)["data"] == [], r.stdout


@pytest.mark.parametrize(("command", "reader"), [("status", "head -1"), ("models --json", "head -c1")])
def test_output_into_a_reader_that_stops_early_ends_quietly(sock: str, command: str, reader: str) -> None:
    """A shell pipeline, as people type it: whether the CLI still writes after the reader has gone
    depends on timing (exit 0 or 141), but it never prints a traceback."""
    cli_ = f"{shlex.quote(sys.executable)} -m diffusiond {command} --socket {shlex.quote(sock)}"
    script = f"{cli_} | {reader}; echo; echo \"rc=${{PIPESTATUS[0]}}\""
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert r.stderr == "", r.stderr
    assert re.search(r"^rc=(0|141)$", r.stdout, re.M), r.stdout


def test_sleep_and_wake(sock: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        r = cli("sleep", "--socket", sock)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("daemon asleep")
        r = cli("status", "--socket", sock, "--json")
        assert json.loads(r.stdout)["sleeping"] is True
        assert "sleeping" in cli("status", "--socket", sock).stdout
    finally:
        r = cli("wake", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("daemon awake")
    assert json.loads(cli("status", "--socket", sock, "--json").stdout)["sleeping"] is False
    # the same commands in-process return the documented exit code, not just a falsy value
    assert main(["sleep", "--socket", sock]) == 0
    assert main(["wake", "--socket", sock]) == 0
    assert "daemon awake" in capsys.readouterr().out
    r = cli("generate", "a fox", "--socket", sock, *FAST, "-o", str(tmp_path / "awake.png"))
    assert r.returncode == 0, r.stderr


# the demo -------------------------------------------------------------------------------------
def test_make_demo_script(tmp_path: Path, model_cache: Path) -> None:
    """``make demo`` runs scripts/demo.sh: serve, wait for ready, status, generate, stop."""
    out = tmp_path / "demo.png"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        **ENV,
        "PY": sys.executable,
        "DEMO_OUT": str(out),
        "TMPDIR": str(scratch),
        "DIFFUSIOND_CACHE": str(model_cache),
        "XDG_STATE_HOME": str(tmp_path / "state-home"),  # the user's state dir: the demo must not write there
    }
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert ": ok, ready" in r.stdout and f"wrote {out}" in r.stdout
    assert seeds(r.stdout) == {str(out): 42}
    img = image(out)
    assert img.format == "PNG" and img.size == (128, 128)
    assert not (tmp_path / "state-home").exists()  # its own state dir: no demo job in the user's history
    # the script's own folder (mktemp -d: socket, cache, state) is gone, so its daemon stopped
    assert [p.name for p in scratch.iterdir() if p.name.startswith("tmp.")] == []


def test_serve_and_clients_find_each_other_through_DIFFUSIOND_SOCKET(tmp_path: Path, model_cache: Path) -> None:
    """The same flow by hand with no --socket anywhere: ``serve`` in the background, ``status``
    until ready, ``generate`` with the model's defaults, ``models``, SIGTERM."""
    env = {"DIFFUSIOND_SOCKET": str(tmp_path / "demo.sock"), "DIFFUSIOND_CACHE": str(model_cache), **ENV}
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "serve", "--model", "tiny"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            r = cli("status", "--wait", "5", env=env)  # waits in one process, as a script would
            if r.returncode == 0 and ", ready" in r.stdout:
                break
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the daemon never became ready"
            assert r.returncode in (0, 3), r.stderr
        r = cli("generate", "a lighthouse at dusk", "-o", "lighthouse.png", cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("lighthouse.png  seed=")
        assert image(tmp_path / "lighthouse.png").format == "PNG"
        r = cli("models", env=env)
        assert r.returncode == 0 and r.stdout.splitlines()[1].startswith("tiny"), r.stdout
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        log.close()
    assert not (tmp_path / "demo.sock").exists()
    r = cli("status", env=env)
    assert r.returncode == 3 and "diffusiond serve" in r.stderr
