"""LTX-2 (issue 30): the sound track LTX2Pipeline makes beside the video, carried to the client.

An LTX-2 model denoises a video and an audio stream together and decodes both: the call returns the frames and
a waveform (its vocoder's, at ``vocoder.config.output_sampling_rate``). Each request that wants it gets its own
waveform as a side array of its output (``protocol.AUDIO_ARRAY``), copied to shared memory beside the frames
like a trajectory is (worker/copier.py); the engine muxes it into mp4s and serves it as WAV. The vocoder runs
whatever the request says: diffusers decodes the sound in the same call as the frames, with no switch to skip it.

The model also conditions its positional embeddings on ``frame_rate``: the request's ``fps`` goes there, so the
motion, the sound's length and the file's rate agree (the pipeline's default is 24).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffusiond.protocol import AUDIO_ARRAY


def sample_rate(pipe: Any) -> int:
    """The rate of the waveforms ``pipe`` makes (0: it makes none)."""
    vocoder = getattr(pipe, "vocoder", None)
    config = getattr(vocoder, "config", None)
    return int(getattr(config, "output_sampling_rate", 0) or 0) if vocoder is not None else 0


def waveforms(out: Any, wanted: Sequence[bool]) -> list[dict[str, torch.Tensor]] | None:
    """Each request's sound track as a side array (float32 ``(channels, samples)`` on the device; {} for a
    request that does not want it), from a call's ``(frames, audio)``; None when none is wanted."""
    if not any(wanted):
        return None
    audio = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    if not isinstance(audio, torch.Tensor) or audio.dim() not in (2, 3) or audio.shape[0] != len(wanted):
        shape = tuple(audio.shape) if isinstance(audio, torch.Tensor) else type(audio).__name__
        raise RuntimeError(f"the pipeline returned no sound track of one waveform per request (got {shape})")
    tracks = audio if audio.dim() == 3 else audio[:, None]  # (batch, samples): one channel
    return [{AUDIO_ARRAY: tracks[k].float().contiguous()} if want else {} for k, want in enumerate(wanted)]


def frame_rate_args(args: frozenset[str], fps: int | None) -> dict[str, Any]:
    """``frame_rate=`` for a pipeline that conditions on it (LTX-2), from the request's ``fps``."""
    return {"frame_rate": float(fps)} if fps and "frame_rate" in args else {}
