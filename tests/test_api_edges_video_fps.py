"""A job's ``request`` shows the frame rate its video is made at (docs/api.md, "Jobs"): a field left out takes the
model's default, which the job records in ``request``. The frame rate was the one such field it did not show, so a
video job sent without ``fps`` gave no way to learn the rate of the MP4 it made but to decode it. A synthetic
text-to-video model (real MP4 encoding, no denoiser to wait for) and a synthetic picture model, on one daemon."""

from __future__ import annotations

import io
from collections.abc import Callable

import av
from apikit import SIZE, get_json, run_job
from daemonkit import Daemon, http

VIDEO = {"model": "video", "prompt": "waves", "width": SIZE, "height": SIZE, "steps": 2, "num_frames": 3}


async def test_a_video_jobs_request_shows_the_fps_its_mp4_has_given_or_the_models_default(
        daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory("--model", "video=synthetic:task=video,compute_ms=20", "--model", "pic=synthetic:compute_ms=5",
                       "--device", "cpu")
    async with http(d.socket) as s:
        left_out = await run_job(s, VIDEO)
        given = await run_job(s, {**VIDEO, "fps": 8})
        picture = await run_job(s, {"model": "pic", "prompt": "a fox", "width": SIZE, "height": SIZE, "steps": 2})
        status, listing = await get_json(s, "/v1/models")
        rates = []
        for job in (left_out, given):
            assert job["status"] == "succeeded", job
            async with s.get(job["outputs"][0]["url"]) as r:
                with av.open(io.BytesIO(await r.read())) as container:
                    rates.append(container.streams.video[0].average_rate)
    assert status == 200
    default = next(m for m in listing["data"] if m["id"] == "video")["defaults"]["fps"]
    assert left_out["request"]["fps"] == default and given["request"]["fps"] == 8
    assert rates == [default, 8]  # the rate shown is the one the video has
    assert picture["status"] == "succeeded" and picture["request"]["fps"] is None  # a picture has no frame rate
