"""``generate -o`` naming what is no new regular file, or a directory it may not write in.

A device (``-o /dev/null``), a FIFO or ``/dev/stdout`` was replaced by the temp file's rename, which as root
put a PNG where /dev/null was, and otherwise failed after the job for want of a temp file in /dev; a symlink
was replaced by a regular file. A directory without write permission was found only after the job ran.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from diffusiond.commands.generate import UsageError, check_output_dir, download

DATA = b"\x89PNG fake output bytes"


class FakeClient:
    async def stream_output(self, job_id: str, k: int, fileobj: BinaryIO) -> int:
        fileobj.write(DATA)
        return len(DATA)


def fetch(path: Path) -> int:
    return asyncio.run(download(FakeClient(), "j_1", 0, path))  # type: ignore[arg-type]


def test_output_into_a_fifo_writes_into_it_and_leaves_it_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the writer's open does not block
    try:
        assert fetch(fifo) == len(DATA)
        assert os.read(reader, 1 << 16) == DATA
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["pipe"]  # no temp file left beside it


def test_output_through_a_symlink_replaces_the_file_it_names_and_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "out.png"
    target.write_bytes(b"old")
    link = tmp_path / "out.png"
    link.symlink_to(target)
    fetch(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == DATA
    assert sorted(os.listdir(tmp_path / "real")) == ["out.png"]


def test_a_dangling_symlink_makes_the_file_it_names(tmp_path: Path) -> None:
    link = tmp_path / "out.png"
    link.symlink_to(tmp_path / "made.png")
    fetch(link)
    assert link.is_symlink() and (tmp_path / "made.png").read_bytes() == DATA


def _refuse(denied: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Permission bits do not bind root, who runs some test machines: the check is asked through os.access."""
    real = os.access

    def access(path: Any, mode: int, **kw: Any) -> bool:
        return False if Path(path) == denied and mode & os.W_OK else real(path, mode, **kw)

    monkeypatch.setattr(os, "access", access)


@pytest.mark.parametrize("output", ["ro/out.png", "ro/", "ro"])
def test_a_directory_without_write_permission_is_refused_before_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    (tmp_path / "ro").mkdir()
    _refuse(tmp_path / "ro", monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"no permission to create files in directory '.*ro' \(-o ro"):
        check_output_dir(output)


def test_a_writable_fifo_in_a_directory_without_write_permission_is_fine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "pipe")  # as -o /dev/null: /dev is not the user's to write in, /dev/null is
    _refuse(tmp_path, monkeypatch)
    check_output_dir(str(tmp_path / "pipe"))
    _refuse(tmp_path / "pipe", monkeypatch)
    with pytest.raises(UsageError, match="no permission to write"):
        check_output_dir(str(tmp_path / "pipe"))
