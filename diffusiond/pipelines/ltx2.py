"""LTX-2 (issue 30): the sound track LTX2Pipeline makes beside the video, carried to the client.

An LTX-2 model denoises a video and an audio stream together and decodes both: the call returns the frames and
a waveform (its vocoder's, at ``vocoder.config.output_sampling_rate``). Each request that wants it gets its own
waveform as a side array of its output (``protocol.AUDIO_ARRAY``), copied to shared memory beside the frames
like a trajectory is (worker/copier.py); the engine muxes it into mp4s and serves it as WAV. diffusers decodes the
sound in the same call as the frames, with no switch to skip it: when no request of a batch wants it, ``without_sound``
stands no-ops in for the audio VAE's decode and the vocoder for the call (their weights stay where they are, and an
offloaded vocoder is not even moved to the device). The audio latents are still denoised with the video's: the two
streams attend to each other, so the frames come out the same either way.

The model also conditions its positional embeddings on ``frame_rate``: the request's ``fps`` goes there, so the
motion, the sound's length and the file's rate agree. A model's default ``fps`` is its pipeline's own ``frame_rate``
default (24 for LTX-2, 25 for LTX-Video), so a request without one runs at the rate the model was trained at.
LTX-Video's pipelines take a ``frame_rate`` too, but they ran at their default before issue 30 whatever the
request's playback ``fps``, and still do: only LTX-2 is conditioned on it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from diffusiond.ipc.messages import Capabilities, RequestSpec
from diffusiond.protocol import AUDIO_ARRAY


def sample_rate(pipe: Any) -> int:
    """The rate of the waveforms ``pipe`` makes (0: it makes none)."""
    vocoder = getattr(pipe, "vocoder", None)
    config = getattr(vocoder, "config", None)
    return int(getattr(config, "output_sampling_rate", 0) or 0) if vocoder is not None else 0


def as_served(capabilities: Capabilities, prompt: str, seeds: Iterable[int], prefix: str) -> list[RequestSpec]:
    """Requests made outside the engine (a warm-up, a benchmark) as a job that leaves ``audio`` out is sent: with
    the sound track where the model makes one (edge/audio.py), so what they measure (working memory, a first run's
    cost, the limit the daemon is held to) is the default job's, sound decode and vocoder included."""
    wants = capabilities.sample_rate > 0
    return [RequestSpec(request_id=f"{prefix}{seed}", prompt=prompt, seed=seed, audio=wants) for seed in seeds]


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


def _frame_rate(cls: type) -> Any:
    try:
        param = inspect.signature(cls.__call__).parameters.get("frame_rate")
    except (TypeError, ValueError):
        return None
    return None if param is None else param.default


def conditions_on_fps(cls: type) -> bool:
    """Whether the request's ``fps`` goes to the call's ``frame_rate`` (LTX-2's pipelines only)."""
    return cls.__name__.startswith("LTX2") and _frame_rate(cls) is not None


def default_fps(cls: type, fallback: int = 16) -> int:
    """The pipeline's own ``frame_rate`` default, where it has one (24 for LTX-2, 25 for LTX-Video)."""
    rate = _frame_rate(cls)
    return round(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) and rate >= 1 else fallback


def frame_rate_args(cls: type, fps: int | None) -> dict[str, Any]:
    """``frame_rate=`` for a pipeline conditioned on it (LTX-2), from the request's ``fps``."""
    return {"frame_rate": float(fps)} if fps and conditions_on_fps(cls) else {}


def _no_mel(*_args: Any, **_kwargs: Any) -> tuple[None]:
    return (None,)


def _no_waveform(*_args: Any, **_kwargs: Any) -> None:
    return None


_STUBS = (("audio_vae", "decode", _no_mel), ("vocoder", "forward", _no_waveform))


@contextlib.contextmanager
def without_sound(pipe: Any, wanted: Sequence[bool]) -> Iterator[None]:
    """For a call none of whose requests wants its sound track: the audio VAE's decode and the vocoder do nothing
    (the call's audio is None, which ``waveforms`` never reads then), restored after the call, even on an error.
    Set on the module instances, so a sibling pipeline built on the same weights (image-to-video) is covered, and
    over whatever was there (an offload's hooked forward, a test's spy), which comes back as it was."""
    modules = [getattr(pipe, part, None) for part, _, _ in _STUBS]
    if any(wanted) or any(m is None for m in modules):
        yield
        return
    missing = object()
    saved = [(m.__dict__, name, m.__dict__.get(name, missing)) for m, (_, name, _) in zip(modules, _STUBS, strict=True)]
    try:
        for m, (_, name, stub) in zip(modules, _STUBS, strict=True):
            m.__dict__[name] = stub
        yield
    finally:
        for attrs, name, was in saved:
            if was is missing:
                attrs.pop(name, None)
            else:
                attrs[name] = was
