"""Preview decoders (pipelines/previews.py) with real diffusers code on CPU: latent layouts of each
family brought back to pictures, the family chosen from the pipeline, sizes, the tiny autoencoder
path, the step callback's contract (which steps, which requests, never the last step), and the
worker's bound on previews (never waiting for arena room, never in an output's way)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from diffusers import AutoencoderTiny, FluxPipeline, LTXPipeline

from diffusiond.ipc.arena import Arena, Slot
from diffusiond.ipc.messages import BatchParams, OutputReady, PreviewReady, RequestEnded, RequestSpec
from diffusiond.ipc.tensors import as_torch
from diffusiond.pipelines import PipelineError, load_pipeline
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.previews import (
    FAMILIES,
    LinearPreviewer,
    TinyAutoencoderPreviewer,
    family_of,
    preview_size,
    unpack_flux,
    unpack_ltx,
)
from diffusiond.worker.copier import Copier, CopyJob
from diffusiond.worker.previews import PREVIEW_SLOTS, PendingPreview
from diffusiond.worker.state import SharedState


def test_flux_tokens_unpack_to_the_latents_diffusers_packed() -> None:
    params = BatchParams(width=256, height=128, steps=1, guidance=1.0)
    latents = torch.randn(2, 16, 128 // 8, 256 // 8)  # vae_scale_factor 8
    packed = FluxPipeline._pack_latents(latents, 2, 16, latents.shape[2], latents.shape[3])
    assert torch.equal(unpack_flux(packed, params, 8), latents)


@pytest.mark.parametrize(("p", "pt"), [(1, 1), (2, 1), (2, 2)])
def test_ltx_tokens_unpack_to_the_latents_diffusers_packed(p: int, pt: int) -> None:
    latents = torch.randn(2, 8, 4, 6, 10)
    packed = LTXPipeline._pack_latents(latents, p, pt)
    assert torch.equal(unpack_ltx(packed, 4, 6, 10, p, pt), latents)


def test_every_family_has_three_factors_per_latent_channel() -> None:
    channels = {"sd15": 4, "sdxl": 4, "flux": 16, "wan": 16, "ltx": 128}
    for family, (factors, bias) in FAMILIES.items():
        assert len(factors) == channels[family] and all(len(row) == 3 for row in factors)
        assert len(bias) == 3


class _Config:
    def __init__(self, latent_channels: int) -> None:
        self.latent_channels = latent_channels


class _Vae:
    def __init__(self, latent_channels: int) -> None:
        self.config = _Config(latent_channels)


def _pipe(class_name: str, latent_channels: int) -> object:
    cls = type(class_name, (), {})
    pipe = cls()
    pipe.vae = _Vae(latent_channels)
    return pipe


@pytest.mark.parametrize(("name", "channels", "family"), [
    ("StableDiffusionPipeline", 4, "sd15"),
    ("StableDiffusionXLPipeline", 4, "sdxl"),
    ("FluxPipeline", 16, "flux"),
    ("WanPipeline", 16, "wan"),
    ("LTXPipeline", 128, "ltx"),
    ("LTX2Pipeline", 128, None),  # LTX-Video's channel count, another VAE's latents (issue 30)
    ("LTX2ImageToVideoPipeline", 128, None),
    ("StableDiffusion3Pipeline", 16, None),  # no factors here: no previews rather than wrong ones
    ("StableDiffusionPipeline", 16, None),  # a fine-tune with another VAE: the factors would not fit
    ("KandinskyPipeline", 4, None),
])
def test_the_family_comes_from_the_class_and_must_fit_the_vae(name: str, channels: int, family: str | None) -> None:
    assert family_of(_pipe(name, channels)) == family


def test_preview_size_keeps_the_aspect_and_never_grows() -> None:
    p = BatchParams(width=1024, height=576, steps=1, guidance=1.0)
    assert preview_size(p, 256) == (144, 256)
    assert preview_size(p, 4096) == (576, 1024)


def test_linear_previews_are_pictures_in_range_of_each_asked_request_and_size() -> None:
    pipe = _pipe("StableDiffusionXLPipeline", 4)
    previewer = LinearPreviewer(pipe, "sdxl")
    params = BatchParams(width=1024, height=768, steps=1, guidance=1.0)
    latents = torch.randn(3, 4, 96, 128) * 3
    pics = previewer(latents, [0, 2], params, [256, 64])
    assert [(tuple(p.shape), p.dtype) for p in pics] == [((192, 256, 3), torch.uint8), ((48, 64, 3), torch.uint8)]
    assert all(p.is_contiguous() for p in pics)  # each can be copied into its slot as it is
    # the first picture is request 0's, not request 1's
    alone = previewer(latents[:1], [0], params, [256])[0]
    assert torch.equal(alone, pics[0])


def test_linear_previews_are_the_factors_picture_rounded_to_bytes() -> None:
    """Folding the factors, the [-1, 1] -> [0, 255] mapping and the rounding into one
    convolution gives the picture the factors describe: rgb = latents . factors + bias."""
    previewer = LinearPreviewer(_pipe("StableDiffusionXLPipeline", 4), "sdxl")
    params = BatchParams(width=64, height=64, steps=1, guidance=1.0)
    latents = torch.randn(1, 4, 8, 8) * 2
    factors, bias = (torch.tensor(t, dtype=torch.float32) for t in FAMILIES["sdxl"])
    rgb = torch.einsum("nchw,cr->nhwr", latents, factors)[0] + bias
    want = ((rgb.clamp(-1, 1) + 1) * 127.5).round()
    got = previewer(latents, [0], params, [8])[0].float()  # 8 px: the latents' own size, no resize
    assert (got - want).abs().max() <= 1  # float rounding at the .5 boundaries
    assert (got == want).float().mean() > 0.95


def test_wan_video_latents_preview_their_first_frame() -> None:
    previewer = LinearPreviewer(_pipe("WanPipeline", 16), "wan")
    params = BatchParams(width=64, height=64, steps=1, guidance=1.0, num_frames=9)
    latents = torch.randn(1, 16, 3, 8, 8)
    first = previewer(latents, [0], params, [64])[0]
    changed = latents.clone()
    changed[:, :, 1:] = 0
    assert torch.equal(previewer(changed, [0], params, [64])[0], first)


@pytest.fixture(scope="module")
def taesd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-weight AutoencoderTiny saved as diffusers saves TAESD."""
    torch.manual_seed(0)
    vae = AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                          latent_channels=4)
    path = tmp_path_factory.mktemp("taesd")
    vae.save_pretrained(path)
    return path


def test_tiny_autoencoder_previews_decode_at_the_vae_scale(taesd: Path) -> None:
    previewer = TinyAutoencoderPreviewer(_pipe("StableDiffusionPipeline", 4), str(taesd), torch.device("cpu"),
                                         torch.float32)
    params = BatchParams(width=256, height=256, steps=1, guidance=1.0)
    pics = previewer(torch.randn(2, 4, 32, 32), [1], params, [128])
    assert len(pics) == 1 and tuple(pics[0].shape) == (128, 128, 3) and pics[0].dtype == torch.uint8


def test_a_preview_decoder_that_does_not_fit_is_refused_with_the_reason(taesd: Path, tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="decodes 4-channel latents; the model makes 16"):
        TinyAutoencoderPreviewer(_pipe("FluxPipeline", 16), str(taesd), torch.device("cpu"), torch.float32)
    with pytest.raises(PipelineError, match="not a diffusers AutoencoderTiny folder"):
        TinyAutoencoderPreviewer(_pipe("FluxPipeline", 16), str(tmp_path), torch.device("cpu"), torch.float32)


def _spec(rid: str, every: int = 0, side: int = 0) -> RequestSpec:
    return RequestSpec(request_id=rid, prompt="a red fox", seed=1, preview_every=every, preview_max_side=side)


def test_tiny_calls_the_sink_every_n_steps_for_the_requests_that_asked(model_cache: Path) -> None:
    pipe = load_pipeline("tiny")
    assert isinstance(pipe, DiffusersPipeline) and pipe.capabilities.previews
    calls: list[tuple[int, int, list[tuple[int, tuple[int, ...]]]]] = []
    params = BatchParams(width=64, height=64, steps=6, guidance=5.0)
    reqs = [_spec("a", every=2, side=32), _spec("b"), _spec("c", every=3, side=64)]
    pipe.run(params, reqs, lambda _s, _t: True,
             lambda step, total, pics: calls.append((step, total, [(k, tuple(p.shape)) for k, p in pics])))
    assert calls == [
        (2, 6, [(0, (32, 32, 3))]),
        (3, 6, [(2, (64, 64, 3))]),
        (4, 6, [(0, (32, 32, 3))]),
        # step 6 is the last: the output itself comes next, for both
    ]


def test_tiny_with_a_preview_decoder_option_uses_it(model_cache: Path, taesd: Path) -> None:
    pipe = load_pipeline("tiny", options={"preview_decoder": str(taesd)})
    assert isinstance(pipe, DiffusersPipeline)
    assert isinstance(pipe._previewer, TinyAutoencoderPreviewer)


# the worker's share: bounded, never waiting, never in an output's way ---------------------------
_ARENAS: list[Arena] = []


@pytest.fixture(autouse=True)
def _close_arenas() -> Iterator[None]:
    """Each test's arena unmapped after it: a copy thread left running holds it, and a later test in the process
    checks that no arena stays mapped (test_worker.py's SIGKILL test)."""
    yield
    while _ARENAS:
        _ARENAS.pop().close()


def _outbox(arena_bytes: int) -> tuple[Copier, list[object]]:
    posted: list[object] = []
    state = SharedState()
    state.admit(["r0"])
    _ARENAS.append(Arena(arena_bytes))
    copier = Copier(_ARENAS[-1], state, lambda msg, *a, **k: posted.append(msg), device=torch.device("cpu"),
                    slot_timeout_s=1.0)
    return copier, posted


def _picture(side: int) -> torch.Tensor:
    return torch.randint(0, 256, (side, side, 3), dtype=torch.uint8)


def test_previews_in_flight_are_bounded_and_a_released_one_makes_room() -> None:
    copier, posted = _outbox(16 << 20)
    previews = copier.previews
    offered = [previews.offer(1, "r0", step + 1, 40, _picture(16)) for step in range(PREVIEW_SLOTS + 3)]
    previews.flush()
    ready = [m for m in posted if isinstance(m, PreviewReady)]
    assert offered == [True] * PREVIEW_SLOTS + [False] * 3
    assert [m.step for m in ready] == list(range(1, PREVIEW_SLOTS + 1))
    assert ready[0].tensor.shape == (16, 16, 3) and ready[0].tensor.dtype == "uint8"
    copier.release(ready[0].tensor.slot_id)  # the engine has encoded it
    assert previews.offer(1, "r0", 40, 40, _picture(16))


def test_a_preview_lands_in_its_slot_as_the_picture_it_was() -> None:
    copier, posted = _outbox(1 << 20)
    picture = _picture(24)
    assert copier.previews.offer(7, "r0", 3, 10, picture)
    copier.previews.flush()
    (ready,) = posted
    assert isinstance(ready, PreviewReady) and (ready.batch_id, ready.step, ready.total) == (7, 3, 10)
    desc = ready.tensor
    slot = Slot(desc.slot_id, desc.offset, desc.nbytes)
    # the slot's own bytes, as the engine reads them through its mapping of the arena
    assert torch.equal(as_torch(copier.arena.buffer(slot), msgspec.structs.replace(desc, offset=0)), picture)


def test_a_preview_never_waits_for_arena_room_and_outputs_still_get_theirs() -> None:
    copier, posted = _outbox(64 << 10)
    big = copier.arena.allocate(48 << 10)  # most of the arena is taken
    assert not copier.previews.offer(1, "r0", 1, 4, _picture(96))  # 27 KiB: does not fit now
    copier.previews.flush()
    assert not [m for m in posted if isinstance(m, PreviewReady)]
    assert copier.previews.in_flight == 0  # the skipped one holds nothing
    copier.arena.release(big.id)
    params = BatchParams(width=64, height=64, steps=4, guidance=1.0)
    copier.process(CopyJob(1, params, [_spec("r0")], [torch.rand(3, 64, 64)], None))
    assert [m for m in posted if isinstance(m, OutputReady)]


def test_previews_of_a_cancelled_request_are_skipped() -> None:
    copier, posted = _outbox(1 << 20)
    copier.state.cancel(["r0"])
    assert not copier.previews.offer(1, "r0", 1, 4, _picture(8))
    copier.previews.flush()
    assert posted == [] and copier.previews.in_flight == 0


def test_previews_still_in_flight_after_a_forward_are_posted_by_the_copy_thread() -> None:
    copier, posted = _outbox(1 << 20)
    copier.previews.offer(1, "r0", 1, 4, _picture(8))  # not flushed: as if its copy had not landed
    copier.submit_previews()
    assert copier.previews.take_pending() == []
    job = copier.queue.get_nowait()
    assert isinstance(job, PendingPreview)
    copier.previews.finish(job)  # what the copy thread does with it
    assert [m.step for m in posted if isinstance(m, PreviewReady)] == [1]


def test_an_output_that_is_not_finite_fails_its_request_with_the_reason_and_the_others_are_copied() -> None:
    """NaN cast to uint8 is a black picture that would pass for a result (a one-step Qwen-Image)."""
    copier, posted = _outbox(16 << 20)
    copier.state.admit(["r1"])
    good = torch.rand(3, 16, 16)
    bad = good.clone()
    bad[0, 3, 4] = float("nan")
    params = BatchParams(width=16, height=16, steps=1, guidance=1.0)
    requests = [RequestSpec(request_id=f"r{k}", prompt="a", seed=k) for k in (0, 1)]
    copier.process(CopyJob(1, params, requests, [bad, good], None))
    ended, ready = posted
    assert isinstance(ended, RequestEnded) and (ended.request_id, ended.status) == ("r0", "failed"), ended
    assert "not finite" in ended.message and ended.stage == "computing"
    assert isinstance(ready, OutputReady) and ready.request_id == "r1"


def test_a_copy_thread_whose_batch_fails_answers_its_requests_and_copies_the_next() -> None:
    """Any failure of a batch's copy beyond one request's copy fails the requests not yet answered with the
    reason, and the copy thread lives on."""
    copier, posted = _outbox(16 << 20)
    params = BatchParams(width=16, height=16, steps=1, guidance=1.0)
    broken = CopyJob(1, params, [_spec("r0")], [torch.rand(3, 16, 16)], None, trajectories=[{}, {}])  # one too many
    copier.start()
    copier.submit(broken)
    copier.state.admit(["r1"])
    copier.submit(CopyJob(2, params, [_spec("r1")], [torch.rand(3, 16, 16)], None))
    assert copier.state.drain(30)
    ended, ready = posted
    assert isinstance(ended, RequestEnded) and (ended.request_id, ended.status) == ("r0", "failed"), ended
    assert "copy failed: ValueError" in ended.message
    assert isinstance(ready, OutputReady) and ready.request_id == "r1" and copier.thread.is_alive()


def test_a_sound_track_that_is_not_finite_fails_its_request_as_a_picture_would() -> None:
    """LTX-2's sound rides with the side arrays; NaN there is no more a result than NaN pixels."""
    copier, posted = _outbox(16 << 20)
    copier.state.admit(["r1"])
    params = BatchParams(width=16, height=16, steps=1, guidance=1.0)
    bad = torch.rand(2, 800)
    bad[1, 7] = float("nan")
    sounds = [{"audio": bad}, {"audio": torch.rand(2, 800)}]
    copier.process(CopyJob(1, params, [_spec("r0"), _spec("r1")], [torch.rand(3, 16, 16)] * 2, None, sounds))
    ended, ready = posted
    assert isinstance(ended, RequestEnded) and ended.request_id == "r0" and "not finite" in ended.message
    assert isinstance(ready, OutputReady) and ready.request_id == "r1" and ready.trajectory is not None
