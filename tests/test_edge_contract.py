"""What a user of the HTTP API meets against a real daemon on ``tiny`` (docs/api.md), where the edge used to
answer otherwise:

- ``DELETE /v1/jobs/{id}?finished=`` with anything but ``keep`` (a typo, another case) deleted a finished job
  for good, as a plain DELETE does: it is a 400 naming ``finished`` now, and the job stays;
- ``stream: true`` on OpenAI's Images endpoints (the SDK's ``stream=True``) was ignored: the daemon ran the job
  and answered one JSON document, in which the SDK's stream found no event, so the picture was lost without a
  word. It is a 400 naming ``stream``;
- the TCP listener took the bearer scheme only as ``Bearer`` and one space, where HTTP's scheme is
  case-insensitive (RFC 9110 11.1) and the web listener took extra spaces;
- a 405 carried no ``Allow`` header, which HTTP requires of it;
- an edit whose client hung up while its picture was decoded kept its input memfd for the daemon's life (the
  same in process, every time: tests/test_edge_decode_cancel.py).
"""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from daemonkit import Daemon, fds_named, shared_daemon
from fuzzhttpkit import call, call_json, multipart
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

TOKEN = "edge-contract-token-of-enough-length"
FAST = {"model": "tiny", "prompt": "a lighthouse", "width": 64, "height": 64, "steps": 1}
IMAGES = {"model": "tiny", "prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 1}
EDIT = {**IMAGES, "num_inference_steps": 2}  # an edit's default strength, 0.8, runs no step of one


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("edge-contract")
    (tmp / "token").write_text(TOKEN + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--model", "tiny", "--workers", "1", "--tcp", f"127.0.0.1:{port}", "--token-file", str(tmp / "token")]
    with shared_daemon(tmp, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        d.tcp_port = port  # type: ignore[attr-defined]
        yield d


def finished_job(sock: Path) -> str:
    status, job = call_json(sock, "POST", "/v1/jobs", FAST)
    assert status == 202, job
    deadline = time.monotonic() + 120
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        job = call_json(sock, "GET", f"/v1/jobs/{job['id']}")[1]
    assert job["status"] == "succeeded", job
    return str(job["id"])


@pytest.mark.parametrize("value", ["KEEP", "kep", "", "true", "keep ", "delete"])
def test_a_finished_value_other_than_keep_is_refused_and_deletes_nothing(daemon: Daemon, value: str) -> None:
    job_id = finished_job(daemon.socket)
    status, _, raw = call(daemon.socket, "DELETE", f"/v1/jobs/{job_id}?finished={value.replace(' ', '%20')}")
    answer = json.loads(raw)
    assert status == 400 and answer["error"]["field"] == "finished", answer
    assert "finished=keep" in answer["error"]["message"], answer
    assert call_json(daemon.socket, "GET", f"/v1/jobs/{job_id}")[0] == 200  # still there, outputs and all
    assert call(daemon.socket, "GET", f"/v1/jobs/{job_id}/outputs/0")[0] == 200
    # the documented two still do what they say
    assert call_json(daemon.socket, "DELETE", f"/v1/jobs/{job_id}?finished=keep")[0] == 409
    status, answer = call_json(daemon.socket, "DELETE", f"/v1/jobs/{job_id}")
    assert status == 200 and answer["deleted"] is True, answer


@pytest.fixture(scope="module")
def kept_job(daemon: Daemon) -> str:
    return finished_job(daemon.socket)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(max_size=12).filter(lambda v: v != "keep"))
def test_no_finished_value_but_keep_ever_deletes_a_job(daemon: Daemon, kept_job: str, value: str) -> None:
    """The fuzz families never sent ``finished`` but as ``keep`` (a plain DELETE of the job they read would
    delete it): every other text, percent-encoded as a client sends it, is a 400 naming it."""
    status, _, raw = call(daemon.socket, "DELETE", f"/v1/jobs/{kept_job}?finished={quote(value, safe='')}")
    assert status == 400 and json.loads(raw)["error"]["field"] == "finished", (value, raw)
    assert call(daemon.socket, "GET", f"/v1/jobs/{kept_job}")[0] == 200, value


def _form(text: dict[str, Any], image: bytes) -> tuple[bytes, dict[str, str]]:
    """An edits form: ``text`` as text fields, ``image`` as the file field ``image``."""
    return multipart([*((k.encode(), str(v).encode(), False) for k, v in text.items()), (b"image", image, True)])


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 60, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("value", [True, "true", "1"])
def test_stream_true_on_the_images_endpoints_is_refused_naming_stream(daemon: Daemon, value: Any) -> None:
    if value is True:
        status, answer = call_json(daemon.socket, "POST", "/v1/images/generations", {**IMAGES, "stream": True})
    else:
        body, headers = _form({**EDIT, "stream": value}, _png())
        status, _, raw = call(daemon.socket, "POST", "/v1/images/edits", body, headers)
        answer = json.loads(raw)
    assert status == 400 and answer["error"]["field"] == "stream", answer
    assert "/events" in answer["error"]["message"], answer  # where progress and previews are followed instead


def test_stream_false_is_the_plain_answer(daemon: Daemon) -> None:
    status, answer = call_json(daemon.socket, "POST", "/v1/images/generations", {**IMAGES, "stream": False})
    assert status == 200 and answer["data"][0]["b64_json"], answer
    body, headers = _form({**EDIT, "stream": "false"}, _png())
    status, _, raw = call(daemon.socket, "POST", "/v1/images/edits", body, headers)
    assert status == 200 and json.loads(raw)["data"][0]["b64_json"], raw


def _tcp_get(port: int, authorization: str | None) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        auth = f"Authorization: {authorization}\r\n" if authorization is not None else ""
        c.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n".encode())
        data = b""
        while chunk := c.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize("authorization", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}",
                                           f"Bearer  {TOKEN}", f"Bearer {TOKEN} "])
def test_the_tcp_listener_takes_the_bearer_scheme_in_any_case(daemon: Daemon, authorization: str) -> None:
    assert _tcp_get(daemon.tcp_port, authorization) == 200  # type: ignore[attr-defined]


@pytest.mark.parametrize("authorization", [None, "", TOKEN, f"Basic {TOKEN}", "Bearer wrong", "Bearer ",
                                           f"Bearer {TOKEN}x", f"Bearer{TOKEN}", f"Bearer {TOKEN} {TOKEN}"])
def test_the_tcp_listener_still_refuses_what_is_not_the_token(daemon: Daemon, authorization: str | None) -> None:
    assert _tcp_get(daemon.tcp_port, authorization) == 401  # type: ignore[attr-defined]


def test_a_405_says_which_methods_the_path_takes(daemon: Daemon) -> None:
    status, headers, raw = call(daemon.socket, "PUT", "/v1/jobs")
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    assert {m.strip() for m in headers.get("allow", "").split(",")} >= {"GET", "POST"}, headers


def test_an_edit_whose_client_hangs_up_mid_decode_leaves_no_input_memfd(daemon: Daemon) -> None:
    """Hang-ups at many moments of a large picture's way in: some land in its decode, in the pool."""
    assert daemon.proc is not None
    noise = np.random.default_rng(0).integers(0, 256, (1536, 1536, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG", compress_level=1)
    body, headers = _form(EDIT, buf.getvalue())
    head = (f"POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Type: {headers['Content-Type']}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for i in range(24):
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(daemon.socket))
            c.sendall(head + body)
            c.settimeout(0.001 + 0.01 * i)  # then hang up, after 1 to 231 ms: before, during or after the decode
            try:
                c.recv(1)
            except TimeoutError:
                pass
    deadline = time.monotonic() + 60
    while fds_named(daemon.proc.pid, "diffusiond-input"):  # a job still running holds its own until it ends
        assert time.monotonic() < deadline, fds_named(daemon.proc.pid, "diffusiond-input")
        time.sleep(0.1)
