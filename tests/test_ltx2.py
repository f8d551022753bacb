"""LTX-2 on a real daemon (issue 30): a tiny LTX2Pipeline folder built in code (tests/ltx2kit.py), loaded as a
user's LTX-2 checkpoint is (``--model NAME=FOLDER``; the class in model_index.json decides the task).

It makes text-to-video under the real model's rules (8k+1 frames, sides in multiples of 32 and at least 64),
animates an image through LTX2ImageToVideoPipeline built on its weights, and brings the sound track the model
made back: an AAC stream in its mp4, as long as the video; a WAV at the vocoder's rate for every format; none
with "audio": false. A silent model (tiny-video, served beside it) refuses "audio": true.
"""

from __future__ import annotations

import base64
import io
import mmap
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import msgspec
import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, wait_job
from ltx2kit import SAMPLE_RATE, build_ltx2
from test_edits import blocky, png_bytes
from test_image_tasks import b64, job

import diffusiond.pipelines.ltx2 as ltx2
from diffusiond.client import Client

BASE = {"model": "ltx2", "prompt": "a drum", "width": 64, "height": 64, "steps": 2, "num_frames": 9, "seed": 3}


@pytest.fixture(scope="module")
def ltx2_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    folder = build_ltx2(tmp_path_factory.mktemp("ltx2") / "ltx2")
    config = folder.parent / "limits.toml"
    config.write_text("[limits]\nmin_size = 32\n")  # under LTX-2's own smallest side (64), which then decides
    with shared_daemon(tmp_path_factory.mktemp("ltx2-daemon"), ["--model", f"ltx2={folder}", "--model", "tiny-video",
                                                                "--workers", "1", "--job-timeout", "120",
                                                                "--config", str(config)],
                       model_cache) as d:
        yield d


async def _made(d: Daemon, body: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    async with http(d.socket) as s:
        status, made = await job(s, {**BASE, **body})
        assert status == 202, made
        done = await wait_job(s, made["id"], timeout=120)
        assert done["status"] == "succeeded", done
        async with s.get(done["outputs"][0]["url"]) as r:
            assert r.status == 200
            return done, await r.read()


async def test_an_ltx2_folder_declares_the_real_models_rules(ltx2_daemon: Daemon) -> None:
    async with http(ltx2_daemon.socket) as s, s.get("/v1/models") as r:
        models = {m["id"]: m for m in (await r.json())["data"]}
    m = models["ltx2"]
    assert (m["task"], m["edits"], m["size_step"]) == ("text-to-video", ["image-to-video"], 32)
    assert (m["sample_rate"], models["tiny-video"]["sample_rate"]) == (SAMPLE_RATE, None)
    assert not any("audio" in a for a in m["approximations"])  # nothing the model made is dropped
    async with http(ltx2_daemon.socket) as s:
        frames, frames_body = await job(s, {**BASE, "num_frames": 12})
        side, side_body = await job(s, {**BASE, "width": 80})
    assert frames == 400 and frames_body["error"]["field"] == "num_frames", frames_body
    assert "use 9 or 17" in frames_body["error"]["message"], frames_body
    assert side == 400 and side_body["error"]["field"] == "width", side_body


def test_only_ltx2_is_conditioned_on_fps_and_each_ltx_defaults_to_its_own_rate() -> None:
    """LTX-Video's pipelines take a frame_rate too, but run at their own 25 whatever the playback fps, as before
    issue 30; a model's default fps is its pipeline's frame_rate default, 16 where it has none (Wan)."""
    import diffusers

    assert ltx2.frame_rate_args(diffusers.LTX2Pipeline, 12) == {"frame_rate": 12.0}
    assert ltx2.frame_rate_args(diffusers.LTX2ImageToVideoPipeline, 12) == {"frame_rate": 12.0}
    for cls in (diffusers.LTXPipeline, diffusers.LTXImageToVideoPipeline, diffusers.WanPipeline):
        assert ltx2.frame_rate_args(cls, 12) == {} and not ltx2.conditions_on_fps(cls)
    assert [ltx2.default_fps(c) for c in (diffusers.LTX2Pipeline, diffusers.LTXPipeline, diffusers.WanPipeline)] == [
        24, 25, 16]


async def test_a_side_under_ltx2s_smallest_is_refused_naming_it(ltx2_daemon: Daemon) -> None:
    """LTX-2's decoder pads by reflection: one latent pixel a side (32) fails inside the pipeline, so the model
    declares 64 as its smallest side and admission refuses less, though the limits would take 32 (issue 30)."""
    async with http(ltx2_daemon.socket) as s, s.get("/v1/models") as r:
        models = {m["id"]: m for m in (await r.json())["data"]}
    assert (models["ltx2"]["min_size"], models["tiny-video"]["min_size"]) == (64, 32)
    async with http(ltx2_daemon.socket) as s:
        for body, field in (({"width": 32}, "width"), ({"height": 32, "width": 96}, "height")):
            status, refused = await job(s, {**BASE, **body})
            assert status == 400 and refused["error"]["field"] == field, refused
            assert f"{field} must be at least 64 for 'ltx2'" in refused["error"]["message"], refused
            assert "got 32" in refused["error"]["message"], refused
        for width in (16, 100):  # under the limits' floor, or no multiple of 32: the range named is the model's
            status, refused = await job(s, {**BASE, "width": width})
            assert status == 400 and refused["error"]["field"] == "width", refused
            assert "between 64 and" in refused["error"]["message"], refused
        small = base64.b64encode(png_bytes(blocky(1, 48))).decode()  # its own size, rounded to 32, would be 32
        sized = {k: v for k, v in BASE.items() if k not in ("width", "height")}
        status, refused = await job(s, {**sized, "image": small})
        assert status == 400 and refused["error"]["field"] == "image", refused
        assert "outputs are 64 to" in refused["error"]["message"], refused
        status, made = await job(s, {**BASE, "model": "tiny-video", "width": 32, "height": 32})
        assert status == 202, made  # the limits' floor, where the model makes it
        assert (await wait_job(s, made["id"], timeout=120))["status"] == "succeeded"


async def test_one_step_is_refused_where_the_scheduler_stretches_its_last_step(ltx2_daemon: Daemon) -> None:
    """LTX's schedulers stretch the last sigma to shift_terminal, which over one step divides by zero: the job
    would succeed with an image of NaN. Both models declare two steps as their fewest, and admission holds it."""
    async with http(ltx2_daemon.socket) as s, s.get("/v1/models") as r:
        models = {m["id"]: m for m in (await r.json())["data"]}
    assert (models["ltx2"]["min_steps"], models["tiny-video"]["min_steps"]) == (2, 2)
    async with http(ltx2_daemon.socket) as s:
        for model in ("ltx2", "tiny-video"):
            status, refused = await job(s, {**BASE, "model": model, "width": 64, "steps": 1})
            assert status == 400 and refused["error"]["field"] == "steps", refused
            assert f"model {model!r} takes at least 2 steps" in refused["error"]["message"], refused


async def test_ltx2_declares_no_previews_and_refuses_a_request_for_them(ltx2_daemon: Daemon) -> None:
    """Its VAE makes LTX-Video's 128 channels, but LTX-Video's preview factors are fitted on another VAE's latents:
    the model shows no previews rather than wrong colours, and a request for them is a 400 naming ``preview``."""
    async with http(ltx2_daemon.socket) as s:
        async with s.get("/v1/models") as r:
            assert {m["id"]: m["previews"] for m in (await r.json())["data"]}["ltx2"] is False
        status, refused = await job(s, {**BASE, "preview": {"every": 1}})
    assert status == 400 and refused["error"]["field"] == "preview", refused
    assert "'ltx2' cannot show previews" in refused["error"]["message"], refused


async def test_an_mp4_carries_the_sound_track_as_long_as_the_video_and_a_wav_serves_it(ltx2_daemon: Daemon) -> None:
    # fps left out: the model's default is LTX2Pipeline's own frame_rate default (24), what it was trained at
    done, mp4 = await _made(ltx2_daemon, {"output_format": "mp4"})
    out = done["outputs"][0]
    assert done["request"]["audio"] is True and out["audio"]["sample_rate"] == SAMPLE_RATE, out
    with av.open(io.BytesIO(mp4)) as container:
        video, sound = container.streams.video[0], container.streams.audio[0]
        assert (sound.codec_context.name, sound.channels) == ("aac", 2)
        video_s, sound_s = float(video.duration * video.time_base), float(sound.duration * sound.time_base)
        assert abs(video_s - 9 / 24) < 1e-3 and abs(sound_s - video_s) <= 1 / 24, (video_s, sound_s)
        assert '"audio":"16000 Hz"' in container.metadata.get("comment", "")
    async with http(ltx2_daemon.socket) as s, s.get(out["audio"]["url"]) as r:
        assert (r.status, r.content_type) == (200, "audio/wav")
        wav = await r.read()
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 2, 2)
        assert w.getnframes() == out["audio"]["samples"] > 0
        assert abs(w.getnframes() / SAMPLE_RATE - 9 / 24) < 0.06, w.getnframes()  # made at 24 (16 gives ~0.52 s)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert pcm.any()  # the vocoder's waveform, not silence


def test_the_client_maps_the_track_read_only_and_reads_it_over_http_alike(ltx2_daemon: Daemon) -> None:
    with Client(str(ltx2_daemon.socket), zero_copy=True) as c:
        h = c.submit("a drum", model="ltx2", size=(64, 64), steps=2, num_frames=9, seed=3, output_format="npy")
        waveform, rate = h.audio(0)
        assert rate == SAMPLE_RATE and waveform.dtype == np.float32 and waveform.shape[0] == 2
        assert not waveform.flags.writeable
        root = waveform
        while getattr(root, "base", None) is not None:
            root = root.base
        assert isinstance(root.obj if isinstance(root, memoryview) else root, mmap.mmap)  # the daemon's memory
        over_http = Client(str(ltx2_daemon.socket), zero_copy=False)
        with over_http:
            copy, copy_rate = over_http.audio(h.id, 0)
        assert copy_rate == rate and np.array_equal(copy, waveform) and not copy.flags.writeable


async def test_audio_false_leaves_the_track_out(ltx2_daemon: Daemon) -> None:
    done, mp4 = await _made(ltx2_daemon, {"output_format": "mp4", "audio": False})
    out = done["outputs"][0]
    assert (done["request"]["audio"], out["audio"]) == (False, None)
    with av.open(io.BytesIO(mp4)) as container:
        assert [s.type for s in container.streams] == ["video"]
        assert len([f for f in container.decode(video=0)]) == 9
    async with http(ltx2_daemon.socket) as s, s.get(f"/v1/jobs/{done['id']}/outputs/0/audio") as r:
        assert r.status == 404 and "no sound track" in (await r.json())["error"]["message"]


async def test_a_silent_model_refuses_audio_true(ltx2_daemon: Daemon) -> None:
    body = {"model": "tiny-video", "prompt": "a drum", "width": 64, "height": 64, "steps": 2, "num_frames": 9}
    async with http(ltx2_daemon.socket) as s:
        status, refused = await job(s, {**body, "audio": True})
        assert status == 400 and refused["error"]["field"] == "audio", refused
        assert "makes no sound track" in refused["error"]["message"]
        status, bad = await job(s, {**BASE, "audio": "yes"})
        assert status == 400 and bad["error"]["field"] == "audio", bad


async def test_an_image_animates_through_ltx2s_image_to_video(ltx2_daemon: Daemon) -> None:
    _, plain = await _made(ltx2_daemon, {"output_format": "npy"})
    _, first = await _made(ltx2_daemon, {"output_format": "npy", "image": b64(1)})
    video = np.load(io.BytesIO(first))
    assert video.shape == (9, 64, 64, 3)
    assert first != plain  # the image is what changed it


def test_fps_is_in_the_batch_key_and_the_compiled_shape_only_where_the_model_is_conditioned_on_it() -> None:
    """Wan or tiny-video requests that differ only in playback fps share a forward; LTX-2's do not, and a new fps
    is a new compiled shape there (its sound track lasts frames / fps), the default one the warm-up's."""
    from diffusiond.daemon.core.jobs import JobRequest
    from diffusiond.pipelines.compile import shape_key

    def params(fps: int, conditioned: bool) -> Any:
        return JobRequest(model="m", prompt="p", n=1, width=64, height=64, steps=1, guidance=3.0, output_format="mp4",
                          num_frames=9, fps=fps, fps_conditions=conditioned).batch_params()

    assert params(8, False) == params(16, False)
    assert params(8, True) != params(16, True)
    warm = msgspec.structs.replace(params(24, True), fps=None)
    at_24 = shape_key(params(24, True), 1, fps=24)
    assert shape_key(params(12, True), 1, fps=24) != at_24 == shape_key(warm, 1, fps=24)
    assert shape_key(params(12, False), 1) == shape_key(params(24, False), 1)


async def test_a_stopped_workers_sound_tracks_leave_its_arena_and_are_still_served(ltx2_daemon: Daemon) -> None:
    """Every output's sound track holds a side region in its worker's arena; once the model is unloaded (its
    worker stopped) and loaded again, the tracks are copied out, so the old arena is unmapped, and still served."""
    async with http(ltx2_daemon.socket) as s:
        status, made = await job(s, {**BASE, "output_format": "npy", "seed": 11})
        assert status == 202, made
        first = await wait_job(s, made["id"], timeout=120)
        assert first["status"] == "succeeded", first
        async with s.get(first["outputs"][0]["audio"]["url"]) as r:
            assert r.status == 200
            wav = await r.read()
        async with s.post("/v1/models/ltx2/unload") as r:
            assert r.status == 200, await r.text()
        status, made = await job(s, {**BASE, "output_format": "npy", "seed": 12})  # loads it again
        assert status == 202, made
        assert (await wait_job(s, made["id"], timeout=120))["status"] == "succeeded"
        async with s.get(first["outputs"][0]["audio"]["url"]) as r:
            assert r.status == 200 and await r.read() == wav
    assert f"spilled the trajectory of {first['id']}" in ltx2_daemon.log_path.read_text(errors="replace")
