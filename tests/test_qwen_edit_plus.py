"""Qwen-Image-Edit Plus (2509/2511) served by a real daemon (issue 30): the tiny QwenImageEditPlusPipeline of
tests/qwenkit.py, saved as a release's folder and loaded through the daemon's own folder loader, edits from the
several pictures a job's ``images`` sends; beside it the single-picture Qwen-Image-Edit, which refuses them.
"""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon
from PIL import Image
from qwenkit import build_qwen_edit
from test_edits import blocky, decode, openai_edit, png_bytes, post_pictures
from test_image_tasks import job, output_bytes
from test_qwen_edit import edited

W, H = 64, 96  # the pictures' size, taller than wide
W2, H2 = 96, 64  # another picture's, wider than tall


@pytest.fixture(scope="module")
def plus_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("qwen-plus-folders")
    plus, one = build_qwen_edit(root / "plus", plus=True), build_qwen_edit(root / "one")
    args = ["--model", f"qwen-plus={plus}", "--model", f"qwen-edit={one}", "--workers", "1", "--job-timeout", "120"]
    with shared_daemon(tmp_path_factory.mktemp("qwen-plus"), args, model_cache) as d:
        yield d


def picture(seed: int, w: int = W, h: int = H) -> str:
    return base64.b64encode(png_bytes(blocky(seed, max(w, h))[:h, :w])).decode()


BASE: dict[str, Any] = {"model": "qwen-plus", "prompt": "put the cat of Picture 1 on the sofa of Picture 2",
                        "steps": 2, "seed": 3, "guidance_scale": 4.0, "output_format": "npy"}


async def test_the_plus_model_is_listed_with_how_many_pictures_an_edit_takes(plus_daemon: Daemon) -> None:
    async with http(plus_daemon.socket) as s, s.get("/v1/models") as r:
        listed = {m["id"]: m for m in (await r.json())["data"]}
    assert (listed["qwen-plus"]["task"], listed["qwen-plus"]["max_input_images"]) == ("instruction-edit", 3)
    assert listed["qwen-edit"]["max_input_images"] == 1


async def test_an_edit_from_two_pictures_takes_the_last_ones_size_and_their_order_matters(
        plus_daemon: Daemon) -> None:
    async with http(plus_daemon.socket) as s:
        first = await edited(s, {**BASE, "images": [picture(1), picture(2)]})
        swapped = await edited(s, {**BASE, "images": [picture(2), picture(1)]})
        # the size is the last picture's (as the pipeline's own rule), whatever the first one's
        wide = await edited(s, {**BASE, "images": [{"image": picture(1)}, picture(5, W2, H2)]})
    assert first.shape[:2] == swapped.shape[:2] == (H, W), first.shape
    assert not np.array_equal(first, swapped)
    assert wide.shape[:2] == (H2, W2), wide.shape


async def test_the_plus_model_edits_from_image_alone_and_refuses_what_it_cannot_take(plus_daemon: Daemon) -> None:
    async with http(plus_daemon.socket) as s:
        one = await edited(s, {**BASE, "prompt": "make it red", "image": picture(1)})
        refusals = {
            "images": await job(s, {**BASE, "model": "qwen-edit", "images": [picture(1), picture(2)]}),
            "too many": await job(s, {**BASE, "images": [picture(k) for k in range(4)]}),
            "both": await job(s, {**BASE, "image": picture(1), "images": [picture(2)]}),
            "empty": await job(s, {**BASE, "images": []}),
            "unreadable": await job(s, {**BASE, "images": [picture(1), base64.b64encode(b"not a png").decode()]}),
            # a side the pipeline's working area would round to 0: it failed the whole batch
            "a sliver": await job(s, {**BASE, "images": [picture(1, 808, 8), picture(2)]}),
        }
    assert one.shape[:2] == (H, W)
    statuses = {k: (status, body["error"]["field"]) for k, (status, body) in refusals.items()}
    assert statuses == {"images": (400, "images"), "too many": (400, "images"), "both": (400, "image"),
                        "empty": (400, "images"), "unreadable": (400, "images[1]"), "a sliver": (400, "images[0]")}, \
        refusals
    assert "808x8: its long side is over 100 times its short side" in refusals["a sliver"][1]["error"]["message"]
    assert "takes one input image; send it as image" in refusals["images"][1]["error"]["message"]


async def test_the_openai_clients_several_images_are_one_edits_pictures_as_images_on_jobs(plus_daemon: Daemon) -> None:
    """``images.edit(image=[a, b])`` is one two-picture edit, as OpenAI reads an image list: one output, the pixels
    of the same ``images`` on /v1/jobs. It was two unrelated one-picture edits, and 4 files on a model that takes
    3 were 4 jobs."""
    import openai

    pics = [base64.b64decode(picture(1)), base64.b64decode(picture(2, W2, H2))]
    steps = {"num_inference_steps": 2, "seed": 3, "guidance_scale": 4.0}
    result = await asyncio.to_thread(openai_edit, plus_daemon.socket, pics, model="qwen-plus", **steps)
    assert len(result.data) == 1
    async with http(plus_daemon.socket) as s:
        same = await output_bytes(s, {**BASE, "prompt": "a red barn", "width": 64, "height": 64, "output_format": "png",
                                      "images": [picture(1), picture(2, W2, H2)]})
        form = {"prompt": "x", "model": "qwen-plus", "num_inference_steps": "2"}
        refusals = {"four": await post_pictures(s, form, [pics[0]] * 4),
                    "bad second": await post_pictures(s, form, [pics[0], b"not a png"])}
    assert np.array_equal(decode(result.data[0].b64_json), np.asarray(Image.open(io.BytesIO(same)).convert("RGB")))
    with pytest.raises(openai.BadRequestError, match="a mask does not apply"):
        await asyncio.to_thread(openai_edit, plus_daemon.socket, pics, pics[0], model="qwen-plus", **steps)
    fields = {k: (status, body["error"]["field"]) for k, (status, body) in refusals.items()}
    assert fields == {"four": (400, "image[]"), "bad second": (400, "image[1]")}, refusals
    assert "takes at most 3 input images" in refusals["four"][1]["error"]["message"]


async def test_the_plus_models_refusals_name_images_where_the_mistake_is(plus_daemon: Daemon) -> None:
    """No picture at all: the message names ``images`` beside ``image``; an unknown key inside an entry is a 400
    on ``images[0]``, not ``images``."""
    async with http(plus_daemon.socket) as s:
        none = await job(s, {**BASE})
        extra = await job(s, {**BASE, "images": [{"image": picture(1), "extra": 1}]})
    assert (none[0], none[1]["error"]["field"]) == (400, "image"), none
    assert "up to 3 pictures for one edit (images on /v1/jobs" in none[1]["error"]["message"], none
    assert (extra[0], extra[1]["error"]["field"]) == (400, "images[0]"), extra


def test_the_cli_sends_repeated_image_flags_and_the_client_images_as_one_edit(plus_daemon: Daemon,
                                                                              tmp_path: Path) -> None:
    """``--image`` twice is one edit from two pictures (not two edits), as the client's ``images=``: the same
    request, so the same pixels."""
    from PIL import Image

    from diffusiond import Client

    for k in (1, 2):
        (tmp_path / f"{k}.png").write_bytes(base64.b64decode(picture(k)))
    out = tmp_path / "out.png"
    r = subprocess.run([sys.executable, "-m", "diffusiond", "generate", BASE["prompt"], "--socket",
                        str(plus_daemon.socket), "--model", "qwen-plus", "--image", str(tmp_path / "1.png"), "--image",
                        str(tmp_path / "2.png"), "--steps", "2", "--seed", "3", "--guidance", "4", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with Client(str(plus_daemon.socket)) as c:
        (array,) = c.generate(BASE["prompt"], model="qwen-plus", images=[tmp_path / "1.png", picture(2)], steps=2,
                              seed=3, guidance_scale=4.0, output="array")
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), array)


def test_a_batch_edited_one_call_a_request_reports_its_steps_in_one_rising_count() -> None:
    """Each request's call ran steps 1..N again, so a batch's progress went N of N, then 1 of N."""
    import numpy as np
    import torch

    from diffusiond.ipc.messages import RequestSpec
    from diffusiond.pipelines.qwen_edit_plus import one_by_one

    seen: list[tuple[int, int]] = []

    def call(reqs: Any, shown: Any, sink: Any, step: Any) -> list[torch.Tensor]:
        for k in range(1, 4):
            step(k, 3)
        return [torch.zeros(1)]

    requests = [RequestSpec(request_id=f"r{i}", prompt="x", seed=i) for i in range(2)]
    inputs = [(np.zeros((8, 8, 3), np.uint8), None)] * 2
    one_by_one(call, object(), requests, inputs, [], None, lambda s, t: seen.append((s, t)) or True)
    assert seen == [(k, 6) for k in range(1, 7)]
