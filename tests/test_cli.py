"""The CLI without a daemon: usage errors, what it says when no daemon answers, socket paths,
serve's config checks, output naming and formats, the progress bar and the SSE parser. The generate
flow and the client against a stand-in daemon are test_cli_client.py's (end-to-end tests against the
real daemon live elsewhere).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diffusiond.cli import main
from diffusiond.client import SSEParser
from diffusiond.commands.generate import UsageError, choose_format, extension_for, output_paths
from diffusiond.commands.progress import render
from diffusiond.protocol import default_socket_path

ROOT = Path(__file__).resolve().parent.parent
CLIENT_COMMANDS = [["status"], ["models"], ["cancel", "j_123"], ["sleep"], ["wake"], ["generate", "a cat"]]


def assert_unreachable_message(err: str, path: str) -> None:
    assert path in err
    assert f"diffusiond serve --socket {path}" in err
    assert "systemctl --user start diffusiond.socket" in err


# usage errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "x", "--size", "512"], "WxH"),
        (["generate", "x", "--size", "0x512"], "WxH"),
        (["generate", "x", "--format", "bmp"], "invalid choice"),
        (["generate", "x", "-n", "0"], "at least 1"),
        (["generate", "x", "--timeout", "-1"], "positive"),
        (["generate"], "PROMPT"),
        ([], "COMMAND"),
        (["serve", "--socket-mode", "999"], "octal"),
        (["generate", "x", "--seed", "abc"], "--seed: expected a whole number, got 'abc'"),
        (["status", "--wait", "-1"], "--wait: must be 0 or more, got -1"),
        (["generate", "x", "-o", "out.tif"], "-o out.tif: .tif is not a format diffusiond writes"),
    ],
)
def test_usage_errors_exit_2_with_a_message(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert needle in capsys.readouterr().err


def test_missing_output_directory_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "x", "--socket", str(tmp_path / "s"), "-o", str(tmp_path / "no" / "a.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


# no daemon -------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", CLIENT_COMMANDS, ids=lambda c: c[0])
def test_no_daemon_exits_3_and_says_how_to_start_one(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "none.sock")
    assert main([*command, "--socket", path]) == 3
    assert_unreachable_message(capsys.readouterr().err, path)


def test_status_wait_gives_up_on_a_daemon_that_never_comes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "never.sock")
    assert main(["status", "--socket", path, "--wait", "0.5"]) == 3  # tried for half a second, then unreachable
    assert_unreachable_message(capsys.readouterr().err, path)


def test_stale_socket_file_is_unreachable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # bound, never listening: connect() is refused
        assert main(["status", "--socket", path]) == 3
    assert_unreachable_message(capsys.readouterr().err, path)


def test_no_daemon_as_a_subprocess(tmp_path: Path) -> None:
    path = str(tmp_path / "none.sock")
    proc = subprocess.run(
        [sys.executable, "-m", "diffusiond", "models", "--socket", path], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3
    assert_unreachable_message(proc.stderr, path)


# socket path resolution --------------------------------------------------------------------
ENV_KEYS = ("DIFFUSIOND_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_socket_resolution_order(tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: Any) -> None:
    assert default_socket_path() == f"/tmp/diffusiond-{os.getuid()}/diffusiond.sock"
    steps = [
        ("XDG_RUNTIME_DIR", str(tmp_path / "xdg"), str(tmp_path / "xdg" / "diffusiond" / "diffusiond.sock")),
        # another unit's RuntimeDirectory= (a trainer's): the client looks where the daemon is, not there
        ("RUNTIME_DIRECTORY", str(tmp_path / "rt"), str(tmp_path / "xdg" / "diffusiond" / "diffusiond.sock")),
        ("DIFFUSIOND_SOCKET", str(tmp_path / "env.sock"), str(tmp_path / "env.sock")),
    ]
    for key, value, expected in steps:  # each step outranks the ones set before it
        clean_env.setenv(key, value)
        assert default_socket_path() == expected
        assert main(["status"]) == 3
        assert_unreachable_message(capsys.readouterr().err, expected)
    flag = str(tmp_path / "flag.sock")
    assert main(["status", "--socket", flag]) == 3
    err = capsys.readouterr().err
    assert_unreachable_message(err, flag)
    assert str(tmp_path / "env.sock") not in err


def test_runtime_directory_uses_the_first_entry(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RUNTIME_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    assert default_socket_path(serving=True) == f"{tmp_path}/a/diffusiond.sock"


# serve's configuration -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "toml", "needle"),
    [
        (["--output-mode", "bogus"], None, "output_mode"),
        (["--tcp", "127.0.0.1:8080"], None, "--token-file"),
        (["--max-batch", "0"], None, "max_batch"),
        (["--png-compress-level", "12"], None, "png_compress_level"),
        ([], "queue_size = [", "not valid TOML"),
        ([], "no_such_setting = 1", "unknown setting"),
        (["--output-mode", "sync"], 'output_mode = "bogus"\n', None),  # the flag overrides the file
    ],
)
def test_serve_rejects_bad_config_before_starting(
    args: list[str], toml: str | None, needle: str | None, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    if toml is not None:
        (tmp_path / "c.toml").write_text(toml)
        args = [*args, "--config", str(tmp_path / "c.toml")]
    if needle is None:
        # Valid after merging: serve must go on to the server, which we replace to start nothing.
        started: list[Any] = []
        fake = type(sys)("diffusiond.daemon.server")
        fake.serve = lambda config: started.append(config) or 0  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "diffusiond.daemon.server", fake)
        assert main(["serve", *args, "--socket", str(tmp_path / "s.sock")]) == 0
        assert started[0].output_mode == "sync"
        assert started[0].socket == str(tmp_path / "s.sock")
        return
    monkeypatch.delitem(sys.modules, "diffusiond.daemon.server", raising=False)
    assert main(["serve", *args]) == 2
    assert needle in capsys.readouterr().err
    assert "diffusiond.daemon.server" not in sys.modules


def test_serve_missing_config_file(tmp_path: Path, capsys: Any) -> None:
    assert main(["serve", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_serve_config_that_is_no_readable_file_is_a_usage_error_naming_it(tmp_path: Path, capsys: Any) -> None:
    """A directory (and, for a user without root, a file without read permission) raised a bare OSError out of
    serve: a traceback instead of exit 2 naming the path."""
    assert main(["serve", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"config file {tmp_path} cannot be read (Is a directory)" in err and "Traceback" not in err, err
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'log_level = "caf\xe9"\n')
    assert main(["serve", "--config", str(latin)]) == 2
    assert f"config file {latin} is not UTF-8 text" in capsys.readouterr().err


def test_serve_flags_reach_the_config(tmp_path: Path, monkeypatch: Any) -> None:
    got: list[Any] = []
    fake = type(sys)("diffusiond.daemon.server")
    fake.serve = lambda config: got.append(config) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "diffusiond.daemon.server", fake)
    argv = ["serve", "--model", "a=tiny", "--model", "tiny", "--workers", "2", "--socket-mode", "0660"]
    argv += ["--allow-uid", "1000", "--allow-uid", "1001", "--job-timeout", "9", "--encode-threads", "3"]
    assert main(argv) == 0
    cfg = got[0]
    assert [m.name for m in cfg.models] == ["a", "tiny"] and cfg.models[0].devices == ("cpu", "cpu")
    assert (cfg.socket_mode, cfg.allow_uid, cfg.job_timeout_s, cfg.encode_threads) == (0o660, (1000, 1001), 9.0, 3)


# output naming and formats --------------------------------------------------------------------
def test_output_paths() -> None:
    assert output_paths("j_1", None, "png", 1) == [Path("j_1.png")]
    assert output_paths("j_1", None, "jpg", 3) == [Path("j_1-0.jpg"), Path("j_1-1.jpg"), Path("j_1-2.jpg")]
    assert output_paths("j_1", "out/cat.png", "png", 1) == [Path("out/cat.png")]
    assert output_paths("j_1", "out/cat.png", "png", 3) == [Path(f"out/cat-{k}.png") for k in range(3)]


def test_output_into_a_directory(tmp_path: Path) -> None:
    assert output_paths("j_1", str(tmp_path), "mp4", 2) == [tmp_path / "j_1-0.mp4", tmp_path / "j_1-1.mp4"]


def test_format_choice() -> None:
    assert choose_format("webp", "x.webp") == choose_format("webp", "x.out") == "webp"
    with pytest.raises(UsageError, match=r"--format mp4 and -o clip.png disagree \(.png is png\); name the file .mp4"):
        choose_format("mp4", "clip.png")  # MP4 bytes in a .png: refused, naming both
    assert choose_format(None, "x.JPG") == "jpeg"
    assert choose_format(None, "x.mp4") == "mp4"
    assert choose_format(None, "x.unknown") is None  # a name: the model's default format is written under it
    with pytest.raises(UsageError, match=r"-o out.tif: .tif is not a format diffusiond writes \(.*png.*\)"):
        choose_format(None, "out.tif")  # PNG bytes under a .tif name
    assert choose_format("png", "out.tif") == "png"  # asked for by name: written as asked
    assert choose_format(None, None) is None
    assert extension_for(None) == "png"
    assert extension_for(None, "video/mp4") == "mp4"
    assert extension_for("jpeg", "image/png") == "jpg"


def test_progress_bar_text() -> None:
    assert render(7, 20, width=10) == "[####......] 7/20 steps"
    assert render(0, 0, width=4) == "[....] 0/0 steps"
    assert render(25, 20, "encoding", width=4) == "[####] 20/20 steps  encoding"


# SSE parsing ---------------------------------------------------------------------------------
STREAM = (
    b"\xef\xbb\xbf: a comment line, then a keep-alive\r\n:\r\n\r\n"
    b'event: progress\r\ndata: {"step": 1, "total": 20}\r\n\r\n'
    b'event: status\ndata: {"note":\ndata: "caf\xc3\xa9"}\nid: 7\nretry: 100\n\n'
    b"event: nodata\n\n"
    b"data:plain\rdata: two\r\r"
    b'event: done\ndata: {"status": "succeeded"}\n\n'
)
EXPECTED = [
    ("progress", '{"step": 1, "total": 20}'),
    ("status", '{"note":\n"café"}'),
    ("message", "plain\ntwo"),
    ("done", '{"status": "succeeded"}'),
]


def feed_in_pieces(cuts: list[int]) -> list[tuple[str, str]]:
    parser, out, start = SSEParser(), [], 0
    for cut in [*cuts, len(STREAM)]:
        out += parser.feed(STREAM[start:cut])
        start = cut
    return out


def test_sse_whole() -> None:
    assert feed_in_pieces([]) == EXPECTED


def test_sse_every_single_split_point() -> None:
    # Covers a split between CR and LF, inside "data:", and inside the two bytes of "é".
    for cut in range(1, len(STREAM)):
        assert feed_in_pieces([cut]) == EXPECTED, cut


def test_sse_byte_by_byte() -> None:
    assert feed_in_pieces(list(range(1, len(STREAM)))) == EXPECTED


def test_sse_waits_for_the_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"event: progress\ndata: {}\n") == []
    assert parser.feed(b"\n") == [("progress", "{}")]


def test_every_generate_and_serve_flag_says_what_it_does_and_serves_defaults_are_the_configs() -> None:
    """``--model``, ``-n``, ``--size``, ``--steps``, ``--guidance``, ``--seed`` and eleven serve
    flags had no help, and ``models`` was said to list the loaded models (it lists all of them)."""
    import argparse
    import re

    from diffusiond.cli import build_parser
    from diffusiond.daemon.config import DaemonConfig

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "serve"):
        bare = [a.option_strings for a in commands.choices[name]._actions if a.option_strings and not a.help]
        assert not bare, (name, bare)
    assert "loaded or not" in str(next(a.help for a in commands._choices_actions if a.dest == "models"))
    serve = {a.dest: str(a.help) for a in commands.choices["serve"]._actions}
    for field in ("queue_size", "job_timeout_s", "arena_mb", "retention_s", "drain_grace_s", "png_compress_level"):
        shown = re.search(r"\((\d+)\)$", serve[field])
        assert shown and float(shown.group(1)) == getattr(DaemonConfig, field), (field, serve[field])
