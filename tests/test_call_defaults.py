"""A served folder's request defaults are its family's published ones, read off its pipeline class's
``__call__`` (pipelines/call_defaults.py), not a generic 25 steps at guidance 7.5: a FLUX.1-dev folder served
with guidance left out ran at 7.5 (overcooked pictures), Qwen-Image at true CFG 7.5 instead of 4.0.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonkit import Daemon, http, shared_daemon, submit, wait_job


@pytest.mark.parametrize(("name", "expected"), [
    ("StableDiffusionPipeline", {"steps": 50, "guidance": 7.5}),
    ("StableDiffusionXLPipeline", {"steps": 50, "guidance": 5.0}),
    ("FluxPipeline", {"steps": 28, "guidance": 3.5}),  # guidance_scale, not its true_cfg_scale of 1
    ("QwenImagePipeline", {"steps": 50, "guidance": 4.0}),  # true_cfg_scale: its guidance_scale is None
    ("LTXPipeline", {"steps": 50, "guidance": 3.0}),  # declared as the int 3
    ("HunyuanImagePipeline", {"steps": 50}),  # no guidance_scale: the generic guidance stays
])
def test_the_defaults_are_what_the_class_declares(name: str, expected: dict[str, Any]) -> None:
    import diffusers

    from diffusiond.pipelines.call_defaults import call_defaults

    assert call_defaults(getattr(diffusers, name)) == expected


def test_a_class_that_declares_nothing_usable_keeps_the_generic_defaults() -> None:
    from diffusiond.pipelines.call_defaults import call_defaults

    class Odd:
        def __call__(self, prompt: str, num_inference_steps: Any = None, guidance_scale: Any = True) -> None: ...

    class Odder:
        def __call__(self, num_inference_steps: float = 2.5, guidance_scale: float = float("nan")) -> None: ...

    class Plain:
        pass

    assert call_defaults(Odd) == call_defaults(Odder) == call_defaults(Plain) == {}


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    from diffusiond.pipelines.tiny_flux import ensure_tiny_flux

    # the embedded model's folder served as a user's FLUX folder: no tiny-flux table, only the class
    args = ["--model", f"flux={ensure_tiny_flux()}", "--workers", "1", "--job-timeout", "300"]
    with shared_daemon(tmp_path_factory.mktemp("call-defaults"), args, model_cache) as daemon:
        yield daemon


async def test_a_flux_folder_job_without_steps_or_guidance_runs_fluxs_28_at_3_5(d: Daemon) -> None:
    from PIL import Image

    async with http(d.socket) as s:
        body = {"model": "flux", "prompt": "a lighthouse at dusk", "width": 64, "height": 64, "seed": 7}
        job = await wait_job(s, (await submit(s, body))["id"], timeout=300)
        assert job["status"] == "succeeded", job
        assert (job["request"]["steps"], job["request"]["guidance_scale"]) == (28, 3.5), job["request"]
        assert job["progress"] == {"step": 28, "total": 28}, job
        async with s.get(job["outputs"][0]["url"]) as r:
            meta = Image.open(io.BytesIO(await r.read())).text
    assert (meta["steps"], meta["guidance_scale"]) == ("28", "3.5"), meta


async def test_the_models_list_shows_the_defaults_a_request_gets(d: Daemon) -> None:
    """A client sizing its form (the page, a trainer) reads them before sending: the class's 28 and 3.5 here."""
    async with http(d.socket) as s, s.get("/v1/models") as r:
        (model,) = [m for m in (await r.json())["data"] if m["id"] == "flux"]
    assert model["defaults"]["steps"] == 28 and model["defaults"]["guidance_scale"] == 3.5, model["defaults"]
    assert "num_frames" not in model["defaults"]  # an image model's defaults have no frames
