"""``diffusiond socket``'s help names the places a client looks for the socket, and only those.

``$RUNTIME_DIRECTORY`` is the serving daemon's alone (protocol.py's ``default_socket_path``): a client run inside
another systemd unit would otherwise look in that unit's folder. A help that still listed it sent a person
setting it to point the CLI at a daemon, which the CLI then ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from diffusiond.cli import main

CLIENT_ORDER = "(--socket, $DIFFUSIOND_SOCKET, $XDG_RUNTIME_DIR/diffusiond, else /tmp/diffusiond-$UID)"


def _help(argv: list[str], capsys: Any) -> str:
    assert main(argv) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone


@pytest.mark.parametrize("argv", [["--help"], ["socket", "--help"]])
def test_the_socket_help_lists_the_clients_order_without_the_daemons_runtime_directory(argv: list[str],
                                                                                     capsys: Any) -> None:
    text = _help(argv, capsys)
    assert CLIENT_ORDER in text, text
    assert "RUNTIME_DIRECTORY," not in text.replace("XDG_RUNTIME_DIR", ""), text


def test_the_socket_command_does_what_its_help_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: Any) -> None:
    monkeypatch.delenv("DIFFUSIOND_SOCKET", raising=False)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "another-unit"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert main(["socket"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "xdg" / "diffusiond" / "diffusiond.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert main(["socket"]) == 0
    assert capsys.readouterr().out.strip() == f"/tmp/diffusiond-{os.getuid()}/diffusiond.sock"
