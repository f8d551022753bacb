"""The CLI starts fast: client commands and every ``--help`` load no torch, diffusers or codecs.

Importing torch costs about a second on a small machine, and a command that only asks a socket
a question has no use for it. Each command runs in a fresh interpreter, against no daemon (so
client commands end with exit 3 at once), and reports the modules it had loaded when it exited.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

HEAVY = {"torch", "diffusers", "transformers", "numpy", "PIL", "av", "msgspec"}
"""None of these is needed to talk to a daemon or to print usage."""
DAEMON_SIDE = ("diffusiond.daemon", "diffusiond.pipelines", "diffusiond.worker", "diffusiond.ipc")

WRAPPER = (
    "import atexit, runpy, sys\n"
    "out = sys.argv[1]\n"
    "atexit.register(lambda: open(out, 'w').write('\\n'.join(sorted(sys.modules))))\n"
    "sys.argv = ['diffusiond', *sys.argv[2:]]\n"
    "runpy.run_module('diffusiond', run_name='__main__')\n"
)

CLIENT_COMMANDS = [["status"], ["status", "--json"], ["models"], ["models", "--json"], ["cancel", "j_1"],
                   ["sleep"], ["wake"], ["web-url"], ["generate", "a fox", "-o", "fox.png"]]  # fmt: skip
HELP = [["--help"], ["serve", "--help"], ["bench", "--help"], ["generate", "--help"], ["status", "--help"],
        ["models", "--help"], ["cancel", "--help"], ["sleep", "--help"], ["wake", "--help"], ["web-url", "--help"],
        ["socket", "--help"], ["fit", "--help"],
        ["--version"]]  # fmt: skip


def run_cli(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    out = tmp_path / "modules.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("DIFFUSIOND_SOCKET", "RUNTIME_DIRECTORY")}
    r = subprocess.run([sys.executable, "-c", WRAPPER, str(out), *args], capture_output=True, text=True,
                       cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, timeout=60, check=False)  # fmt: skip
    return r, set(out.read_text().split())


@pytest.mark.parametrize("args", CLIENT_COMMANDS, ids=" ".join)
def test_client_commands_load_nothing_heavy(args: list[str], tmp_path: Path) -> None:
    r, modules = run_cli([*args, "--socket", str(tmp_path / "none.sock")], tmp_path)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert not HEAVY & modules, sorted(HEAVY & modules)
    assert not [m for m in modules if m.startswith(DAEMON_SIDE)]


@pytest.mark.parametrize("args", HELP, ids=" ".join)
def test_help_loads_nothing_heavy(args: list[str], tmp_path: Path) -> None:
    r, modules = run_cli(args, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(("usage: diffusiond", "diffusiond "))
    assert not HEAVY & modules, sorted(HEAVY & modules)
    assert not [m for m in modules if m.startswith(DAEMON_SIDE)]


def test_a_usage_error_loads_nothing_heavy(tmp_path: Path) -> None:
    r, modules = run_cli(["generate", "x", "--size", "big"], tmp_path)
    assert r.returncode == 2 and "expected WxH" in r.stderr
    assert not HEAVY & modules


@pytest.mark.parametrize("code", ["import diffusiond", "from diffusiond import Client, AsyncClient, JobFailed"])
def test_the_python_client_loads_nothing_heavy_until_an_output_needs_it(code: str, tmp_path: Path) -> None:
    """``import diffusiond`` is done by every process of the package; the client classes are
    loaded on first use, and numpy and PIL only when an output is asked for as an array or image."""
    probe = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60, check=True)  # fmt: skip
    modules = set(r.stdout.split())
    assert not HEAVY & modules, sorted(HEAVY & modules)
    assert not [m for m in modules if m.startswith(DAEMON_SIDE)]
    assert ("aiohttp" in modules) is ("Client" in code)


def test_fit_reads_headers_without_torch(tmp_path: Path) -> None:
    """``diffusiond fit`` sizes a model in the command line process: headers read with the standard library
    (safetensors here; GGUF likewise, daemon/residency/gguf_header.py), so no torch, numpy or msgspec."""
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    r, modules = run_cli(["fit", str(tmp_path / "m.safetensors"), "--device-memory", "1KB", "--working", "0"],
                         tmp_path)
    assert r.returncode == 0, r.stderr
    assert "offload=auto would run it with none" in r.stdout
    assert not HEAVY & modules, sorted(HEAVY & modules)
