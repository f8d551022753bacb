"""A model that cannot load stops the start with one line that says why, not a Python traceback: the
person reading the journal needs the model, the reason and what to do; the traceback is for whoever debugs
the loader, at --log-level debug (issue 31)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _serve(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    folder = tmp / "broken"  # a pipeline's index and none of its parts: from_pretrained refuses it
    folder.mkdir(exist_ok=True)
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    return subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--socket", str(tmp / "s"),
                           "--state-dir", str(tmp / "state"), "--model", f"b={folder}", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("debug", [False, True], ids=["info", "debug"])
def test_a_model_that_cannot_load_stops_the_start_with_its_reason(tmp_path: Path, debug: bool) -> None:
    out = _serve(tmp_path, *(["--log-level", "debug"] if debug else []))
    assert out.returncode == 1, out.stderr[-3000:]
    line = next(x for x in out.stderr.splitlines() if "cannot start:" in x)
    assert "loading model 'b'" in line and "cannot load StableDiffusionPipeline" in line, line
    assert "correct what this names" in line and "--log-level debug" in line, line
    assert ("Traceback" in out.stderr) is debug, out.stderr[-3000:]
