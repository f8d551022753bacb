"""An output longer than its format holds is refused at admission, on every path that makes one.

WebP holds 16383 pixels a side, libjpeg 65500 (its header has room for 65535, but the library stops short)
and GIF 65535. Once ``[limits] max_size`` is raised past one of them, a plain job, an OpenAI generation or
an edit asked for a side the format cannot hold: it was admitted, computed, then failed at its encoding
(libwebp's "encoding error 5", libjpeg's "broken data stream"), after the work. The refusal is a 400
naming ``output_format`` (``upscale.scale`` or ``hires.scale`` where those made the size: test_upscale.py)
that says the side, the format's limit and what to ask for instead. The largest side each format holds
still runs and encodes.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, wait_job
from fuzzhttpkit import call, call_json, check_answer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from diffusiond.daemon.outputs.encoders import encode
from diffusiond.protocol import FORMATS

PNG_64 = (lambda b: (Image.new("RGB", (64, 64), (90, 120, 200)).save(b, "PNG"), b.getvalue())[1])(io.BytesIO())
IMAGE = {"model": "img", "prompt": "a long strip", "steps": 1}
CLIP = {"model": "clip", "prompt": "a long strip", "steps": 1, "num_frames": 2}
EDIT = {"model": "tiny", "prompt": "a long strip", "steps": 2, "image": base64.b64encode(PNG_64).decode()}


def test_jpeg_holds_65500_pixels_a_side_as_libjpeg_does() -> None:
    assert encode(np.zeros((8, 65500, 3), np.uint8), "jpeg")[:2] == b"\xff\xd8"
    with pytest.raises(ValueError, match=r"jpeg holds at most 65500 pixels a side.*png") as caught:
        encode(np.zeros((65501, 8, 3), np.uint8), "jpeg")
    assert "8x65501" in str(caught.value)


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Path]:
    tmp = tmp_path_factory.mktemp("format-sides")
    (tmp / "limits.toml").write_text("[limits]\nmax_size = 65536\n")
    args = ["--config", str(tmp / "limits.toml"), "--model", "tiny", "--model", "img=synthetic:compute_ms=1",
            "--model", "clip=synthetic:task=video,compute_ms=1", "--job-timeout", "120"]
    d: Daemon
    with shared_daemon(tmp, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d.socket


async def _answer(s: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The answer to a JSON body, or to an edits form of its fields; a job admitted by mistake is cancelled."""
    if path == "/v1/images/edits":
        form = aiohttp.FormData(default_to_multipart=True)
        for k, v in body.items():
            if k == "image":
                form.add_field(k, PNG_64, filename="in.png", content_type="image/png")
            else:
                form.add_field(k, v)
        post = s.post(path, data=form)
    else:
        post = s.post(path, json=body)
    async with post as r:
        status, answer = r.status, await r.json()
    if status == 202:
        async with s.delete(f"/v1/jobs/{answer['id']}?finished=keep"):
            pass
    return status, answer


@pytest.mark.parametrize(("path", "body", "fmt", "size", "instead"), [
    ("/v1/jobs", IMAGE, "webp", (16384, 64), "png"),
    ("/v1/jobs", IMAGE, "webp", (64, 16384), "png"),
    ("/v1/jobs", IMAGE, "jpeg", (65504, 64), "png"),
    ("/v1/jobs", CLIP, "webp", (16384, 64), "mp4"),
    ("/v1/jobs", CLIP, "gif", (65536, 64), "mp4"),
    ("/v1/images/generations", {k: v for k, v in IMAGE.items() if k != "steps"}, "webp", (16384, 64), "png"),
    ("/v1/jobs", EDIT, "webp", (16384, 64), "png"),
    ("/v1/images/edits", {"model": "tiny", "prompt": "a long strip", "num_inference_steps": "2", "image": ""},
     "jpeg", (65504, 64), "png"),
], ids=["jobs-webp-wide", "jobs-webp-tall", "jobs-jpeg", "jobs-video-webp", "jobs-video-gif", "generations-webp",
        "jobs-edit-webp", "edits-form-jpeg"])
async def test_a_side_over_the_formats_limit_is_a_400_naming_the_format_the_side_and_what_to_ask_for(
        sock: Path, path: str, body: dict[str, Any], fmt: str, size: tuple[int, int], instead: str) -> None:
    width, height = size
    sides = {"size": f"{width}x{height}"} if path.startswith("/v1/images") else {"width": width, "height": height}
    async with http(sock) as s:
        status, answer = await _answer(s, path, {**body, **sides, "output_format": fmt})
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == "invalid_request" and error["field"] == "output_format", error
    limit = {"webp": 16383, "jpeg": 65500, "gif": 65535}[fmt]
    assert f"{fmt} holds at most {limit} pixels a side" in error["message"], error
    assert f"{width}x{height}" in error["message"] and instead in error["message"], error
    assert "smaller size" in error["message"], error


@pytest.mark.parametrize(("body", "fmt", "size"), [
    (IMAGE, "webp", (16376, 64)), (IMAGE, "jpeg", (64, 65496)), (CLIP, "gif", (65528, 64)),
], ids=["webp", "jpeg", "gif"])
async def test_the_largest_side_a_format_holds_runs_and_encodes(sock: Path, body: dict[str, Any], fmt: str,
                                                                size: tuple[int, int]) -> None:
    width, height = size
    async with http(sock) as s:
        async with s.post("/v1/jobs", json={**body, "width": width, "height": height, "output_format": fmt}) as r:
            assert r.status == 202, await r.text()
            job = await wait_job(s, (await r.json())["id"])
        assert job["status"] == "succeeded", job
        async with s.get(job["outputs"][0]["url"]) as r:
            assert r.status == 200
            picture = Image.open(io.BytesIO(await r.read()))
    assert picture.format.lower() == fmt and picture.size == (width, height)


# The rule's fuzz family: the fuzzing daemons (test_fuzz_http.py, scripts/fuzz.py) keep max_size at 128, where no
# format's limit is in reach, so it is drawn here, on both sides of every limit, in both orientations, on the
# endpoints that make a picture or a video from a size.
LONG = st.sampled_from([16376, 16384, 16392, 65496, 65504, 65528, 65536])
FORMATS_OF = {"img": ["png", "jpeg", "webp", "npy"], "clip": ["mp4", "webp", "gif", "npy"]}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), long=LONG, short=st.sampled_from([64, 128]), wide=st.booleans(),
       where=st.sampled_from([("/v1/jobs", "img"), ("/v1/jobs", "clip"), ("/v1/images/generations", "img")]))
def test_fuzz_sizes_around_the_formats_limits(sock: Path, data: st.DataObject, long: int, short: int, wide: bool,
                                              where: tuple[str, str]) -> None:
    path, model = where
    fmt = data.draw(st.sampled_from(FORMATS_OF[model]), label="output_format")
    width, height = (long, short) if wide else (short, long)
    body: dict[str, Any] = {"model": model, "prompt": "a long strip", "output_format": fmt, "seed": 1}
    body |= {"size": f"{width}x{height}"} if path.startswith("/v1/images") else \
        {"width": width, "height": height, "steps": 1, **({"num_frames": 2} if model == "clip" else {})}
    if path.startswith("/v1/images"):
        body["response_format"] = "url"
    status, headers, raw = call(sock, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    answer = check_answer("POST", path, status, headers, raw, body)  # the documented shape of every answer
    if status == 202:
        call_json(sock, "DELETE", f"/v1/jobs/{answer['id']}?finished=keep")
    if long > FORMATS[fmt].max_side:
        assert status == 400 and answer["error"]["field"] == "output_format", (body, answer)
        assert f"{width}x{height}" in answer["error"]["message"], answer
    else:
        assert status == (202 if path == "/v1/jobs" else 200), (body, answer)
