"""A model's sound track (issue 30) as users get it: an AAC stream in an mp4, a WAV file, an array.

The waveform lies beside its output in shared memory (``protocol.AUDIO_ARRAY``, float32 ``(channels,
samples)`` in [-1, 1]), in the region a trajectory uses (``ipc/sidearrays.py``); ``trajectories.py`` owns it. Here
it is only read: muxed into the video's file, cut or padded with silence to the video's own duration (the
model's length is its frame count over its frame rate, rounded to its latent steps), or written as 16-bit PCM
WAV with the stdlib's ``wave``. gif and animated webp hold no sound: their track is served as WAV only.
"""

from __future__ import annotations

import io
import wave
from typing import TYPE_CHECKING, Any

import numpy as np

from diffusiond.protocol import AUDIO_ARRAY

if TYPE_CHECKING:
    from diffusiond.daemon.core.jobs import Item
    from diffusiond.daemon.outputs.trajectories import Trajectories

# The rates AAC (MPEG-4 audio's sampling frequency index) has; another is resampled to 48 kHz.
AAC_RATES = frozenset({96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350})
_LAYOUTS = {1: "mono", 2: "stereo"}


def _layout(waveform: np.ndarray) -> str:
    channels = waveform.shape[0]
    if waveform.ndim != 2 or channels not in _LAYOUTS:
        raise ValueError(f"a sound track must be (channels, samples) with 1 or 2 channels, got {waveform.shape}")
    return _LAYOUTS[channels]


class Track:
    """One waveform's AAC stream in a container being written: added before the first packet (``__init__``),
    written after the video's (``write``); the muxer interleaves them when it finishes the file."""

    def __init__(self, container: Any, waveform: np.ndarray, rate: int, seconds: float) -> None:
        self.layout = _layout(waveform)
        self.rate, self.out_rate = rate, rate if rate in AAC_RATES else 48000
        samples = round(seconds * rate)  # the video's duration exactly: cut, or padded with silence
        fitted = np.zeros((waveform.shape[0], samples), dtype=np.float32)
        fitted[:, : min(samples, waveform.shape[1])] = waveform[:, :samples]
        self.waveform = fitted
        self.stream = container.add_stream("aac", rate=self.out_rate, layout=self.layout)
        self.container = container

    def write(self) -> None:
        import av  # here: the engine's WAV path (edge/jobs.py) needs none of PyAV

        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(self.waveform), format="fltp", layout=self.layout)
        frame.sample_rate, frame.pts = self.rate, 0
        frames = [frame]
        if self.out_rate != self.rate:
            resampler = av.AudioResampler(format="fltp", layout=self.layout, rate=self.out_rate)
            frames = [*resampler.resample(frame), *resampler.resample(None)]
        for f in frames:
            self.container.mux(self.stream.encode(f))
        self.container.mux(self.stream.encode(None))


def wav_bytes(waveform: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV of the waveform (clipped to [-1, 1]), its channels interleaved."""
    _layout(waveform)
    pcm = (np.clip(waveform, -1, 1) * 32767).round().astype("<i2").T  # (samples, channels): interleaved
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(waveform.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(pcm).tobytes())
    return out.getvalue()


def from_npy(header: bytes, payload: memoryview | bytes) -> np.ndarray:
    """The waveform from ``Trajectories.open``'s parts (a header and its bytes, or a whole npy file)."""
    out: np.ndarray = np.load(io.BytesIO(bytes(header) + bytes(payload)), allow_pickle=False)
    return out


def waveform(trajectories: Trajectories, item: Item) -> np.ndarray | None:
    """The item's waveform for an encoder, copied out of shared memory (a few MB at most; the encoder pads it
    anyway), or None when it has none."""
    side = item.trajectory
    if not item.job.request.audio_rate or side is None or AUDIO_ARRAY not in side.arrays:
        return None
    desc = side.arrays[AUDIO_ARRAY]
    trajectories.pin(item)
    try:
        payload = trajectories.view(item, desc)
        try:
            return np.frombuffer(payload, dtype=np.float32).reshape(desc.shape).copy()
        finally:
            payload.release()
    finally:
        trajectories.unpin(item)
