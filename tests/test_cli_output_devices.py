"""``generate`` against a real daemon on ``tiny``, writing where no ordinary new file is: ``-o /dev/stdout``
into a pipe gets the output's bytes alone (the ``PATH  seed=S`` line went after them, into the picture), and
``-o`` naming a device leaves it a device (the temp file's rename once replaced /dev/null, as root)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonkit import shared_daemon

from conftest import ROOT

ENV = {"OMP_NUM_THREADS": "1"}
PNG_END = b"IEND\xaeB`\x82"


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[str]:
    with shared_daemon(tmp_path_factory.mktemp("cli-devices"), ["--model", "tiny"], model_cache, ENV) as d:
        yield str(d.socket)


def generate(sock: str, output: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "diffusiond", "generate", "a", "--socket", sock, "--size", "64x64", "--steps", "1",
         "--seed", "3", "-o", output],
        capture_output=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=120, check=False)


def test_output_to_dev_stdout_in_a_pipe_is_the_bytes_alone(sock: str) -> None:
    done = generate(sock, "/dev/stdout")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(b"\x89PNG") and done.stdout.endswith(PNG_END), done.stdout[-80:]
    assert b"/dev/stdout  seed=3" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node takes root; the rename replaced one only as root")
def test_output_to_a_device_leaves_it_a_device(sock: str, tmp_path: Path) -> None:
    """A private node of /dev/null's device, never /dev/null itself: the code this guards once replaced it."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    done = generate(sock, str(null))
    assert done.returncode == 0, done.stderr
    after = os.stat(null)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == os.makedev(1, 3)
    assert f"{null}  seed=3".encode() in done.stdout


def test_output_to_stdout_into_a_pipe_nobody_reads_exits_141(sock: str) -> None:
    """``generate -o - | head -c 0``: the reader is gone before the bytes come. The exit status is 128 + SIGPIPE,
    what the shell reports for any other tool the closed pipe ended, so ``set -o pipefail`` scripts see the same."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "diffusiond", "generate", "a", "--socket", sock, "--size", "64x64", "--steps", "1",
             "-o", "-"], stdout=write, stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, **ENV}, timeout=120,
            check=False)
    finally:
        os.close(write)
    assert done.returncode == 141, done.stderr
    assert b"Traceback" not in done.stderr, done.stderr
