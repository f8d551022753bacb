"""Outputs asked for in a form they do not have, against a real daemon serving a synthetic video model: an
animated picture or a video asked for as one array is refused with what to ask for instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonkit import Daemon, shared_daemon

from diffusiond.client import Client

VIDEO = {"model": "video", "size": (64, 64), "steps": 1, "num_frames": 5}


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    args = ["--model", "video=synthetic:task=video,compute_ms=5", "--no-persist"]
    with shared_daemon(tmp_path_factory.mktemp("client-edges-outputs"), args, model_cache,
                       {"OMP_NUM_THREADS": "1"}) as d:
        yield d


@pytest.mark.parametrize("fmt", ["gif", "webp"])
def test_an_animated_picture_asked_for_as_an_array_is_refused_not_cut_to_its_first_frame(video: Daemon,
                                                                                         fmt: str) -> None:
    with Client(str(video.socket)) as c:
        job = c.submit("a wave", output_format=fmt, **VIDEO)
        with pytest.raises(ValueError, match=r"has 5 frames.*output_format='npy'"):
            job.outputs("array")
        (clip,) = job.outputs("pil")  # the picture itself, each frame reached with seek()
        assert clip.n_frames == 5


def test_a_video_asked_for_as_a_picture_says_to_fetch_its_bytes(video: Daemon) -> None:
    with Client(str(video.socket)) as c:
        job = c.submit("a wave", output_format="mp4", **VIDEO)
        for form in ("array", "pil"):
            with pytest.raises(ValueError, match=rf"output 0 of job {job.id} \(video/mp4\) is no picture.*'bytes'"):
                job.outputs(form)  # type: ignore[call-overload]
        assert job.outputs("bytes")[0][4:8] == b"ftyp"
