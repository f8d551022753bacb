"""The page's script in Node (tests/webjs_harness.js: a stand-in DOM and API), for machines without Chromium.

test_web_page.py drives the real page in a real browser against a real daemon and is the test of
record; it skips where /usr/bin/chromium is missing. This one still checks that app.js loads and
starts, which boxes it offers for which model, and the job body it builds from them (the control
and IP-Adapter pictures and the upscaler of issue 30), with the daemon's answers given as JSON.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="no node to run the page's script in")
APP = Path(__file__).parents[1] / "diffusiond" / "web" / "app.js"
HARNESS = Path(__file__).with_name("webjs_harness.js")
MODELS = {"object": "list", "data": [
    {"id": "tiny", "task": "text-to-image", "edits": ["image-to-image"], "state": "ready"},
    {"id": "hold", "task": "text-to-image", "edits": [], "state": "ready"},
    {"id": "clip", "task": "text-to-video", "edits": [], "state": "ready"}]}
SERVED = {"/v1/models": MODELS, "/v1/loras": {"data": []}, "/v1/jobs": {"data": []},
          "/health": {"version": "x", "status": "ok"},
          "/v1/controlnets": {"data": [{"name": "edges", "models": ["tiny"], "unfit": {"hold": "no family"}}]},
          "/v1/ip-adapters": {"data": [{"name": "style", "models": ["tiny"], "unfit": {"hold": "no family"}}]},
          "/v1/upscalers": {"data": [{"name": "esrgan", "object": "upscaler", "scale": 4}]}}


def page(steps: list[dict[str, Any]], answers: dict[str, Any] = SERVED) -> dict[str, Any]:
    assert NODE is not None
    done = subprocess.run([NODE, str(HARNESS), str(APP), json.dumps(answers), json.dumps(steps)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    assert "error" not in out, out["error"]
    assert out["ready"], out
    return out


def test_the_boxes_are_offered_only_for_models_their_adapters_fit() -> None:
    steps = page([{"model": "tiny"}, {"model": "hold"}, {"model": "clip"}, {"model": "tiny"}])["steps"]
    assert [(s["control"], s["reference"]) for s in steps] == [(True, True), (False, False), (False, False),
                                                                (True, True)]
    assert (steps[0]["control_names"], steps[0]["reference_names"]) == (["edges"], ["style"])


def test_a_daemon_that_serves_none_shows_neither_box() -> None:
    answers = {k: v for k, v in SERVED.items() if k not in ("/v1/controlnets", "/v1/ip-adapters")}
    [step] = page([{"model": "tiny"}], answers)["steps"]
    assert (step["control"], step["reference"]) == (False, False)


@pytest.mark.parametrize(("box", "field", "entry"), [
    ("control", "control", {"name": "edges", "image": "data:image/png;base64,QUJD", "scale": 0.5,
                            "preprocess": "canny"}),
    ("reference", "ip_adapter", {"name": "style", "image": "data:image/png;base64,QUJD", "scale": 0.5}),
])
def test_a_chosen_picture_is_sent_as_its_field(box: str, field: str, entry: dict[str, Any]) -> None:
    values = {"prompt": "a lighthouse", f"{box}-scale": "0.5", "control-preprocess": "canny"}
    [step] = page([{"model": "tiny", "values": values, "files": {f"{box}-image": "QUJD"}, "submit": True}])["steps"]
    body = step["body"]
    assert body is not None and body[field] == [entry]
    assert ("ip_adapter" if field == "control" else "control") not in body


def test_no_picture_sends_neither_field() -> None:
    [step] = page([{"model": "tiny", "values": {"prompt": "a lighthouse"}, "submit": True}])["steps"]
    assert step["body"] is not None and "control" not in step["body"] and "ip_adapter" not in step["body"]


def test_the_upscale_box_is_offered_for_picture_models_of_a_daemon_with_upscalers() -> None:
    steps = page([{"model": "tiny"}, {"model": "hold"}, {"model": "clip"}])["steps"]
    assert [s["upscale"] for s in steps] == [True, True, False]  # a video model's job would be refused
    assert steps[0]["upscale_names"] == ["", "esrgan"]  # "none" first: upscaling is a choice
    answers = {k: v for k, v in SERVED.items() if k != "/v1/upscalers"}
    [bare] = page([{"model": "tiny"}], answers)["steps"]
    assert bare["upscale"] is False


@pytest.mark.parametrize(("values", "sent"), [
    ({"upscale-name": "esrgan", "upscale-scale": "2"}, {"name": "esrgan", "scale": 2}),
    ({"upscale-name": "esrgan"}, {"name": "esrgan"}),  # no scale: the upscaler's own (4x here)
    ({"upscale-name": ""}, None),
])
def test_the_chosen_upscaler_is_sent_as_the_upscale_field(values: dict[str, str], sent: Any) -> None:
    [step] = page([{"model": "tiny", "values": {"prompt": "a lighthouse", **values}, "submit": True}])["steps"]
    assert step["body"] is not None and step["body"].get("upscale") == sent
