"""Live updates' header checks (core/file_checks.py) for a built-in model given with options: until its first
worker has built its folder the headers cannot tell, and that answer must not be kept for the daemon's life
(every later update would then be kept on trust, unchecked)."""

from __future__ import annotations

from pathlib import Path

import pytest

import diffusiond.daemon.core.file_checks as file_checks
from diffusiond.daemon.model_config import ModelConfig


@pytest.mark.parametrize("spec", ["tiny", "tiny,attention=sdpa"])
async def test_a_built_in_model_not_built_yet_is_read_again_next_time(
        spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFUSIOND_CACHE", str(tmp_path))  # an empty cache: nothing built yet
    reads: list[str] = []
    read = file_checks.read_model_files

    def counted(config: ModelConfig) -> file_checks.ModelFiles | None:
        reads.append(config.name)
        return read(config)

    monkeypatch.setattr(file_checks, "read_model_files", counted)
    checks = file_checks.FileChecks({"t": ModelConfig(name="t", spec=spec)})
    assert await checks("t") is None
    assert await checks("t") is None
    assert reads == ["t", "t"]  # read again: its first worker may have built it meanwhile
