"""A newcomer's first hour (issue 25), each step as a new user takes it: a real daemon on a real
socket, the CLI as a subprocess, judged by exit codes, what it prints and what the daemon did.

One daemon serves the module: ``tiny``, ``tiny-video`` (sizes it cannot make) and ``hold``, a
synthetic model whose batches never finish within a test, for a job that must be running when a
signal or a cancel reaches it.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonkit import Daemon, http, shared_daemon, wait_job
from test_daemon_cli import HOLD_JOB, HOLD_MODEL, _job, _running_job, cli

from conftest import ROOT
from diffusiond.cli import main

ENV = {"OMP_NUM_THREADS": "1"}
FAST = ["--size", "64x64", "--steps", "2"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("newcomer")
    args = ["--model", "tiny", "--model", "tiny-video", "--model", HOLD_MODEL, "--job-timeout", "120"]
    with shared_daemon(tmp, args, model_cache, ENV) as d:
        yield d


@pytest.fixture
def sock(daemon: Daemon) -> str:
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
    return str(daemon.socket)


async def post(sock: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http(Path(sock)) as s, s.post("/v1/jobs", json=body) as r:
        answer = await r.json()
        if r.status == 202:
            async with s.delete(f"/v1/jobs/{answer['id']}?finished=keep"):
                pass
        return r.status, answer


# 1. progress off a terminal ---------------------------------------------------------------------
def test_generate_off_a_terminal_prints_a_progress_line_now_and_then(sock: str, tmp_path: Path) -> None:
    r = cli("generate", "a fox", "--socket", sock, *FAST, "-o", str(tmp_path / "fox.png"))  # stderr: a pipe
    assert r.returncode == 0, r.stderr
    assert re.search(r"^job j_\w+ step [12]/2 \((50|100) %\)$", r.stderr, re.M), r.stderr
    assert "\r" not in r.stderr  # no bar animation in a log


def test_generate_o_dash_writes_the_one_output_to_stdout(sock: str, tmp_path: Path) -> None:
    """``-o -`` wrote a file named ``-`` and its "path seed" line to stdout."""
    env = {k: v for k, v in os.environ.items() if k != "DIFFUSIOND_SOCKET"}
    argv = [sys.executable, "-m", "diffusiond", "generate", "a fox", "--socket", sock, *FAST, "--seed", "3", "-o", "-"]
    r = subprocess.run(argv, capture_output=True, cwd=tmp_path, env={**env, **ENV}, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.startswith(b"\x89PNG\r\n\x1a\n"), r.stderr
    assert b"stdout  seed=3" in r.stderr and not (tmp_path / "-").exists()
    for extra in (["-n", "2"], ["--json"]):  # refused before the job is sent
        refused = cli("generate", "a fox", "--socket", sock, *FAST, "-o", "-", *extra, cwd=tmp_path)
        assert refused.returncode == 2 and "-o - writes one output to stdout" in refused.stderr, refused.stderr
    assert not (tmp_path / "-").exists()
    # a terminal on stdout is refused before the job (the bytes would garble it), and a reader that goes away
    # mid-stream ends the command quietly, without a traceback
    import pty

    leader, follower = pty.openpty()
    try:
        tty = subprocess.run(argv, stdout=follower, stderr=subprocess.PIPE, cwd=tmp_path, env={**env, **ENV},
                             timeout=120, check=False)
    finally:
        os.close(follower)
        os.close(leader)
    assert tty.returncode == 2 and b"which is a terminal here" in tty.stderr, tty.stderr
    big = [*argv, "--size", "256x256", "--format", "npy"]  # 192 KiB: past the pipe's buffer once head has gone
    gone = subprocess.run(f"{subprocess.list2cmdline(big)} | head -c 8 > /dev/null", shell=True, cwd=tmp_path,
                          env={**env, **ENV}, capture_output=True, timeout=120, check=False)
    assert b"Traceback" not in gone.stderr and b"Exception ignored" not in gone.stderr, gone.stderr


def test_the_python_clients_pil_on_a_video_model_is_a_value_error_saying_what_to_pass(sock: str) -> None:
    """It failed deep in a traceback about a PNG the caller never asked for; no job is made."""
    import diffusiond

    with diffusiond.Client(sock) as c:
        before = sum(c.health()["jobs"].values())
        with pytest.raises(ValueError, match=r"output='pil' asks for PNG, which model 'tiny-video' does not make .*"
                                             r"output_format='gif' or 'webp'"):
            c.generate("a clip", model="tiny-video", output="pil")
        assert sum(c.health()["jobs"].values()) == before
        with pytest.raises(diffusiond.DaemonError):  # a format the caller asked for is the daemon's to refuse
            c.generate("a clip", model="tiny-video", output="pil", output_format="png")


def test_progress_lines_come_at_tenths_and_at_most_once_a_second() -> None:
    from diffusiond.commands.progress import ProgressBar

    now = [0.0]
    out = io.StringIO()
    bar = ProgressBar(out, clock=lambda: now[0])
    bar.job_id = "j_1"
    for step in range(1, 21):
        now[0] += 0.4
        bar.update(step, 20, "computing")
    lines = out.getvalue().splitlines()
    assert lines[0] == "job j_1 step 1/20 (5 %)" and 5 <= len(lines) <= 10, lines
    slow = io.StringIO()
    bar = ProgressBar(slow, clock=lambda: now[0])
    for step in range(1, 4):  # 3 of 100 steps, 6 s apart: no new tenth, still a line every 5 s
        now[0] += 6
        bar.update(step, 100)
    assert len(slow.getvalue().splitlines()) == 3


def test_progress_lines_name_each_stage_and_again_every_5_s_while_it_lasts() -> None:
    """Off a terminal nothing was printed before step 1: a model loading for minutes looked hung."""
    from diffusiond.commands.progress import ProgressBar

    now = [0.0]
    out = io.StringIO()
    bar = ProgressBar(out, clock=lambda: now[0])
    bar.job_id = "j_1"
    bar.update(0, 4, "queued")
    bar.update(stage="loading")
    for _ in range(12):  # 12 s of loading with no event: the CLI's ticks
        now[0] += 1
        bar.tick()
    bar.update(stage="waiting_for_memory")
    bar.update(0, 4, "computing")  # a first step that takes minutes (a large image on a CPU)
    for _ in range(6):
        now[0] += 1
        bar.tick()
    bar.update(1, 4)  # a progress event: no stage, the step says it
    bar.update(stage="encoding")
    assert out.getvalue().splitlines() == ["job j_1 queued", "job j_1 loading", "job j_1 still loading (5 s)",
                                           "job j_1 still loading (10 s)", "job j_1 waiting_for_memory",
                                           "job j_1 computing", "job j_1 still computing (5 s)",
                                           "job j_1 step 1/4 (25 %)", "job j_1 encoding"]
    quiet = io.StringIO()
    bar = ProgressBar(quiet, enabled=True)  # on a terminal the bar shows the stage, and ticks add nothing
    bar.update(0, 4, "loading")
    bar.tick()
    assert "\n" not in quiet.getvalue()


# 2. specs checked before the start -------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("sd={tmp}/models/sd15", "model 'sd': {tmp}/models/sd15 does not exist; give a diffusers folder"),
        ("sd={tmp}/sd15.safetensors", "model 'sd': {tmp}/sd15.safetensors does not exist"),
        ("nobody/not-cached", "model 'nobody/not-cached': nobody/not-cached is neither a folder nor a hub id in "
                              "the Hugging Face cache; download it first (`hf download nobody/not-cached`"),
        ("b=random:nope", "model 'b': unknown preset 'random:nope'; presets: random:sd15, "),
    ],
    ids=["folder", "safetensors", "hub-id", "preset"],
)
def test_serve_refuses_a_spec_it_cannot_load_in_one_line_before_start(tmp_path: Path, spec: str, words: str) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", **ENV}
    r = cli("serve", "--model", spec.format(tmp=tmp_path), "--socket", str(tmp_path / "d.sock"),
            "--state-dir", str(tmp_path / "state"), env=env, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()  # one line: what is wrong, with which value, what to do
    assert len(lines) == 1 and lines[0].startswith(f"diffusiond serve: error: {words.format(tmp=tmp_path)}"), lines
    assert "Traceback" not in r.stderr and "accepted:" not in r.stderr
    assert not (tmp_path / "d.sock").exists()


# 3. the socket path and size on /v1/jobs ------------------------------------------------------------
def test_socket_prints_the_path_the_client_uses(tmp_path: Path) -> None:
    assert cli("socket").stdout == f"/tmp/diffusiond-{os.getuid()}/diffusiond.sock\n"  # no XDG_RUNTIME_DIR
    assert cli("socket", env={"XDG_RUNTIME_DIR": str(tmp_path)}).stdout == f"{tmp_path}/diffusiond/diffusiond.sock\n"
    r = cli("socket", env={"XDG_RUNTIME_DIR": str(tmp_path), "DIFFUSIOND_SOCKET": "/x/d.sock"})
    assert r.returncode == 0 and r.stdout == "/x/d.sock\n"
    assert cli("socket", "--socket", "/y/d.sock", env={"DIFFUSIOND_SOCKET": "/x/d.sock"}).stdout == "/y/d.sock\n"


def test_S_from_diffusiond_socket_reaches_the_daemon(sock: str) -> None:
    """The README's ``S=$(diffusiond socket)`` then ``curl --unix-socket $S``."""
    cmd = f"{sys.executable} -m diffusiond socket"
    script = f'S=$({cmd}) && curl -s --unix-socket "$S" http://x/ready'
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
                       env={**os.environ, "DIFFUSIOND_SOCKET": sock})
    if r.returncode == 127:
        pytest.skip("no curl")
    assert r.returncode == 0 and '"ready"' in r.stdout, (r.stdout, r.stderr)


def test_jobs_take_size_as_images_generations_does(sock: str) -> None:
    status, job = asyncio.run(post(sock, {"prompt": "a cat", "size": "64x72", "steps": 1}))
    assert status == 202, job
    assert (job["request"]["width"], job["request"]["height"]) == (64, 72)
    status, job = asyncio.run(post(sock, {"prompt": "a cat", "size": "64x64", "width": 64, "steps": 1}))
    assert status == 202, job  # the same size twice is no conflict
    for body, words in (({"size": "64x64", "width": 72}, "size 64x64 and width 72 disagree"),
                        ({"size": "64x64", "height": 128}, "size 64x64 and height 128 disagree"),
                        ({"size": "64"}, "size must look like 512x512"),
                        ({"size": "63x64"}, "width must be a multiple of 8")):
        status, err = asyncio.run(post(sock, {"prompt": "a cat", **body}))
        assert status == 400 and err["error"]["field"] == "size" and words in err["error"]["message"], err


# 5. sleeping daemon, signals, the cancel race ----------------------------------------------------
def test_generate_against_a_sleeping_daemon_says_so(sock: str, tmp_path: Path) -> None:
    assert cli("sleep", "--socket", sock).returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "diffusiond", "generate", "sleepy", "--socket", sock, *FAST,
                             "-o", str(tmp_path / "s.png")], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert re.match(r"diffusiond is asleep: job j_\w+ waits in its queue until `diffusiond wake`", line), line
    finally:
        assert cli("wake", "--socket", sock).returncode == 0
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert (tmp_path / "s.png").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_sigterm_and_sighup_cancel_the_job_as_ctrl_c_does(sock: str, tmp_path: Path, sig: signal.Signals) -> None:
    prompt = f"stop me {sig.name}"
    proc = subprocess.Popen([sys.executable, "-m", "diffusiond", "generate", prompt, "--socket", sock, *HOLD_JOB,
                             "-o", str(tmp_path / "x.png")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        job = asyncio.run(_running_job(sock, prompt))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert f"cancelled job {job['id']}" in err
    assert asyncio.run(_job(sock, job["id"]))["status"] == "cancelled"


def test_an_interrupt_after_the_job_was_cancelled_reports_the_truth(sock: str, capsys: Any) -> None:
    """The race: the job ends cancelled before the CLI's own cancel lands (409). The CLI says it
    was cancelled; it does not claim the daemon failed to confirm, nor point at status."""
    from diffusiond.client import AsyncClient
    from diffusiond.commands.generate import GenerateState, interrupted

    async def race() -> tuple[str, int]:
        async with http(Path(sock)) as s:
            async with s.post("/v1/jobs", json={"model": "hold", "prompt": "raced", "width": 64, "height": 64,
                                                "steps": 500}) as r:
                job_id = str((await r.json())["id"])
            async with s.delete(f"/v1/jobs/{job_id}?finished=keep") as r:
                assert r.status == 200
            await wait_job(s, job_id)
        state = GenerateState(sock, job_id=job_id)
        async with AsyncClient(sock) as client:
            return job_id, await interrupted(client, state)

    job_id, code = asyncio.run(race())
    err = capsys.readouterr().err
    assert code == 130 and f"cancelled job {job_id}" in err, err
    assert "did not confirm" not in err and "diffusiond status" not in err


# 6. sizes a model cannot make --------------------------------------------------------------------
def test_tiny_video_refuses_sizes_it_cannot_make_naming_the_nearest(sock: str) -> None:
    async def models() -> dict[str, Any]:
        async with http(Path(sock)) as s, s.get("/v1/models") as r:
            return dict(await r.json())

    step = next(m for m in asyncio.run(models())["data"] if m["id"] == "tiny-video")["size_step"]
    assert step == 32  # LTX: the VAE's spatial factor
    side = 80  # the issue's --size 80x80: a multiple of 8 it cannot make
    for body, field in (({"size": f"{side}x{side}"}, "size"), ({"width": side, "height": 64}, "width"),
                        ({"width": 64, "height": side}, "height")):
        status, err = asyncio.run(post(sock, {"model": "tiny-video", "prompt": "a clip", "num_frames": 9, **body}))
        assert status == 400 and err["error"]["field"] == field, err
        assert f"must be a multiple of {step} for 'tiny-video'; use 64 or 96, got {side}" in \
            err["error"]["message"], err
    status, job = asyncio.run(post(sock, {"model": "tiny-video", "prompt": "a clip", "num_frames": 9,
                                          "size": "64x64", "steps": 2}))
    assert status == 202, job


# 7. smaller ones -----------------------------------------------------------------------------------
def test_format_and_output_name_that_disagree_are_a_usage_error(sock: str, tmp_path: Path) -> None:
    r = cli("generate", "a clip", "--socket", sock, "--format", "mp4", "-o", str(tmp_path / "clip.png"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"--format mp4 and -o {tmp_path / 'clip.png'} disagree (.png is png); name the file .mp4" in r.stderr
    assert not list(tmp_path.iterdir())


def test_a_typo_in_a_generate_flag_shows_generates_usage_with_a_suggestion(capsys: Any) -> None:
    assert main(["generate", "a fox", "--sise", "64x64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: diffusiond generate ") and "PROMPT" in err, err
    assert "diffusiond generate: error: unrecognized arguments: --sise 64x64 (did you mean --sise -> --size?)" in err


def test_an_inpainting_only_model_says_what_it_does_once() -> None:
    from diffusiond.daemon.config import Limits
    from diffusiond.daemon.edge.edits import plan_edit
    from diffusiond.daemon.errors import InvalidRequest
    from diffusiond.ipc.messages import Capabilities

    class Inpainter:
        name = "inp"
        capabilities = Capabilities(task="inpainting", edits=("inpainting",))

    with pytest.raises(InvalidRequest) as caught:
        plan_edit({"prompt": "x", "image": "AAAA"}, Inpainter(), Limits())
    assert caught.value.field == "mask" and "it inpaints: send a mask with the image" in str(caught.value), caught.value


def test_generate_on_the_inpainting_model_names_the_flag_it_lacks(sock: str, tmp_path: Path) -> None:
    """An image without a mask on an inpainting-only model was told to pick another model, in HTTP's words
: it needs a mask, and a CLI user reads the flags (``--image``, ``--mask``) to give."""
    from diffusiond.client.errors import DaemonError
    from diffusiond.commands.flags import with_flag

    r = cli("generate", "a fox", "--socket", sock, "--size", "60x64", "--steps", "1", "-o", str(tmp_path / "f.png"))
    assert r.returncode == 1 and r.stderr.rstrip().endswith("field width: --size)"), r.stderr  # the real CLI's
    refusal = DaemonError(400, "invalid_request", "model 'inp' ... send a mask", "mask")
    assert with_flag(str(refusal), refusal.field).endswith("(invalid_request, HTTP 400, field mask: --mask)")
    assert with_flag("x (field control[0].image)", "control[0].image") == "x (field control[0].image: --control)"
    assert with_flag("x (field zz)", "zz") == "x (field zz)"


def test_the_daemon_is_healthy_after_all_this(sock: str) -> None:
    """The module's daemon is still healthy after the signals and the sleep above."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = cli("status", "--socket", sock)
        if r.returncode == 0 and ": ok, ready" in r.stdout:
            return
        time.sleep(0.2)
    pytest.fail(r.stdout + r.stderr)
