"""What a user is told when a model spec names something that is not a model (report 28 #12)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_daemon_cli import cli

from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import parse_spec


def test_serve_says_a_file_that_is_no_model_is_not_one_rather_than_missing(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    r = cli("serve", "--model", f"n={notes}", "--socket", str(tmp_path / "d.sock"),
            "--state-dir", str(tmp_path / "state"), env={"OMP_NUM_THREADS": "1"}, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert lines == [f"diffusiond serve: error: model 'n': {notes}: a file, but not one diffusiond can load: give a "
                     ".safetensors or .gguf file, a diffusers folder (with model_index.json) or a hub id in the "
                     "Hugging Face cache"], lines
    assert not (tmp_path / "d.sock").exists()


@pytest.mark.parametrize("spec", ["/etc/passwd", "/etc/passwd,quant=unet:int8"])
def test_a_file_that_is_no_model_is_named_so_with_or_without_options(spec: str) -> None:
    with pytest.raises(PipelineError, match=r"^/etc/passwd: a file, but not one diffusiond can load: give a "):
        parse_spec(spec)
