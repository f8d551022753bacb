"""Live previews (issue 14) against a real daemon on ``tiny``: real workers, real socket, real SSE.

A request with ``"preview"`` gets ``preview`` events while it denoises (steps increasing, images
decodable in the asked format and size, the latest one also at ``/v1/jobs/{id}/preview/{k}``);
without it, none. Previews never change the output, never hold a job up behind a reader that
stopped reading (such a reader gets the latest one, older ones are dropped and counted), and
the metrics count what was sent and dropped.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, get, http, shared_daemon, sse, submit, wait_job
from PIL import Image

STEPS = 8


@pytest.fixture(scope="module")
def previews_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path):  # type: ignore[no-untyped-def]
    with shared_daemon(tmp_path_factory.mktemp("previews"), ["--model", "tiny", "--max-batch", "4"],
                       model_cache) as d:
        yield d


def _image(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()  # decodes every byte: a truncated file fails here
    return img


async def _metric(s: aiohttp.ClientSession, name: str) -> float:
    async with s.get("/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def _output(s: aiohttp.ClientSession, job_id: str, k: int = 0) -> bytes:
    async with s.get(f"/v1/jobs/{job_id}/outputs/{k}") as r:
        assert r.status == 200
        return await r.read()


async def _read_events(stream: aiohttp.ClientResponse) -> list[tuple[str, dict[str, Any]]]:
    """Every event until ``done``, read in chunks (lines of base64 are longer than a small buffer)."""
    events: list[tuple[str, dict[str, Any]]] = []
    buf = b""
    async for chunk in stream.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            fields = dict(line.split(": ", 1) for line in block.decode().split("\n") if ": " in line)
            if "event" in fields:
                events.append((fields["event"], json.loads(fields["data"])))
                if fields["event"] == "done":
                    return events
    return events


def _body(**extra: Any) -> dict[str, Any]:
    return {"prompt": "a lighthouse at dusk", "steps": STEPS, "seed": 7, "width": 128, "height": 96, **extra}


async def test_preview_every_step_sends_growing_steps_of_decodable_images_in_format_and_size(
        previews_daemon: Daemon) -> None:
    async with http(previews_daemon.socket) as s:
        for fmt, pil_name in (("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")):
            job = await submit(s, _body(preview={"every": 1, "format": fmt, "max_side": 64}))
            events = await sse(s, job["id"])
            previews = [d for name, d in events if name == "preview"]
            assert previews, f"no preview events for {fmt}: {[n for n, _ in events]}"
            steps = [p["step"] for p in previews]
            assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
            assert all(1 <= st < STEPS for st in steps), steps  # the last step's picture is the output itself
            assert events[-1][0] == "done"
            for p in previews:
                assert p["job_id"] == job["id"] and p["index"] == 0 and p["total"] == STEPS
                assert p["format"] == fmt and p["url"] == f"/v1/jobs/{job['id']}/preview/0"
                img = _image(base64.b64decode(p["image"]))
                assert img.format == pil_name
                assert img.size == (64, 48)  # 128x96 scaled so the longer side is max_side
            async with s.get(previews[-1]["url"]) as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == f"image/{fmt}"
                assert int(r.headers["X-Preview-Step"]) == previews[-1]["step"]
                assert await r.read() == base64.b64decode(previews[-1]["image"])


async def test_preview_of_each_output_and_max_side_above_the_image_keeps_its_size(previews_daemon: Daemon) -> None:
    async with http(previews_daemon.socket) as s:
        job = await submit(s, _body(n=2, preview={"every": 3, "max_side": 1024}))
        events = await sse(s, job["id"])
        previews = [d for name, d in events if name == "preview"]
        assert {p["index"] for p in previews} == {0, 1}
        for p in previews:
            assert p["step"] % 3 == 0 and p["format"] == "jpeg"
            assert _image(base64.b64decode(p["image"])).size == (128, 96)  # never upscaled past the output


async def test_previews_are_off_by_default(previews_daemon: Daemon) -> None:
    async with http(previews_daemon.socket) as s:
        job = await submit(s, _body())
        events = await sse(s, job["id"])
        assert [n for n, _ in events if n == "preview"] == []
        assert events[-1][0] == "done"
        status, err = await get(s, f"/v1/jobs/{job['id']}/preview/0")
        assert status == 404 and err["error"]["code"] == "preview_not_found"
        assert "did not ask for previews" in err["error"]["message"]


async def test_the_output_is_the_same_with_and_without_previews(previews_daemon: Daemon) -> None:
    async with http(previews_daemon.socket) as s:
        plain = await submit(s, _body(output_format="png"))
        shown = await submit(s, _body(output_format="png", preview={"every": 1}))
        for job in (plain, shown):
            assert (await wait_job(s, job["id"]))["status"] == "succeeded"
        assert await _output(s, plain["id"]) == await _output(s, shown["id"])


async def test_a_reader_that_stops_reading_does_not_hold_the_job_and_gets_the_latest_preview(
        previews_daemon: Daemon) -> None:
    """The reader opens the stream and reads nothing until the job has succeeded; previews that
    overfill the stream's buffers (PNGs of noisy early latents) must be dropped, not queued
    behind it, and what it finally reads ends with the newest preview and ``done``."""
    async with http(previews_daemon.socket) as s:
        dropped0 = await _metric(s, "diffusiond_previews_dropped_total")
        sent0 = await _metric(s, "diffusiond_previews_sent_total")
        steps = 12
        job = await submit(s, _body(steps=steps, width=192, height=144, preview={"every": 1, "format": "png"}))
        # a client that buffers little (2 KiB before it stops reading the socket), so what the
        # stream can hold is the daemon's doing, not aiohttp's 128 KiB on this side
        conn = aiohttp.UnixConnector(path=str(previews_daemon.socket))
        async with aiohttp.ClientSession(connector=conn, base_url="http://diffusiond", read_bufsize=1024) as slow, \
                slow.get(f"/v1/jobs/{job['id']}/events") as stream:
            assert stream.status == 200
            final = await wait_job(s, job["id"], timeout=300)  # while the stream is not read at all
            assert final["status"] == "succeeded"
            async with s.get(f"/v1/jobs/{job['id']}/preview/0") as r:
                assert r.status == 200
                latest_step = int(r.headers["X-Preview-Step"])
                latest_bytes = len(await r.read())
            events = await _read_events(stream)
        previews = [d["step"] for n, d in events if n == "preview"]
        assert events[-1][0] == "done"
        assert previews and previews[-1] == latest_step == steps - 1, (previews, latest_step)
        assert len(previews) < steps - 1, f"every preview ({latest_bytes} bytes each) was queued behind the reader"
        dropped = await _metric(s, "diffusiond_previews_dropped_total") - dropped0
        sent = await _metric(s, "diffusiond_previews_sent_total") - sent0
        assert dropped >= 1
        assert sent == len(previews)


async def test_metrics_count_previews_sent(previews_daemon: Daemon) -> None:
    async with http(previews_daemon.socket) as s:
        before = await _metric(s, "diffusiond_previews_sent_total")
        job = await submit(s, _body(preview={"every": 2}))
        events = await sse(s, job["id"])
        got = sum(1 for n, _ in events if n == "preview")
        assert got >= 1
        assert await _metric(s, "diffusiond_previews_sent_total") - before == got


@pytest.mark.parametrize(("preview", "field"), [
    ({"every": 0}, "preview.every"),
    ({"every": STEPS + 1}, "preview.every"),
    ({"format": "gif"}, "preview.format"),
    ({"max_side": 8}, "preview.max_side"),
    ({"max_side": 4096}, "preview.max_side"),
    ({"every": "1"}, "preview.every"),
    ({"size": 3}, "preview"),
    ("yes", "preview"),
])
async def test_a_bad_preview_is_a_400_naming_the_field(previews_daemon: Daemon, preview: Any, field: str) -> None:
    async with http(previews_daemon.socket) as s:
        for path, body in (("/v1/jobs", _body(preview=preview)),
                           ("/v1/images/generations", {"prompt": "x", "num_inference_steps": STEPS,
                                                       "preview": preview})):
            async with s.post(path, json=body) as r:
                err = await r.json()
                assert r.status == 400, err
                assert err["error"]["field"] == field, err


async def test_the_openai_endpoint_takes_preview_in_extra_body(previews_daemon: Daemon) -> None:
    async with http(previews_daemon.socket) as s:
        body = {"prompt": "x", "num_inference_steps": 4, "size": "64x64", "preview": {"every": 1}}
        async with s.post("/v1/images/generations", json=body) as r:
            out = await r.json()
            assert r.status == 200, out
        _, job = await get(s, f"/v1/jobs/{out['job_id']}")
        assert job["request"]["preview"] == {"every": 1, "format": "jpeg", "max_side": 256}
        async with s.get(f"/v1/jobs/{out['job_id']}/preview/0") as r:
            assert r.status == 200 and r.headers["Content-Type"] == "image/jpeg"
            assert _image(await r.read()).format == "JPEG"


async def test_a_model_without_a_preview_decoder_refuses_previews(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "synthetic:compute_ms=5")
    async with http(d.socket) as s:
        async with s.post("/v1/jobs", json={"prompt": "x", "preview": {"every": 1}}) as r:
            err = await r.json()
        assert r.status == 400 and err["error"]["field"] == "preview"
        assert "cannot show previews" in err["error"]["message"]


def test_the_preview_url_of_an_unknown_output_is_404(previews_daemon: Daemon) -> None:
    async def go() -> None:
        async with http(previews_daemon.socket) as s:
            job = await submit(s, _body(preview={"every": 1}))
            await wait_job(s, job["id"])
            for k, code in (("1", "output_not_found"), ("-1", "output_not_found"), ("x", "output_not_found")):
                status, err = await get(s, f"/v1/jobs/{job['id']}/preview/{k}")
                assert status == 404 and err["error"]["code"] == code
            status, err = await get(s, "/v1/jobs/j_nope/preview/0")
            assert status == 404 and err["error"]["code"] == "job_not_found"

    asyncio.run(go())


async def test_an_edit_shows_previews_too(previews_daemon: Daemon) -> None:
    """Image-to-image on tiny (an input image on /v1/jobs) denoises like any job: previews come."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 80, 40)).save(buf, format="PNG")
    async with http(previews_daemon.socket) as s:
        job = await submit(s, {"prompt": "a red square", "steps": 8, "strength": 1.0, "seed": 2,
                               "image": base64.b64encode(buf.getvalue()).decode(), "preview": {"every": 2}})
        events = await sse(s, job["id"])
        assert events[-1][0] == "done", events[-1]
        previews = [d for n, d in events if n == "preview"]
        assert previews and all(_image(base64.b64decode(p["image"])).size == (64, 64) for p in previews)
