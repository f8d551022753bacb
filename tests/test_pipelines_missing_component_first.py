"""A folder missing a component is refused before any of its weights are read: a component read on its own (its
variant is not the one diffusers is given for the rest, pipelines/variants.py) may be gigabytes, and the folder is
refused whatever it holds."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from test_variants_agree import LAYOUTS, build, tiny_pipe  # noqa: F401 (the fixture)

from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.load_progress import reporting


def test_a_folder_without_its_tokenizer_is_refused_before_a_component_read_apart_loads(tiny_pipe: Any,  # noqa: F811
                                                                                      tmp_path: Path) -> None:
    folder = tmp_path / "model"
    build(tiny_pipe, folder, LAYOUTS["fp16 for some components"])  # at float32 the vae is read apart, from fp16
    shutil.rmtree(folder / "tokenizer")
    reports: list[int] = []
    with reporting(reports.append), pytest.raises(PipelineError) as got:
        load_pipeline(str(folder), dtype="float32")
    assert "has no tokenizer/ folder" in str(got.value), str(got.value)
    assert reports == [], f"weights were read before the refusal: {reports}"
