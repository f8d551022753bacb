"""The job body the client makes of what a caller passes: ``loras`` in each form a caller writes, the HTTP API's
own among them, and a form it does not take refused by name."""

from __future__ import annotations

import pytest

from diffusiond.client.params import job_body


def test_loras_in_the_http_apis_own_shape_go_as_they_are() -> None:
    """Written as docs/api.md writes them, the entries were unpacked as pairs: "could not convert string to float:
    'weight'", naming neither ``loras`` nor what it takes."""
    api = [{"name": "ink", "weight": 0.8}, {"name": "dots"}]
    assert job_body("a", {"loras": api})["loras"] == api
    pairs = {"ink": 0.8, "dots": 1}
    assert job_body("a", {"loras": pairs})["loras"] == job_body("a", {"loras": list(pairs.items())})["loras"] == [
        {"name": "ink", "weight": 0.8}, {"name": "dots", "weight": 1.0}]


@pytest.mark.parametrize("entry", ["ink", ("ink", "heavy"), ("ink", 0.8, 1)])
def test_a_lora_entry_in_no_form_the_client_takes_is_refused_by_its_place(entry: object) -> None:
    with pytest.raises(ValueError, match=r"loras\[1\] is .*\{name: weight\}.*\(name, weight\) pairs"):
        job_body("a", {"loras": [("dots", 1.0), entry]})  # type: ignore[list-item]
