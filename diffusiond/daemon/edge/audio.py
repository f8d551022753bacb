"""The ``audio`` field of a job (issue 30, docs/api.md "Sound tracks"): whether a model's sound track comes back.

Apart from ``requests.py`` because that module is at its size. A model that makes sound (LTX-2: its
capabilities' ``sample_rate``) delivers it by default; ``false`` leaves it out. ``true`` on a model that makes
none is refused rather than ignored: the caller expects a track that would never come.
"""

from __future__ import annotations

from typing import Any, Protocol

from diffusiond.daemon.errors import invalid
from diffusiond.ipc.messages import Capabilities


class _Model(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...


def check_audio(value: Any, model: _Model) -> int:
    """The sample rate the job's sound track comes back at (``JobRequest.audio_rate``); 0: none."""
    rate = model.capabilities.sample_rate
    if value is None:
        return rate
    if not isinstance(value, bool):
        raise invalid(f"audio must be true or false, got {value!r}", field="audio")
    if value and not rate:
        raise invalid(f"audio: model {model.name!r} makes no sound track; leave out audio, or pick a model that "
                      "makes one (GET /v1/models: its sample_rate)", field="audio")
    return rate if value else 0
