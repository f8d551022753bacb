"""Video: the embedded ``tiny-video`` model (a real LTX pipeline with random weights) and the path
its frames take to an MP4 a client can decode.

All on CPU with real diffusers code and no network: tiny-video is built once per session into the
``model_cache`` folder and loaded back through the local-folder loader, like ``tiny``.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec
from diffusiond.pipelines import PipelineError, Task, load_pipeline
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.tiny_video import DEFAULTS, TINY_VIDEO_VERSION, ensure_tiny_video

SIZE = 64


def clip(frames: int = 9, steps: int = 2, size: int = SIZE) -> BatchParams:
    return BatchParams(width=size, height=size, steps=steps, guidance=3.0, num_frames=frames)


def req(seed: int, prompt: str = "waves on a beach at dusk") -> RequestSpec:
    return RequestSpec(request_id=f"v{seed}", prompt=prompt, seed=seed)


def always(_step: int, _total: int) -> bool:
    return True


def to_u8(x: torch.Tensor) -> torch.Tensor:
    return (x * 255).round().clamp(0, 255).to(torch.uint8)


def decode_mp4(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.fixture(scope="session")
def tiny_video(model_cache: Path) -> DiffusersPipeline:
    pipe = load_pipeline("tiny-video")
    assert isinstance(pipe, DiffusersPipeline)
    return pipe


def test_tiny_video_is_an_ltx_pipeline_saved_as_safetensors(tiny_video: DiffusersPipeline, model_cache: Path) -> None:
    folder = ensure_tiny_video(model_cache)
    assert folder == model_cache / "models" / TINY_VIDEO_VERSION
    weights = [p.name for p in folder.rglob("*") if p.suffix in {".safetensors", ".bin", ".ckpt", ".pt"}]
    assert weights and all(w.endswith(".safetensors") for w in weights)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "build leftovers in the cache"
    assert type(tiny_video.pipe).__name__ == "LTXPipeline"
    assert (tiny_video.name, tiny_video.task, tiny_video.dtype) == ("tiny-video", Task.TEXT_TO_VIDEO, torch.float32)
    assert tiny_video.capabilities == Capabilities(
        task="text-to-video", **DEFAULTS, num_frames_step=8, flow_scheduler=True, size_step=32, min_size=32,
        min_steps=2, edits=("image-to-video",),  # LTXImageToVideoPipeline on the same weights (pipelines/edit_pipes.py)
    )


@pytest.mark.parametrize("frames", [9, 17, 1])
def test_frames_are_f_c_h_w_floats_in_0_1(tiny_video: DiffusersPipeline, frames: int) -> None:
    (video,) = tiny_video.run(clip(frames), [req(1)], always)
    assert video.shape == (frames, 3, SIZE, SIZE)
    assert video.dtype == torch.float32 and video.device == tiny_video.device
    assert 0.0 <= video.min().item() <= video.max().item() <= 1.0
    assert video.std().item() > 0.02, "output is flat; the model should give varied noise"


def test_batch_of_two_at_a_non_square_size(tiny_video: DiffusersPipeline) -> None:
    params = BatchParams(width=96, height=64, steps=2, guidance=3.0, num_frames=9)
    out = tiny_video.run(params, [req(1), req(2, "a lighthouse")], always)
    assert [tuple(v.shape) for v in out] == [(9, 3, 64, 96)] * 2
    assert not torch.equal(to_u8(out[0]), to_u8(out[1]))


def test_same_seed_same_frames_and_other_seeds_differ(tiny_video: DiffusersPipeline) -> None:
    a = tiny_video.run(clip(), [req(7)], always)[0]
    b = tiny_video.run(clip(), [req(7)], always)[0]
    c = tiny_video.run(clip(), [req(8)], always)[0]
    assert torch.equal(a, b)
    assert (to_u8(a) != to_u8(c)).float().mean().item() > 0.5


def test_a_frame_count_the_model_cannot_make_is_refused_naming_the_ones_it_can(tiny_video: DiffusersPipeline) -> None:
    with pytest.raises(PipelineError, match=r"8k\+1 frames .*num_frames=10 .*use 9 or 17"):
        tiny_video.run(clip(10), [req(1)], always)


def test_a_size_the_model_cannot_make_is_refused(tiny_video: DiffusersPipeline) -> None:
    with pytest.raises(PipelineError, match="divisible by 32"):
        tiny_video.run(clip(size=72), [req(1)], always)


def test_tiny_video_stays_small_enough_for_ci(tiny_video: DiffusersPipeline) -> None:
    """The point of tiny-video: CI can afford it (a batch took ~0.2 s on the 2-core box). Its size
    is what keeps it so, and unlike a stopwatch the count does not depend on the machine."""
    import torch

    params = {name: sum(p.numel() for p in c.parameters())
              for name, c in tiny_video._pipe.components.items() if isinstance(c, torch.nn.Module)}  # fmt: skip
    assert {"transformer", "vae", "text_encoder"} <= set(params), params
    assert sum(params.values()) < 1_000_000, params  # 0.41 M today


def test_frames_encode_to_an_mp4_of_exactly_those_frames(tiny_video: DiffusersPipeline) -> None:
    from diffusiond.daemon.outputs.encoders import EncodeOptions, encode

    (video,) = tiny_video.run(clip(9), [req(3)], always)
    array = to_u8(video).permute(0, 2, 3, 1).contiguous().numpy()  # F,H,W,C as the worker delivers
    frames = decode_mp4(encode(array, "mp4", EncodeOptions(fps=8)))
    assert len(frames) == 9
    assert all(f.shape == (SIZE, SIZE, 3) for f in frames)


# --- end to end: the daemon serving tiny-video -------------------------------------------------


def test_daemon_generate_writes_an_mp4_of_the_asked_frames(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny-video", "--job-timeout", "120")
    out = tmp_path / "clip.mp4"
    argv = [sys.executable, "-m", "diffusiond", "generate", "a clip", "--socket", str(d.socket),
            "--format", "mp4", "--frames", "9", "--size", "96x64", "--steps", "2", "-o", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + d.log()
    frames = decode_mp4(out.read_bytes())
    assert len(frames) == 9
    assert frames[0].shape == (64, 96, 3)
