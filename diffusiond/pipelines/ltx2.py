"""LTX-2 (issue 30): what diffusiond does with the sound track LTX2Pipeline makes beside the video.

An LTX-2 model denoises a video and an audio stream together and decodes both: the call returns the frames and
a waveform (its vocoder's, at ``vocoder.config.output_sampling_rate``). diffusiond's output path carries frames
only so far, so the waveform is dropped after the call; every output says so in its ``approximations`` (the job
view, each file's metadata, and the model's capabilities), never silently. Carrying the waveform to the client
(an audio stream in the mp4, an array beside npy outputs) is issue 30's next step.
"""

from __future__ import annotations

from typing import Any

AUDIO_DROPPED = "audio track dropped (the model makes one; diffusiond serves its video only so far)"


def approximations(pipe: Any) -> tuple[str, ...]:
    """What an output of ``pipe`` lacks of what the model made: the sound track, for a model with a vocoder."""
    return (AUDIO_DROPPED,) if getattr(pipe, "vocoder", None) is not None else ()
