"""The Python client's pictures (an edit's image and mask, control and reference images) given as ``str``:
what the API itself takes (base64, a ``data:`` URL) goes as it is, a local file is read and sent base64,
and anything else is a ValueError naming the field and what the client takes, never the file system's
FileNotFoundError for a base64 string it took for a path (issue 30). No daemon: this is the body the
client builds (``job_body``); the daemon's reading of base64 and data URLs has its own tests."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from controlkit import png

from diffusiond.client.params import job_body


def test_base64_and_data_urls_go_as_they_are_and_files_are_read(tmp_path: Path) -> None:
    b64 = png(1)
    url = "data:image/png;base64," + b64
    (tmp_path / "in.png").write_bytes(base64.b64decode(b64))
    body = job_body("x", {"image": b64, "mask": url, "control": [{"name": "edges", "image": url}],
                          "ip_adapter": [{"name": "style", "image": str(tmp_path / "in.png"), "scale": 0.5}]})
    assert (body["image"], body["mask"], body["control"][0]["image"]) == (b64, url, url)
    assert body["ip_adapter"] == [{"name": "style", "image": b64, "scale": 0.5}]
    assert job_body("x", {"image": tmp_path / "in.png"})["image"] == b64  # a PathLike is always a file
    assert job_body("x", {"image": base64.b64decode(b64)})["image"] == b64


@pytest.mark.parametrize(("params", "field"), [
    ({"image": "cat.png"}, "image"),
    ({"mask": "no/such/mask.webp"}, "mask"),
    ({"control": [{"name": "edges", "image": "edges.png"}]}, "control[0].image"),
    ({"ip_adapter": [{"name": "a", "image": png(1)}, {"name": "b", "image": "face.jpg"}]}, "ip_adapter[1].image"),
])
def test_a_string_that_is_no_file_and_no_base64_is_a_value_error_naming_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=r"bytes, a path or a data URL") as err:
        job_body("x", params)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"{field}: ")
