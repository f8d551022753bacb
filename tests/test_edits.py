"""Image-to-image and inpainting, end to end: a real daemon on ``tiny`` (real workers, the real
socket), through the official ``openai`` client's ``images.edit`` and through ``/v1/jobs``.

``tiny``'s VAE passes images through (``pipelines/tiny.py``, ``passthrough_vae``), so what these
tests measure is what the edit did to the input, not what a random VAE did to it. The input
images are made of 2x2 blocks, which the VAE's 2x latent keeps exactly.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, fds_named, http, idle, shared_daemon, until, wait_job
from PIL import Image

SIZE = 64
STRENGTH_NEAR_0 = 0.02
STEPS_NEAR_0 = 50  # 0.02 x 50 = one denoising step, at the least noise the schedule has
CLOSE = 20.0
"""Strength near 0: the mean absolute difference from the input stays under this (of 255). Measured
13.9 on tiny (one Euler step at sigma ~0.1 with a random UNet); strength 1 gives ~123."""
FAR = 60.0
"""Strength 1 repaints: the mean difference is over this (measured ~123), so the bound above can fail."""
MASKED_OUT = 1.0
"""Inpainting: outside the mask, the mean difference from the input stays under this (measured 0.002)."""


@pytest.fixture(scope="module")
def edits_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("edits")
    inputs = tmp / "inputs"
    inputs.mkdir()
    (inputs / "in.png").write_bytes(png_bytes(blocky(7)))
    (tmp / "outside.png").write_bytes(png_bytes(blocky(8)))
    (inputs / "link.png").symlink_to(tmp / "outside.png")  # inside by name, outside in fact
    config = tmp / "d.toml"
    config.write_text("[limits]\nmax_upload_bytes = 200000\nmax_input_pixels = 300000\n")
    args = ["--config", str(config), "--model", "tiny", "--model", "plain=synthetic:compute_ms=5",
            "--model", "tiny-inpaint",
            "--workers", "1", "--max-batch", "4", "--batch-wait-ms", "400", "--job-timeout", "120",
            "--input-dir", str(inputs)]
    with shared_daemon(tmp, args, model_cache) as d:
        yield d


@pytest.fixture(scope="module")
def sock(edits_daemon: Daemon) -> Path:
    return edits_daemon.socket


def blocky(seed: int, size: int = SIZE) -> np.ndarray:
    """A random RGB image of 2x2 blocks (uint8, H x W x 3)."""
    small = np.random.default_rng(seed).integers(0, 256, (size // 2, size // 2, 3), dtype=np.uint8)
    return small.repeat(2, 0).repeat(2, 1)


def png_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def square_mask(size: int = SIZE) -> tuple[bytes, np.ndarray]:
    """An OpenAI-style mask (transparent = repaint) with a transparent centre square, and the
    boolean map of the repainted pixels."""
    rgba = np.full((size, size, 4), 255, dtype=np.uint8)
    repaint = np.zeros((size, size), dtype=bool)
    repaint[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = True
    rgba[repaint, 3] = 0
    return png_bytes(rgba), repaint


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(np.float64)


def openai_edit(sock: Path, image: bytes | list[bytes], mask: bytes | None = None, model: str = "tiny",
                **extra: Any) -> Any:
    """``client.images.edit`` of the official client, unmodified, over the Unix socket."""
    import httpx
    import openai

    transport = httpx.HTTPTransport(uds=str(sock))
    with httpx.Client(transport=transport, timeout=120) as hc:
        client = openai.OpenAI(base_url="http://diffusiond/v1", api_key="unused", http_client=hc)
        one = ("in.png", image, "image/png")
        files = [("in.png", b, "image/png") for b in image] if isinstance(image, list) else one
        kwargs: dict[str, Any] = {"mask": ("mask.png", mask, "image/png")} if mask is not None else {}
        return client.images.edit(model=model, image=files, prompt="a red barn", n=1, size=f"{SIZE}x{SIZE}",
                                  response_format="b64_json", extra_body=extra, **kwargs)


async def post_form(s: aiohttp.ClientSession, fields: dict[str, str], files: dict[str, bytes]) -> tuple[int, Any]:
    form = aiohttp.FormData(default_to_multipart=True)
    for k, v in fields.items():
        form.add_field(k, v)
    for k, b in files.items():
        form.add_field(k, b, filename=f"{k}.png", content_type="image/png")
    async with s.post("/v1/images/edits", data=form) as r:
        return r.status, await r.json()


async def post_job(s: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with s.post("/v1/jobs", json=body) as r:
        return r.status, await r.json()


async def output(s: aiohttp.ClientSession, job: dict[str, Any], k: int = 0) -> np.ndarray:
    async with s.get(job["outputs"][k]["url"]) as r:
        assert r.status == 200
        return np.asarray(Image.open(io.BytesIO(await r.read())).convert("RGB")).astype(np.float64)


# the openai client ------------------------------------------------------------------------------
async def test_openai_edit_at_strength_near_0_keeps_the_input_and_at_1_repaints_it(sock: Path) -> None:
    src = blocky(1)
    near = await asyncio.to_thread(openai_edit, sock, png_bytes(src), strength=STRENGTH_NEAR_0,
                                   num_inference_steps=STEPS_NEAR_0, seed=3)
    full = await asyncio.to_thread(openai_edit, sock, png_bytes(src), strength=1.0, num_inference_steps=4, seed=3)
    near_px, full_px = decode(near.data[0].b64_json), decode(full.data[0].b64_json)
    assert near_px.shape == full_px.shape == (SIZE, SIZE, 3)
    near_diff = float(np.abs(near_px - src).mean())
    full_diff = float(np.abs(full_px - src).mean())
    assert near_diff < CLOSE, f"strength {STRENGTH_NEAR_0}: mean difference {near_diff:.1f} of 255"
    assert full_diff > FAR, f"strength 1: mean difference {full_diff:.1f} of 255"


async def test_openai_inpaint_repaints_the_transparent_area_and_keeps_the_rest(sock: Path) -> None:
    src = blocky(2)
    mask, repaint = square_mask()
    result = await asyncio.to_thread(openai_edit, sock, png_bytes(src), mask, num_inference_steps=4, seed=5)
    diff = np.abs(decode(result.data[0].b64_json) - src).mean(axis=2)
    assert float(diff[~repaint].mean()) < MASKED_OUT, f"kept area changed by {diff[~repaint].mean():.2f}"
    assert float(diff[repaint].mean()) > FAR, f"repainted area changed by only {diff[repaint].mean():.2f}"


async def test_several_images_on_a_one_picture_model_are_refused_before_any_job_exists(sock: Path) -> None:
    """Several image[] are one edit's pictures, as OpenAI reads them; tiny takes one, so the form is a 400 naming
    image[], through the official client too. It used to run one job per file, and a form refused partway (300
    files: queue_full) left the jobs it had admitted in history as "cancelled by the client"."""
    a, b = png_bytes(blocky(3)), png_bytes(blocky(4))
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(openai_edit, sock, [a, b], strength=0.5, num_inference_steps=4)
    assert "takes one input image" in str(refused.value) and "image[]" in str(refused.value), refused.value
    async with http(sock) as s:
        before = await history_ids(s)
        for count in (2, 40):
            status, body = await post_pictures(s, {"prompt": "x", "model": "tiny", "size": f"{SIZE}x{SIZE}"},
                                               [a] * count)
            assert (status, body["error"]["field"]) == (400, "image[]"), body
            assert f"sends {count} images" in body["error"]["message"], body
        assert await history_ids(s) == before, "a refused form admitted jobs"


async def history_ids(s: aiohttp.ClientSession) -> list[str]:
    async with s.get("/v1/jobs", params={"limit": "1000"}) as r:
        return [j["id"] for j in (await r.json())["data"]]


async def post_pictures(s: aiohttp.ClientSession, fields: dict[str, str], pictures: list[bytes],
                        name: str = "image[]") -> tuple[int, Any]:
    """A form with each picture as its own ``name`` file, as the openai client sends a list."""
    form = aiohttp.FormData(default_to_multipart=True)
    for k, v in fields.items():
        form.add_field(k, v)
    for i, data in enumerate(pictures):
        form.add_field(name, data, filename=f"{i}.png", content_type="image/png")
    async with s.post("/v1/images/edits", data=form) as r:
        return r.status, await r.json()


async def test_an_edit_sent_no_size_takes_its_pictures_only_up_to_four_times_the_models_pixels(sock: Path) -> None:
    """tiny makes 128x128: a 264x264 picture sent without a size is refused naming it, with a size to send, since
    an edit at a huge inherited size held the worker past any deadline; with a size it runs, resized;
    a picture of 256x256, 4 times tiny's pixels, still runs at its own size."""
    big = png_bytes(np.zeros((264, 264, 3), dtype=np.uint8))
    b64 = base64.b64encode(big).decode()
    async with http(sock) as s:
        before = await history_ids(s)
        status, body = await post_form(s, {"prompt": "x", "model": "tiny", "num_inference_steps": "2"},
                                       {"image": big})
        assert (status, body["error"]["field"]) == (400, "image"), body
        assert "264x264" in body["error"]["message"] and "Send size (e.g. 128x128" in body["error"]["message"], body
        status, body = await post_job(s, {"prompt": "x", "model": "tiny", "steps": 2, "image": b64})
        assert (status, body["error"]["field"]) == (400, "image"), body
        status, body = await post_job(s, {"prompt": "x", "model": "tiny", "steps": 2, "image": b64, "width": 256})
        assert (status, body["error"]["field"]) == (400, "image"), "256 x the picture's 264 is over the bound too"
        assert await history_ids(s) == before
        status, body = await post_form(s, {"prompt": "x", "model": "tiny", "num_inference_steps": "2",
                                           "size": "128x128"}, {"image": big})
        assert status == 200 and decode(body["data"][0]["b64_json"]).shape == (128, 128, 3), body
        edge = base64.b64encode(png_bytes(np.zeros((256, 256, 3), dtype=np.uint8))).decode()
        status, job = await post_job(s, {"prompt": "x", "model": "tiny", "steps": 2, "image": edge})
        assert status == 202 and (job["request"]["width"], job["request"]["height"]) == (256, 256), job
        assert (await wait_job(s, job["id"]))["status"] == "succeeded"


# the jobs API -----------------------------------------------------------------------------------
async def test_job_with_a_base64_image_and_mask_inpaints(sock: Path) -> None:
    src = blocky(5)
    mask, repaint = square_mask()
    async with http(sock) as s:
        status, job = await post_job(s, {
            "model": "tiny", "prompt": "a cat", "steps": 4, "seed": 2,
            "image": base64.b64encode(png_bytes(src)).decode(), "mask": base64.b64encode(mask).decode()})
        assert status == 202, job
        assert job["request"]["task"] == "inpainting" and job["request"]["strength"] == 1.0
        assert (job["request"]["width"], job["request"]["height"]) == (SIZE, SIZE)  # the image's own size
        done = await wait_job(s, job["id"])
        assert done["status"] == "succeeded", done
        diff = np.abs(await output(s, done) - src).mean(axis=2)
    assert float(diff[~repaint].mean()) < MASKED_OUT and float(diff[repaint].mean()) > FAR


async def test_job_reads_an_image_path_only_inside_the_input_dir(sock: Path) -> None:
    async with http(sock) as s:
        status, job = await post_job(s, {"prompt": "x", "image_path": "in.png", "strength": STRENGTH_NEAR_0,
                                         "steps": STEPS_NEAR_0})
        assert status == 202, job
        done = await wait_job(s, job["id"])
        assert float(np.abs(await output(s, done) - blocky(7)).mean()) < CLOSE
        for path in ("../outside.png", str(sock.parent / "outside.png"), "link.png", "missing.png", "."):
            status, body = await post_job(s, {"prompt": "x", "image_path": path})
            assert status == 400 and body["error"]["field"] == "image_path", (path, body)


async def test_edits_of_the_same_size_and_strength_share_a_batch_and_others_do_not(sock: Path) -> None:
    image = base64.b64encode(png_bytes(blocky(6))).decode()
    small = base64.b64encode(png_bytes(blocky(6, 32 * 2 + 8))).decode()  # 72x72: another size

    def body(**kw: Any) -> dict[str, Any]:
        return {"prompt": "x", "steps": 4, "strength": 0.5, "image": image, **kw}

    async with http(sock) as s:
        posted = await asyncio.gather(*(post_job(s, b) for b in (
            body(seed=1), body(seed=2), body(seed=3, image=small), body(seed=4, strength=0.75), body(seed=5))))
        assert all(status == 202 for status, _ in posted), posted
        done = [await wait_job(s, job["id"]) for _, job in posted]
    assert all(d["status"] == "succeeded" for d in done), done
    batch = [d["outputs"][0]["batch"] for d in done]
    assert batch[0] == batch[1] == batch[4], batch  # same size and strength: one forward
    assert batch[2] not in (batch[0], batch[3]) and batch[3] != batch[0], batch


# refusals ---------------------------------------------------------------------------------------
async def test_bad_edits_are_refused_naming_the_field(sock: Path) -> None:
    good = png_bytes(blocky(1))
    mask, _ = square_mask()
    other_mask, _ = square_mask(SIZE + 8)
    huge = png_bytes(np.zeros((600, 600, 3), dtype=np.uint8))  # 360000 pixels, compresses to a few KB
    fields = {"prompt": "x", "model": "tiny"}
    cases: list[tuple[dict[str, str], dict[str, bytes], int, str]] = [
        (fields, {"image": b"not an image at all"}, 400, "image"),
        (fields, {"image": huge}, 400, "image"),
        (fields, {"image": good, "mask": other_mask}, 400, "mask"),
        (fields, {"image": good, "mask": b"GIF89a broken"}, 400, "mask"),
        ({**fields, "strength": "0"}, {"image": good}, 400, "strength"),
        ({**fields, "strength": "1.5"}, {"image": good}, 400, "strength"),
        ({**fields, "strength": "-0.1"}, {"image": good}, 400, "strength"),
        ({**fields, "strength": "0.1", "num_inference_steps": "4"}, {"image": good}, 400, "strength"),
        ({**fields, "size": "99999x99999"}, {"image": good}, 400, "size"),
        ({**fields, "n": "many"}, {"image": good}, 400, "n"),
        (fields, {}, 400, "image"),
        (fields, {"image": good, "mask": mask, "other": good}, 400, "other"),
    ]
    async with http(sock) as s:
        for form, files, want, field in cases:
            status, body = await post_form(s, form, files)
            assert status == want and body["error"]["field"] == field, (form, list(files), body)
            assert body["error"]["message"], body
        status, body = await post_form(s, fields, {"image": good + b"\0" * 200_001})
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        async with s.post("/v1/images/edits", data=b"--x\r\nnot a multipart body",
                          headers={"Content-Type": "multipart/form-data; boundary=x"}) as r:
            body = await r.json()
            assert r.status == 400 and "multipart" in body["error"]["message"], body
        async with s.post("/v1/images/edits", json={"prompt": "x"}) as r:
            assert r.status == 400 and "multipart" in (await r.json())["error"]["message"]
        # the jobs API: the same checks, and its own fields
        b64 = base64.b64encode(good).decode()
        for body_in, field in (
            ({"prompt": "x", "image": "%%% not base64"}, "image"),
            ({"prompt": "x", "mask": b64}, "mask"),
            ({"prompt": "x", "strength": 0.5}, "strength"),
            ({"prompt": "x", "image": b64, "image_path": "in.png"}, "image"),
            ({"prompt": "x", "image": b64, "num_frames": 9}, "num_frames"),
            ({"prompt": "x", "image": b64, "strength": 2}, "strength"),
        ):
            status, body = await post_job(s, body_in)
            assert status == 400 and body["error"]["field"] == field, (body_in.keys(), body)
        status, body = await post_job(s, {"prompt": "x", "image": base64.b64encode(good + b"\0" * 200_001).decode()})
        assert status == 413, body


async def test_a_model_without_edits_answers_400_naming_model_and_task(sock: Path) -> None:
    async with http(sock) as s:
        async with s.get("/v1/models") as r:
            listed = {m["id"]: m for m in (await r.json())["data"]}
        assert listed["tiny"]["edits"] == ["image-to-image", "inpainting"] and listed["plain"]["edits"] == []
        status, body = await post_form(s, {"prompt": "x", "model": "plain"}, {"image": png_bytes(blocky(1))})
    assert status == 400 and body["error"]["field"] == "model", body
    assert "'plain'" in body["error"]["message"] and "image-to-image" in body["error"]["message"], body


async def test_the_dedicated_inpainting_model_inpaints_and_does_nothing_else(sock: Path) -> None:
    src = blocky(9)
    mask, repaint = square_mask()
    result = await asyncio.to_thread(openai_edit, sock, png_bytes(src), mask, model="tiny-inpaint",
                                     num_inference_steps=4, seed=5)
    diff = np.abs(decode(result.data[0].b64_json) - src).mean(axis=2)
    assert float(diff[~repaint].mean()) < MASKED_OUT and float(diff[repaint].mean()) > FAR
    async with http(sock) as s:
        status, body = await post_job(s, {"model": "tiny-inpaint", "prompt": "x"})
        assert status == 400 and body["error"]["field"] == "image" and "inpainting" in body["error"]["message"]
        status, body = await post_form(s, {"prompt": "x", "model": "tiny-inpaint"}, {"image": png_bytes(src)})
        # an inpainting model given an image alone is told what it lacks: the mask
        assert status == 400 and body["error"]["field"] == "mask" and "mask" in body["error"]["message"], body


# the CLI and the Python client ------------------------------------------------------------------
def test_cli_generate_with_image_and_mask_writes_the_inpainted_file(sock: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    src = blocky(10)
    mask, repaint = square_mask()
    (tmp_path / "in.png").write_bytes(png_bytes(src))
    (tmp_path / "m.png").write_bytes(mask)
    out = tmp_path / "out.png"
    r = subprocess.run(
        [sys.executable, "-m", "diffusiond", "generate", "a boat", "--socket", str(sock), "--image",
         str(tmp_path / "in.png"), "--mask", str(tmp_path / "m.png"), "--strength", "0.6", "--steps", "8",
         "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    diff = np.abs(np.asarray(Image.open(out).convert("RGB")).astype(np.float64) - src).mean(axis=2)
    assert float(diff[~repaint].mean()) < MASKED_OUT and float(diff[repaint].mean()) > 5
    r = subprocess.run([sys.executable, "-m", "diffusiond", "generate", "x", "--socket", str(sock), "--image",
                        str(tmp_path / "missing.png")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "missing.png" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "diffusiond", "generate", "x", "--socket", str(sock), "--image",
                        str(tmp_path / "in.png"), "--strength", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "strength" in r.stderr, r.stderr


def test_python_client_edits_from_a_file_or_bytes(sock: Path, tmp_path: Path) -> None:
    from diffusiond import Client

    src = blocky(11)
    (tmp_path / "in.png").write_bytes(png_bytes(src))
    with Client(str(sock)) as c:
        from_file = c.generate("x", image=tmp_path / "in.png", strength=STRENGTH_NEAR_0, steps=STEPS_NEAR_0, seed=4)
        from_bytes = c.generate("x", image=png_bytes(src), strength=STRENGTH_NEAR_0, steps=STEPS_NEAR_0, seed=4)
    a, b = (np.asarray(im.convert("RGB")).astype(np.float64) for im in (*from_file, *from_bytes))
    assert np.array_equal(a, b) and float(np.abs(a - src).mean()) < CLOSE


async def test_no_input_buffer_outlives_its_job(sock: Path, edits_daemon: Daemon) -> None:
    """Runs last: every edit above has ended (succeeded, or refused at admission), so neither the
    engine nor a worker may still hold an input memfd (``ipc.inputs``)."""
    async with http(sock) as s:
        await until(lambda: idle(s), 60, "the daemon to be idle")

    assert edits_daemon.proc is not None
    for pid in (edits_daemon.proc.pid, *edits_daemon.worker_pids()):
        assert fds_named(pid, "diffusiond-input") == [], pid


async def test_a_multipart_edit_takes_preview_as_the_openai_client_flattens_it_or_as_json(sock: Path) -> None:
    """The official client sends extra_body's objects in a form as preview[every]=2 and so on;
    curl users write JSON text. Either way the job asks for previews, as a JSON edit would."""
    image = png_bytes(blocky(3))
    common = {"num_inference_steps": 4, "strength": 0.9}

    async def newest_preview(s: aiohttp.ClientSession, prompt: str) -> Any:
        async with s.get("/v1/jobs", params={"limit": "20"}) as r:
            jobs = [j for j in (await r.json())["data"] if j["request"]["prompt"] == prompt]
        return jobs[0]["request"]["preview"]

    result = await asyncio.to_thread(openai_edit, sock, image, **common, preview={"every": 2, "max_side": 32})
    assert result.data[0].b64_json
    async with http(sock) as s:
        assert await newest_preview(s, "a red barn") == {"every": 2, "format": "jpeg", "max_side": 32}
        fields = {"prompt": "a blue barn", "model": "tiny", "size": f"{SIZE}x{SIZE}",
                  **{k: str(v) for k, v in common.items()}}
        status, body = await post_form(s, {**fields, "preview": '{"every": 3, "format": "png"}'}, {"image": image})
        assert status == 200, body
        assert await newest_preview(s, "a blue barn") == {"every": 3, "format": "png", "max_side": 256}
        for bad, field in (({"preview[every]": "0"}, "preview.every"), ({"preview": "{"}, "preview"),
                           ({"preview[colour]": "red"}, "preview")):
            status, body = await post_form(s, {**fields, **bad}, {"image": image})
            assert (status, body["error"]["field"]) == (400, field), (bad, body)
