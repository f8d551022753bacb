"""The hires pass's step count on a flow model, and the fields ``/v1/jobs`` takes beside the prompt
(``control``, ``ip_adapter``, ``upscale``, ``hires``) on OpenAI's endpoints, where the official client
sends them as ``extra_body``: one daemon serving ``tiny`` (with a ControlNet, an IP-Adapter and an
ESRGAN upscaler built in code), ``tiny-flux``, whose image-to-image pipeline rounds its steps the
flow way (``ipc/upscale.img2img_steps``), and ``tiny-video``, whose edit through ``images.edit`` is a video.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controlkit import png
from daemonkit import Daemon, get, http, shared_daemon, sse, submit, wait_job

FLUX = {"model": "flux", "width": 64, "height": 64, "steps": 4, "prompt": "a lighthouse at dusk", "seed": 7}


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, controlnet_dir: Path, ip_adapter_file: Path,
         upscaler_file: Path) -> Iterator[Path]:
    args = ["--model", "tiny", "--model", "flux=tiny-flux", "--model", "tiny-video", "--workers", "1",
            "--job-timeout", "300",
            "--controlnet", f"edges={controlnet_dir}", "--ip-adapter", f"style={ip_adapter_file}",
            "--upscaler", f"esr={upscaler_file}"]
    d: Daemon
    with shared_daemon(tmp_path_factory.mktemp("hires-openai"), args, model_cache) as d:
        yield d.socket


async def progress(sock: Path, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The job as accepted, its progress events, and the job when done."""
    async with http(sock) as s:
        job = await submit(s, body)
        events = await sse(s, job["id"])
        done = await wait_job(s, job["id"])
    assert done["status"] == "succeeded", done
    return job, [e for name, e in events if name == "progress"], done


@pytest.mark.parametrize(("strength", "steps", "schedule"), [(0.3, 1, 3), (0.45, 2, 4)])
async def test_a_flux_hires_pass_runs_the_steps_asked_and_says_so_from_the_first_event(
        sock: Path, strength: float, steps: int, schedule: int) -> None:
    """FluxImg2ImgPipeline runs ``schedule - int(schedule - schedule x strength)`` steps; SD's rule
    (``int(schedule x strength)``) asked it for 4 and 5, which ran 2 and 3: ``step 1/5``, then ``5/6``."""
    hires = {"scale": 2, "strength": strength, "steps": steps}
    job, events, done = await progress(sock, {**FLUX, "hires": hires})
    total = FLUX["steps"] + steps
    assert job["progress"]["total"] == total
    assert events and {e["total"] for e in events} == {total}, events
    assert done["progress"] == {"step": total, "total": total}
    assert done["request"]["hires"] == {"width": 128, "height": 128, "strength": strength, "steps": steps,
                                        "schedule": schedule, "upscaler": None}


async def test_a_flux_edit_runs_the_steps_docs_api_md_says_it_rounds_to(sock: Path) -> None:
    """An edit's steps on a flow model: ``steps - int(steps - steps x strength)`` (4 at 0.3: 2, where
    SD's pipelines run ``int(1.2)``, 1)."""
    _, events, done = await progress(sock, {**FLUX, "image": png(5, 64), "strength": 0.3})
    assert events and {e["total"] for e in events} == {2}, events
    assert done["progress"] == {"step": 2, "total": 2}


TINY = {"model": "tiny", "prompt": "a lighthouse at dusk", "seed": 7}
STEERED = {"control": [{"name": "edges", "image": png(1)}], "ip_adapter": [{"name": "style", "image": png(2)}],
           "hires": {"scale": 2, "strength": 0.5, "steps": 1}, "upscale": {"name": "esr"}}


def openai_client(sock: Path) -> Any:
    """The official client over the daemon's socket (it sends ``extra_body`` as JSON, or flattens it in a form)."""
    import httpx
    import openai

    hc = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=300)
    return openai.OpenAI(base_url="http://diffusiond/v1", api_key="unused", http_client=hc)


def side(png_bytes: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(png_bytes)) as im:
        return im.size


async def test_generations_take_control_ip_adapter_hires_and_upscale_as_jobs_does(sock: Path) -> None:
    """The openai client's ``images.generate`` with /v1/jobs' fields in ``extra_body``: the job /v1/jobs
    makes of the same request, pixel for pixel, recorded the same way (64 -> hires 128 -> esr 256)."""
    got = await asyncio.to_thread(lambda: openai_client(sock).images.generate(
        model="tiny", prompt=TINY["prompt"], size="64x64", response_format="b64_json",
        extra_body={"seed": 7, "num_inference_steps": 2, **STEERED}))
    assert got.data is not None and got.data[0].b64_json is not None
    picture = base64.b64decode(got.data[0].b64_json)
    async with http(sock) as s:
        job = await wait_job(s, (await submit(s, {**TINY, "width": 64, "height": 64, "steps": 2, **STEERED}))["id"])
        async with s.get(job["outputs"][0]["url"]) as r:
            assert r.status == 200
            from_jobs = await r.read()
        status, generated = await get(s, f"/v1/jobs/{got.model_extra['job_id']}")  # type: ignore[index]
    assert status == 200 and side(picture) == (256, 256)
    assert picture == from_jobs
    recorded = ("control", "ip_adapter", "hires", "upscale")
    assert {k: generated["request"][k] for k in recorded} == {k: job["request"][k] for k in recorded}
    assert generated["request"]["control"] and generated["request"]["ip_adapter"]


async def form_edit(s: aiohttp.ClientSession, **fields: str | None) -> tuple[int, dict[str, Any]]:
    """A multipart edit of a picture by tiny; a field given as None is left out."""
    form = aiohttp.FormData()
    for k, v in {"model": "tiny", "prompt": TINY["prompt"], "size": "64x64", "seed": "7",
                 "num_inference_steps": "2", "strength": "0.5", **fields}.items():
        if v is not None:
            form.add_field(k, v)
    form.add_field("image", base64.b64decode(png(3)), filename="in.png", content_type="image/png")
    async with s.post("/v1/images/edits", data=form) as r:
        return r.status, await r.json()


async def test_edits_take_upscale_flattened_or_as_json_and_refuse_hires_saying_why(sock: Path) -> None:
    got = await asyncio.to_thread(lambda: openai_client(sock).images.edit(
        model="tiny", image=("in.png", base64.b64decode(png(3)), "image/png"), prompt=TINY["prompt"],
        size="64x64", response_format="b64_json",
        extra_body={"seed": 7, "num_inference_steps": 2, "strength": 0.5, "upscale": {"name": "esr"}}))
    assert got.data is not None and got.data[0].b64_json is not None
    async with http(sock) as s:
        status, as_json = await form_edit(s, upscale='{"name": "esr", "scale": 3}')
        hires_status, hires = await form_edit(s, hires='{"scale": 2}')
        twice_status, twice = await form_edit(s, **{"upscale": '{"name": "esr"}', "upscale[scale]": "2"})
        bad_status, bad = await form_edit(s, upscale="esr")
    assert side(base64.b64decode(got.data[0].b64_json)) == (128, 128)
    assert status == 200 and side(base64.b64decode(as_json["data"][0]["b64_json"])) == (192, 192)
    assert (hires_status, hires["error"]["field"]) == (400, "hires") and "keeps its image's size" in \
        hires["error"]["message"]
    assert (twice_status, twice["error"]["field"]) == (400, "upscale") and "given twice" in twice["error"]["message"]
    assert (bad_status, bad["error"]["field"]) == (400, "upscale") and "upscale[name]" in bad["error"]["message"]


async def test_images_edit_on_a_video_model_answers_an_mp4_without_being_asked_for_one(sock: Path) -> None:
    """The openai client sends no output_format unless told: the edit of a text-to-video model that animates
    images is image-to-video, and its default format is the task's (mp4), not png (a 400 on a field the
    user never sent)."""
    got = await asyncio.to_thread(lambda: openai_client(sock).images.edit(
        model="tiny-video", image=("in.png", base64.b64decode(png(3)), "image/png"), prompt="a boat",
        size="64x64", response_format="b64_json", extra_body={"seed": 5, "num_inference_steps": 2}))
    assert got.data is not None and got.data[0].b64_json is not None
    assert base64.b64decode(got.data[0].b64_json)[4:8] == b"ftyp"  # an MP4 (ISO BMFF) file
    async with http(sock) as s:
        status, still = await form_edit(s, model="tiny-video", output_format="png", strength=None)
    assert (status, still["error"]["field"]) == (400, "output_format") and "mp4" in still["error"]["message"]


async def test_one_step_where_the_model_takes_two_is_the_same_400_on_the_openai_endpoints(sock: Path) -> None:
    """tiny-video's scheduler stretches its last step (min_steps 2); the OpenAI field is named."""
    async with http(sock) as s:
        async with s.post("/v1/images/generations", json={"model": "tiny-video", "prompt": "a boat", "size": "64x64",
                                                          "num_inference_steps": 1}) as r:
            generated = (r.status, await r.json())
        edited = await form_edit(s, model="tiny-video", num_inference_steps="1", strength=None)
    for status, body in (generated, edited):
        assert (status, body["error"]["field"]) == (400, "num_inference_steps"), body
        assert "model 'tiny-video' takes at least 2 steps" in body["error"]["message"], body
        assert "send num_inference_steps >= 2" in body["error"]["message"], body


def test_a_hires_pass_shorter_than_the_model_takes_is_refused_naming_hires_steps() -> None:
    """The hires schedule (steps / strength) is checked against min_steps as the steps are; no
    served model here has both an image-to-image pipeline and two steps as its fewest (Qwen-Image does), so the
    check runs on its own."""
    from diffusiond.daemon.config import DaemonConfig
    from diffusiond.daemon.core.jobs import JobRequest
    from diffusiond.daemon.edge.upscale import HiresBody, _hires
    from diffusiond.daemon.errors import InvalidRequest
    from diffusiond.ipc.messages import Capabilities

    engine: Any = type("E", (), {"config": DaemonConfig()})()
    model: Any = type("M", (), {"name": "qwen", "capabilities": Capabilities(edits=("image-to-image",), min_steps=2,
                                                                             flow_scheduler=True)})()
    req = JobRequest(model="qwen", prompt="a boat", n=1, width=64, height=64, steps=4, guidance=4.0,
                     output_format="png", seed=1)
    with pytest.raises(InvalidRequest) as refused:
        _hires(engine, HiresBody(steps=1, strength=1.0), model, req)
    assert refused.value.field == "hires.steps" and "it takes at least 2" in refused.value.message
    assert "raise hires.steps or lower hires.strength" in refused.value.message  # either makes the schedule longer
    assert _hires(engine, HiresBody(steps=1, strength=0.5), model, req).schedule == 2
    assert _hires(engine, HiresBody(steps=2, strength=1.0), model, req).schedule == 2
