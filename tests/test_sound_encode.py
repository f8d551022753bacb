"""An mp4's sound track that cannot be read out of the worker's memory (its arena gone: ``ChannelClosed``, or a
region that does not hold what its desc says) fails the job with ``output_failed`` saying so (issue 30), rather
than leaving it in ``encoding`` until the job timeout. The failure is injected in-process: a real daemon has no
way to lose an arena between delivery and encoding on demand."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.outputs import slots, sound
from diffusiond.protocol import ErrorCode, Stage


def test_a_sound_track_that_cannot_be_read_fails_the_job_instead_of_hanging_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    failed: list[tuple[Any, str, Stage, ErrorCode]] = []

    def unreadable(_outputs: Any, _item: Any) -> None:
        raise ValueError("cannot reshape array of size 10 into shape (2,160)")

    monkeypatch.setattr(sound, "waveform", unreadable)
    with ThreadPoolExecutor(1) as pool:
        outputs = slots.Outputs(pool, Metrics(), png_compress_level=1, on_ready=lambda _item: None,
                                on_failed=lambda *args: failed.append(args))
        request = SimpleNamespace(output_format="mp4", fps=24, audio_rate=16000)
        item = SimpleNamespace(worker=SimpleNamespace(), desc=SimpleNamespace(), request_id="j_0a/0",
                               job=SimpleNamespace(request=request))
        asyncio.run(outputs._encode(item, "mp4"))  # type: ignore[arg-type]
    [(what, message, stage, code)] = failed
    assert what is item and (stage, code) == (Stage.ENCODING, ErrorCode.OUTPUT_FAILED)
    assert "sound track" in message and "as mp4 failed" in message and "cannot reshape" in message, message
