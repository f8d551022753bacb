"""``diffusiond generate --preview``: previews drawn in terminals that can show images, nothing
anywhere else. The end-to-end tests run the real CLI against a real daemon on ``tiny``, with
stderr on a pseudo-terminal, and decode the picture out of the escape codes the terminal got."""

from __future__ import annotations

import base64
import io
import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from diffusiond.commands.preview import KITTY_IMAGE_ID, image_protocol, iterm2_image, kitty_image

NOT_A_TERMINAL_OF_IMAGES = {"TERM": "xterm-256color"}


@pytest.mark.parametrize(("env", "protocol"), [
    ({"TERM": "xterm-kitty"}, "kitty"),
    ({"TERM": "xterm-256color", "KITTY_WINDOW_ID": "3"}, "kitty"),
    ({"TERM": "xterm-256color", "TERM_PROGRAM": "iTerm.app"}, "iterm2"),
    ({"TERM": "xterm-256color", "LC_TERMINAL": "iTerm2"}, "iterm2"),  # iTerm2 over ssh
    ({"TERM": "xterm-256color", "TERM_PROGRAM": "WezTerm"}, "iterm2"),
    ({"TERM": "xterm-256color", "TERM_PROGRAM": "Apple_Terminal"}, None),
    ({"TERM": "dumb"}, None),
    ({}, None),
])
def test_the_terminal_is_told_from_the_environment(env: dict[str, str], protocol: str | None) -> None:
    assert image_protocol(env) == protocol


def _kitty_payload(text: str) -> tuple[list[str], str]:
    codes = re.findall(r"\x1b_G([^;]*);([^\x1b]*)\x1b\\", text)
    return [keys for keys, _ in codes], "".join(data for _, data in codes)


def test_kitty_images_go_in_chunks_that_join_back_to_the_picture() -> None:
    b64 = base64.b64encode(os.urandom(10_000)).decode()
    keys, payload = _kitty_payload(kitty_image(b64, rows=5))
    assert payload == b64
    assert len(keys) == -(-len(b64) // 4096)
    assert keys[0] == f"a=T,f=100,i={KITTY_IMAGE_ID},q=2,C=1,r=5,m=1"
    assert keys[1:-1] == ["m=1"] * (len(keys) - 2) and keys[-1] == "m=0"


def test_iterm2_images_carry_their_size_and_height() -> None:
    assert iterm2_image("QUJD", 3, rows=4) == "\x1b]1337;File=inline=1;size=3;height=4;preserveAspectRatio=1:QUJD\x07"


def _generate_on_a_pty(sock: Path, out: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """``generate --preview`` with stderr on a pseudo-terminal: (exit code, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    clean = {k: v for k, v in os.environ.items() if k not in ("TERM", "TERM_PROGRAM", "LC_TERMINAL", "KITTY_WINDOW_ID")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffusiond", "generate", "a lighthouse", "--socket", str(sock), "--steps", "4",
         "--size", "64x64", "--seed", "3", "--preview", "-o", str(out), "--json"],
        stdout=subprocess.PIPE, stderr=slave, env={**clean, **env})
    os.close(slave)
    seen = bytearray()
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            pytest.fail("generate --preview wrote nothing to its terminal for 120 s")
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.stdout is not None
    stdout = proc.stdout.read().decode()
    return proc.wait(60), stdout, seen.decode(errors="replace")


def test_generate_preview_draws_png_pictures_in_kitty(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny")
    code, stdout, terminal = _generate_on_a_pty(d.socket, tmp_path / "out.png", {"TERM": "xterm-kitty"})
    assert code == 0, terminal
    job = json.loads(stdout)["job"]
    assert job["request"]["preview"] == {"every": 1, "format": "png", "max_side": 256}
    images = re.findall(r"\x1b_Ga=T[^;]*;.*?(?=\x1b_Ga=T|\Z)", terminal, re.S)
    assert images, "no kitty image in what the terminal got"
    for drawn in images:
        _, payload = _kitty_payload(drawn)
        picture = Image.open(io.BytesIO(base64.b64decode(payload)))
        assert picture.format == "PNG" and picture.size == (64, 64)
    assert (tmp_path / "out.png").exists()


def test_generate_preview_draws_jpeg_pictures_in_iterm2(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny")
    code, _, terminal = _generate_on_a_pty(d.socket, tmp_path / "out.png",
                                           {"TERM": "xterm-256color", "TERM_PROGRAM": "iTerm.app"})
    assert code == 0, terminal
    iterm2 = r"\x1b\]1337;File=inline=1;size=\d+;height=\d+;preserveAspectRatio=1:([^\x07]*)\x07"
    pictures = re.findall(iterm2, terminal)
    assert pictures
    assert Image.open(io.BytesIO(base64.b64decode(pictures[-1]))).format == "JPEG"


def test_generate_preview_elsewhere_asks_for_none_and_draws_nothing(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny")
    code, stdout, terminal = _generate_on_a_pty(d.socket, tmp_path / "out.png", NOT_A_TERMINAL_OF_IMAGES)
    assert code == 0, terminal
    assert json.loads(stdout)["job"]["request"]["preview"] is None
    assert "\x1b_G" not in terminal and "1337;" not in terminal
    assert "4/4 steps" in terminal  # the progress bar is still there
