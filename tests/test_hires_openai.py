"""The hires pass's step count on a flow model, and the fields ``/v1/jobs`` takes beside the prompt
(``control``, ``ip_adapter``, ``upscale``, ``hires``) on OpenAI's endpoints, where the official client
sends them as ``extra_body``: one daemon serving ``tiny`` (with a ControlNet, an IP-Adapter and an
ESRGAN upscaler built in code) and ``tiny-flux``, whose image-to-image pipeline rounds its steps the
flow way (``ipc/upscale.img2img_steps``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from controlkit import png
from daemonkit import Daemon, http, shared_daemon, sse, submit, wait_job

FLUX = {"model": "flux", "width": 64, "height": 64, "steps": 4, "prompt": "a lighthouse at dusk", "seed": 7}


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, controlnet_dir: Path, ip_adapter_file: Path,
         upscaler_file: Path) -> Iterator[Path]:
    args = ["--model", "tiny", "--model", "flux=tiny-flux", "--workers", "1", "--job-timeout", "300",
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
