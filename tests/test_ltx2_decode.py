"""LTX-2's decode on the worker's pipeline (issue 30): a batch that wants no sound track skips the audio VAE's
decode and the vocoder, with the video unchanged; ``vae_tiling=1`` decodes sizes whose last tile would be one latent
pixel thick (928 on LTX-2's 32x VAE), which its reflection-padded decoder cannot take.

The tiny LTX-2 (tests/ltx2kit.py) keeps the released VAE's compression, decoder padding and diffusers' default tiles
(512 pixels every 448: 16 and 14 latent pixels), so the sizes that fail are the real model's.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import torch
from ltx2kit import build_ltx2

import diffusiond.pipelines.vae_tiles as vae_tiles
from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import Interrupted
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.registry import load_pipeline
from diffusiond.protocol import AUDIO_ARRAY

PARAMS = BatchParams(width=64, height=64, steps=2, guidance=3.0, num_frames=9)


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory: pytest.TempPathFactory) -> DiffusersPipeline:
    folder = build_ltx2(tmp_path_factory.mktemp("ltx2") / "ltx2")
    pipe = load_pipeline(str(folder), options={"vae_tiling": "1"})
    assert isinstance(pipe, DiffusersPipeline) and pipe.pipe.vae.use_tiling
    return pipe


@pytest.fixture
def vocoder_calls(ltx2: DiffusersPipeline) -> Any:
    vocoder = ltx2.pipe.vocoder
    calls: list[int] = []
    real = vocoder.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    vocoder.forward = spy
    yield calls
    del vocoder.forward


def _run(pipe: DiffusersPipeline, audio: Sequence[bool], params: BatchParams = PARAMS) -> list[torch.Tensor]:
    reqs = [RequestSpec(request_id=f"r{k}", prompt="a drum", seed=3 + k, audio=a) for k, a in enumerate(audio)]
    return pipe.run(params, reqs, lambda _s, _t: True)


def test_a_batch_that_wants_no_sound_skips_the_vocoder_and_makes_the_same_video(ltx2: DiffusersPipeline,
                                                                                 vocoder_calls: list[int]) -> None:
    silent = _run(ltx2, [False, False])
    assert vocoder_calls == [] and ltx2.last_trajectories is None  # no waveform, bogus or not, leaves the worker
    loud = _run(ltx2, [True, False])
    assert vocoder_calls == [1]
    assert ltx2.last_trajectories is not None and AUDIO_ARRAY in ltx2.last_trajectories[0]
    assert ltx2.last_trajectories[1] == {} and ltx2.last_trajectories[0][AUDIO_ARRAY].abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(silent, loud, strict=True))  # the frames, byte for byte


def test_the_warm_up_decodes_the_sound_a_default_job_does(ltx2: DiffusersPipeline, vocoder_calls: list[int]) -> None:
    """A job that leaves ``audio`` out gets the sound track, so the warm-up (which measures the
    shape's working memory and pays its first run) runs the vocoder too; so do the benchmarks (``as_served``)."""
    from diffusiond.ipc.messages import WarmupShape
    from diffusiond.worker.warmup import warm_up

    assert ltx2.capabilities.sample_rate > 0
    warm_up(ltx2, [WarmupShape(64, 64, 1)], cuda=False)
    assert vocoder_calls == [1], "the warm-up skipped the sound decode"


def test_the_sound_decode_comes_back_after_a_call_that_stopped(ltx2: DiffusersPipeline,
                                                               vocoder_calls: list[int]) -> None:
    reqs = [RequestSpec(request_id="r", prompt="a drum", seed=1, audio=False)]
    with pytest.raises(Interrupted):
        ltx2.run(PARAMS, reqs, lambda _s, _t: False)
    assert "decode" not in vars(ltx2.pipe.audio_vae)
    _run(ltx2, [True])
    assert vocoder_calls == [1]


def test_the_strides_leave_no_strip_thinner_than_the_decoder_takes() -> None:
    # 16-pixel tiles every 14 (LTX-2's at 32x): a side of 29 or 15 would end in a strip of 1
    assert [vae_tiles.fitted_stride(n, 14, 2) for n in (29, 15, 30, 16, 14, 43)] == [13, 13, 14, 14, 14, 13]
    assert vae_tiles.fitted_stride(29, 14, 1) == 14  # a zero-padding decoder takes one pixel


def test_vae_tiling_decodes_a_side_whose_last_tile_is_one_latent_pixel(ltx2: DiffusersPipeline) -> None:
    """928 = 29 latent pixels: tiles at 0, 14 and 28, the last one pixel thick; it failed inside the VAE."""
    vae = ltx2.pipe.vae
    (video,) = _run(ltx2, [False], msgspec.structs.replace(PARAMS, height=928))
    assert tuple(video.shape) == (9, 3, 928, 64) and torch.isfinite(video).all()
    assert (vae.tile_sample_stride_height, vae.tile_sample_stride_width) == (448, 448)  # put back after the call


def test_a_vae_tiled_another_way_is_left_alone() -> None:
    """Allegro's and HunyuanImage 2.1's VAEs tile without ``tile_sample_stride_*``: vae_tiling=1 must not fail them."""
    vae = types.SimpleNamespace(use_tiling=True, spatial_compression_ratio=8, decoder=torch.nn.Identity())
    pipe = types.SimpleNamespace(vae=vae)
    with vae_tiles.fitted(pipe, 928, 64):
        pass
    assert not hasattr(vae, "tile_sample_stride_height")
