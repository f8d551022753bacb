"""The page's scripts in Node (tests/webjs_harness.js: a stand-in DOM and API), for machines without Chromium.

test_web_page.py drives the real page in a real browser against a real daemon and is the test of
record; it skips where /usr/bin/chromium is missing. This one still checks that the scripts load and
start, which boxes they offer for which model, and the job body they build from them (the control
and IP-Adapter pictures and the upscaler of issue 30; several control images and references, a union
ControlNet's mode, control with an edit), what "Use these settings" brings back and what a gallery card
shows, with the daemon's answers given as JSON.
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
WEB = Path(__file__).parents[1] / "diffusiond" / "web"
HARNESS = Path(__file__).with_name("webjs_harness.js")
MODELS = {"object": "list", "data": [
    {"id": "tiny", "task": "text-to-image", "edits": ["image-to-image", "inpainting"], "state": "ready"},
    {"id": "hold", "task": "text-to-image", "edits": [], "state": "ready"},
    {"id": "clip", "task": "text-to-video", "edits": [], "state": "ready", "min_steps": 2},
    {"id": "inpaint", "task": "inpainting", "edits": ["inpainting"], "state": "ready", "attention": "flash",
     "approximations": ["cache=fbcache:0.1"]}]}
SERVED = {"/v1/models": MODELS, "/v1/loras": {"data": []}, "/v1/jobs": {"data": []},
          "/health": {"version": "x", "status": "ok"},
          "/v1/controlnets": {"data": [
              {"name": "edges", "num_modes": 0, "modes": None, "models": ["tiny"], "unfit": {"hold": "no family"}},
              {"name": "union", "num_modes": 3, "modes": ["canny", "tile", "depth"], "models": ["tiny"],
               "unfit": {"hold": "no family"}}]},
          "/v1/ip-adapters": {"data": [{"name": "style", "models": ["tiny"], "unfit": {"hold": "no family"}},
                                       {"name": "look", "models": ["tiny"], "unfit": {"hold": "no family"}}]},
          "/v1/upscalers": {"data": [{"name": "esrgan", "object": "upscaler", "scale": 4}]}}


def page(steps: list[dict[str, Any]], answers: dict[str, Any] = SERVED, *, ready: bool = True) -> dict[str, Any]:
    """ready: that the page started (models listed) before the first step."""
    assert NODE is not None
    done = subprocess.run([NODE, str(HARNESS), str(WEB), json.dumps(answers), json.dumps(steps)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    assert "error" not in out, out["error"]
    assert out["ready"] is ready, out
    return out


def test_the_boxes_are_offered_only_for_models_their_adapters_fit() -> None:
    steps = page([{"model": m} for m in ("tiny", "hold", "clip", "inpaint", "tiny")])["steps"]
    # a dedicated inpainting model takes ControlNets (with its edit) and no IP-Adapter (docs/api.md)
    assert [(s["control"], s["reference"]) for s in steps] == [(True, True), (False, False), (False, False),
                                                                (True, False), (True, True)]
    assert (steps[0]["controls"][0]["names"], steps[0]["references"][0]["names"]) == (["edges", "union"],
                                                                                      ["style", "look"])
    # back from models that take none, the first that fits is chosen again (not left empty)
    assert (steps[-1]["controls"][0]["name"], steps[-1]["references"][0]["name"]) == ("edges", "style")


def test_the_steps_input_starts_at_the_models_fewest_steps() -> None:
    """A model whose scheduler cannot run one step (min_steps 2 in /v1/models) says so on the page."""
    assert [s["steps_min"] for s in page([{"model": m} for m in ("tiny", "clip", "tiny")])["steps"]] == ["1", "2", "1"]


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
    values = {"prompt": "a lighthouse", f"{box}-scale-0": "0.5", "control-preprocess-0": "canny"}  # the first rows
    [step] = page([{"model": "tiny", "values": values, "files": {f"{box}-image-0": "QUJD"}, "submit": True}])["steps"]
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


PNG = "data:image/png;base64,"


def test_several_references_are_sent_in_their_rows_order_up_to_the_engines_cap() -> None:
    """Rows are added up to 4 (the engine's MAX_IP_ADAPTERS); each row is one entry of ``ip_adapter`` with
    its own adapter, picture and scale, in the rows' order; a row without a picture sends nothing, and a
    removed row's picture leaves with it."""
    steps = page([
        {"model": "tiny"},
        {"click": ["reference-add", "reference-add", "reference-add", "reference-add"]},  # the fourth does nothing
        {"choose": {"reference-name-1": "look", "reference-name-3": "look"},
         "values": {"prompt": "a lighthouse", "reference-scale-0": "0.25", "reference-scale-3": "0.75"},
         "files": {"reference-image-0": "QQ==", "reference-image-1": "Qg==", "reference-image-3": "RA=="},
         "submit": True},
        {"click": ["reference-remove-1"], "submit": True},
    ])["steps"]
    assert [len(s["references"]) for s in steps] == [1, 4, 4, 3]
    assert steps[0]["references"][0]["removable"] is False and steps[0]["can_add"]  # one row stays
    assert steps[1]["can_add"] is False and all(r["removable"] for r in steps[1]["references"])
    assert steps[2]["body"]["ip_adapter"] == [
        {"name": "style", "image": PNG + "QQ==", "scale": 0.25}, {"name": "look", "image": PNG + "Qg==", "scale": 1},
        {"name": "look", "image": PNG + "RA==", "scale": 0.75}]  # row 2 has no picture: left out
    assert [r["id"] for r in steps[3]["references"]] == ["reference-image-0", "reference-image-2", "reference-image-3"]
    assert steps[3]["can_add"] and [e["image"] for e in steps[3]["body"]["ip_adapter"]] == [PNG + "QQ==", PNG + "RA=="]


def test_a_union_controlnet_asks_for_its_mode_and_sends_it() -> None:
    """The mode picker shows for a union ControlNet only (GET /v1/controlnets' ``num_modes``), offers 0..n-1,
    and is required: without a mode the page says so and sends nothing; a single-mode one sends no mode."""
    values = {"prompt": "a lighthouse"}
    steps = page([
        {"model": "tiny", "files": {"control-image-0": "QUJD"}},
        {"choose": {"control-name-0": "union"}, "values": values, "submit": True},
        {"choose": {"control-mode-0": "2"}, "submit": True},
        {"choose": {"control-name-0": "edges"}, "submit": True},
    ])["steps"]
    modes = [s["controls"][0]["mode"] for s in steps]
    assert modes[0] is None  # edges: single-mode, no picker
    assert modes[1] == ["", "0", "1", "2"] and steps[1]["body"] is None
    assert "mode of the union ControlNet union (0 to 2" in steps[1]["error"]
    assert steps[2]["body"]["control"] == [{"name": "union", "image": PNG + "QUJD", "scale": 1, "preprocess": "none",
                                            "mode": 2}]
    assert modes[3] is None and "mode" not in steps[3]["body"]["control"][0]


def test_a_control_image_goes_with_an_input_image_and_its_mask() -> None:
    """ControlNet with image-to-image or inpainting (docs/api.md): both boxes are offered for a model with
    edits, and the body carries the edit's image, mask and strength beside ``control``."""
    steps = page([
        {"model": "hold"},
        {"model": "tiny", "values": {"prompt": "a lighthouse", "strength": "0.6"},
         "files": {"image": "SU1H", "mask": "TUFTSw==", "control-image-0": "QUJD"}, "submit": True},
    ])["steps"]
    assert steps[0]["mask"] is False and steps[1]["mask"] is True
    body = steps[1]["body"]
    assert (body["image"], body["mask"], body["strength"]) == (PNG + "SU1H", PNG + "TUFTSw==", 0.6)
    assert body["control"][0]["name"] == "edges" and body["control"][0]["image"] == PNG + "QUJD"


def test_several_control_images_are_sent_in_their_rows_order_each_with_its_own_settings() -> None:
    """Rows are added up to 4 (the engine's MAX_CONTROLS); each row with a picture is one entry of ``control``
    with its own ControlNet, scale, step range, preprocess and, for a union one, mode (asked for before the
    job is sent); a removed row's picture leaves with it, and the rows left keep their order."""
    steps = page([
        {"model": "tiny"},
        {"click": ["control-add", "control-add", "control-add", "control-add"]},  # the fourth does nothing
        {"choose": {"control-name-1": "union", "control-preprocess-0": "canny"},
         "values": {"prompt": "a lighthouse", "control-scale-0": "0.5", "control-start-1": "0.2",
                    "control-end-1": "0.8"},
         "files": {"control-image-0": "QQ==", "control-image-1": "Qg=="}, "submit": True},
        {"choose": {"control-mode-1": "1"}, "submit": True},
        {"click": ["control-remove-0"], "choose": {"control-name-3": "edges"}, "files": {"control-image-3": "RA=="},
         "submit": True},
    ])["steps"]
    assert [len(s["controls"]) for s in steps] == [1, 4, 4, 4, 3]
    assert steps[0]["controls"][0]["removable"] is False and steps[0]["can_add_control"]  # one row stays
    assert steps[1]["can_add_control"] is False and all(r["removable"] for r in steps[1]["controls"])
    assert [r["mode"] for r in steps[2]["controls"]] == [None, ["", "0", "1", "2"], None, None]  # union's row only
    assert steps[2]["body"] is None and "mode of the union ControlNet union (0 to 2" in steps[2]["error"]
    edges = {"name": "edges", "image": PNG + "QQ==", "scale": 0.5, "preprocess": "canny"}
    union = {"name": "union", "image": PNG + "Qg==", "scale": 1, "start": 0.2, "end": 0.8, "preprocess": "none",
             "mode": 1}
    assert steps[3]["body"]["control"] == [edges, union]  # rows 2 and 3 have no picture: left out
    assert [r["id"] for r in steps[4]["controls"]] == ["control-image-1", "control-image-2", "control-image-3"]
    assert steps[4]["can_add_control"] and steps[4]["body"]["control"] == [
        union, {"name": "edges", "image": PNG + "RA==", "scale": 1, "preprocess": "none"}]


EDGES = {"name": "edges", "scale": 0.5, "start": 0.0, "end": 1.0, "preprocess": "canny", "mode": None}
UNION = {"name": "union", "scale": 0.75, "start": 0.2, "end": 0.8, "preprocess": "none", "mode": 1}


def test_use_these_settings_brings_back_every_row_of_both_boxes() -> None:
    """A job's ``request.control`` and ``ip_adapter`` (as the daemon records them) come back as that many
    rows, each with its ControlNet, scale, step range, preprocess and mode, or IP-Adapter and scale; a job
    with fewer takes the extra rows away."""
    references = [{"name": "look", "scale": 0.5}, {"name": "style", "scale": 0.25}]
    job = {"model": "tiny", "request": {"prompt": "again", "control": [EDGES, UNION], "ip_adapter": references}}
    fewer = {**job, "request": {"prompt": "fewer", "control": [{**UNION, "mode": 2}],
                                "ip_adapter": [{"name": "look", "scale": 2}]}}
    steps = page([{"model": "tiny"}, {"reuse": job}, {"reuse": fewer}])["steps"]
    assert [(r["name"], r["scale"]) for r in steps[1]["references"]] == [("look", "0.5"), ("style", "0.25")]
    assert [(r["name"], r["scale"], r["start"], r["end"], r["preprocess"], r["mode"], r["mode_value"])
            for r in steps[1]["controls"]] == [("edges", "0.5", "0", "1", "canny", None, ""),
                                               ("union", "0.75", "0.2", "0.8", "none", ["", "0", "1", "2"], "1")]
    assert [(r["name"], r["scale"]) for r in steps[2]["references"]] == [("look", "2")]
    assert [(r["name"], r["mode_value"], r["removable"]) for r in steps[2]["controls"]] == [("union", "2", False)]


def test_a_gallery_card_names_every_control_entry() -> None:
    """As the PNG's ``control`` text does: name, mode, scale, and the step range and preprocess where they
    are not the defaults."""
    job = {"id": "j_1", "model": "tiny", "status": "succeeded", "created": 0, "outputs": [],
           "request": {"prompt": "p", "width": 64, "height": 64, "steps": 2, "guidance_scale": 7,
                       "control": [EDGES, UNION], "ip_adapter": []}}
    [step] = page([{"model": "tiny"}], {**SERVED, "/v1/jobs": {"data": [job]}})["steps"]
    [card] = step["cards"]
    assert "control edges:0.5 canny · control union@1:0.75[0.2-0.8]" in " ".join(card)


def test_a_gallery_card_shows_the_jobs_wall_time_not_its_stages_added_up() -> None:
    """The stages' times overlap (a batch's copy runs beside the next forward) and ``total`` is among them: their
    sum was about twice the job's real time."""
    job = {"id": "j_1", "model": "tiny", "status": "succeeded", "created": 0, "outputs": [],
           "timings_ms": {"queued": 100.0, "computing": 1500.0, "encoding": 400.0, "total": 2000.0},
           "request": {"prompt": "p", "width": 64, "height": 64, "steps": 2, "guidance_scale": 7}}
    [step] = page([{"model": "tiny"}], {**SERVED, "/v1/jobs": {"data": [job]}})["steps"]
    [card] = step["cards"]
    assert " · 2.0 s" in " ".join(card) and "4.0 s" not in " ".join(card)


def test_the_models_panel_shows_each_models_attention_and_approximations() -> None:
    [step] = page([{"model": "tiny"}])["steps"]
    rows = {cells[0]: cells[-2:] for cells in step["residency"]}
    assert rows["tiny"] == ["default", "none"]  # the exact default path
    assert rows["inpaint"] == ["flash", "cache=fbcache:0.1"]


def test_previews_follow_each_models_flag_and_one_refusal_turns_off_no_other_model() -> None:
    # one model's refusal used to turn previews off for every model until a reload
    models = {"object": "list", "data": [
        {"id": "tiny", "task": "text-to-image", "edits": [], "state": "ready", "previews": True},
        {"id": "sd3", "task": "text-to-image", "edits": [], "state": "ready", "previews": False}]}
    answers = {**SERVED, "/v1/models": models, "refuse_preview": ["tiny"]}
    first = {"check": {"previews": True}, "values": {"prompt": "a lighthouse"}}
    steps = page([{"model": "sd3", **first, "submit": True}, {"model": "tiny", "submit": True},
                  {"submit": True}], answers)["steps"]
    # a model that cannot preview: the box is off, says why, and its job does not ask
    assert (steps[0]["previews"], steps[0]["previews_title"]) == (False, "sd3 shows no previews")
    assert "preview" not in steps[0]["body"] and steps[0]["posts"] == 1
    # a model that says it can, yet refuses one job: that job goes again without, and the next still asks
    assert steps[1]["previews"] and "preview" not in steps[1]["body"] and steps[1]["posts"] == 2
    assert steps[2]["previews"] and steps[2]["posts"] == 2


def test_a_daemon_without_preview_flags_that_refuses_one_is_taken_to_have_none() -> None:
    answers = {**SERVED, "refuse_preview": ["tiny"]}  # SERVED's models carry no previews flag
    first = {"check": {"previews": True}, "values": {"prompt": "a lighthouse"}}
    steps = page([{"model": "tiny", **first, "submit": True}, {"submit": True}], answers)["steps"]
    assert steps[0]["posts"] == 2 and "preview" not in steps[0]["body"]
    assert (steps[1]["previews"], steps[1]["previews_title"]) == (False, "this daemon does not send previews")
    assert steps[1]["posts"] == 1 and "preview" not in steps[1]["body"]
