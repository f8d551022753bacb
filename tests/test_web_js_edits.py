"""The page's edit boxes for models that edit without a strength or make videos from an image (issue 30):
Strength is offered and sent only where the model's edits repaint (image-to-image, inpainting), and the
upscale box never for a video model, text-to-video or image-to-video. Run in Node on test_web_js.py's
harness; the page's copies of the protocol's task sets are checked against protocol.py.
"""

from __future__ import annotations

import re

import pytest
from test_web_js import NODE, SERVED, WEB, page

from diffusiond.protocol import STRENGTH_TASKS, VIDEO_TASKS

pytestmark = pytest.mark.skipif(NODE is None, reason="no node to run the page's script in")

MODELS = {"object": "list", "data": [
    {"id": "tiny", "task": "text-to-image", "edits": ["image-to-image", "inpainting"], "state": "ready"},
    {"id": "kontext", "task": "instruction-edit", "edits": ["instruction-edit"], "state": "ready"},
    {"id": "wan-i2v", "task": "image-to-video", "edits": ["image-to-video"], "state": "ready"},
    {"id": "ltx", "task": "text-to-video", "edits": ["image-to-video"], "state": "ready"}]}


def test_strength_is_offered_and_sent_only_for_edits_that_repaint() -> None:
    values = {"prompt": "make it night", "strength": "0.6"}
    steps = page([{"model": m, "values": values, "files": {"image": "QUJD"}, "submit": True}
                  for m in ("tiny", "kontext", "wan-i2v", "ltx")], {**SERVED, "/v1/models": MODELS})["steps"]
    bodies = [s["body"] for s in steps]
    assert all(b is not None and b["image"] == "data:image/png;base64,QUJD" for b in bodies), bodies
    # the engine answers 400 "strength does not apply to instruction-edit" (and image-to-video) when sent
    assert [b.get("strength") for b in bodies] == [0.6, None, None, None]


def test_the_upscale_box_is_hidden_for_every_video_model() -> None:
    steps = page([{"model": m} for m in ("tiny", "kontext", "wan-i2v", "ltx")],
                 {**SERVED, "/v1/models": MODELS})["steps"]
    assert [s["upscale"] for s in steps] == [True, True, False, False]  # a video job's upscale is a 400


def test_the_pages_task_sets_are_the_protocols() -> None:
    script = (WEB / "app.js").read_text()
    for name, tasks in (("VIDEO_TASKS", VIDEO_TASKS), ("STRENGTH_TASKS", STRENGTH_TASKS)):
        m = re.search(rf"^const {name} = \[(.*)\];$", script, re.M)
        assert m, name
        assert set(re.findall(r'"([^"]+)"', m.group(1))) == {t.value for t in tasks}, name
