"""A flag's value that begins with '-' (suspicion 6): argparse takes ``-128x128`` for a flag, and ``--size
-128x128`` was refused with "expected one argument", naming neither the value nor what a size must be. The
value now reaches the flag's own check. No daemon: each is decided before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusiond.cli import build_parser, main


@pytest.mark.parametrize("size", ["-128x128", "-128x-128", "-0x5"])
def test_a_size_that_begins_with_a_dash_is_refused_naming_the_value_and_what_a_size_is(
        size: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["generate", "--size", size, "a cat"], ["generate", "a cat", "--size", size]):
        assert main([*args, "--socket", str(tmp_path / "none.sock")]) == 2
        err = capsys.readouterr().err
        assert f"argument --size: expected WxH with positive integers, e.g. 512x512, got {size!r}" in err, err
        assert "expected one argument" not in err


def test_a_value_that_begins_with_a_dash_is_the_flags_value_where_it_is_no_flag() -> None:
    """The same rule gives text flags their value (a negative prompt of ``-blurry``); a flag the command has
    (``-n``, ``--steps``) is still a flag, so a value left out is still argparse's "expected one argument"."""
    from diffusiond.commands.argtypes import dash_values

    parser = build_parser()
    args = parser.parse_args(dash_values(parser, ["generate", "a cat", "--negative", "-blurry", "-n", "2"]))
    assert (args.negative, args.n, args.prompt) == ("-blurry", 2, "a cat")
    kept = ["generate", "--size", "--steps", "4", "x"], ["generate", "--negative", "-n", "2", "x"]
    for argv in kept:
        assert dash_values(parser, argv) == argv
    after_the_end = ["generate", "--", "--size", "-1x1"]  # all positional past "--"
    assert dash_values(parser, after_the_end) == after_the_end
