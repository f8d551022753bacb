"""Targeted HTTP inputs against a daemon like tests/test_fuzz_http.py's (issue 7): requests must not
reach files, so model names and job or output ids that look like paths are unknown names (404),
never paths, and LoRA paths that are not LoRAs are refused without leaking the file; a method the
HTTP parser does not know is its plain-text 400; a scheduler is checked at admission, against the
pipelines' own list; any sleep level but 1 or 2 is a 400; and the new features together (ControlNets
with edits, union modes, several IP-Adapters, FLUX's) run to success or are a 400 naming the field.

Apart from tests/test_fuzz_http.py because these are fixed inputs, each with the one answer it must
get, rather than fuzzing; together the two were past 500 lines. The daemon (the same configuration,
one of its own), the client and the checks are tests/fuzzhttpkit.py's.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonkit import Daemon
from fuzzhttpkit import (
    LORAS,
    MODELS,
    _png,
    assert_healthy_after_fuzzing,
    call,
    call_json,
    cancel_if_accepted,
    check_answer,
    finished_job,
    fuzz_daemon_in,
    multipart,
    wait_job,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
                lora_files: dict[str, Path], controlnet_dir: Path, ip_adapter_file: Path,
                upscaler_file: Path, fuzz_adapters: dict[str, Path]) -> Iterator[Daemon]:
    with fuzz_daemon_in(tmp_path_factory.mktemp("fuzz"), model_cache, lora_files, controlnet_dir,
                        ip_adapter_file, upscaler_file, fuzz_adapters) as d:
        yield d


@pytest.fixture(scope="module")
def sock(fuzz_daemon: Daemon) -> Path:
    return fuzz_daemon.socket


@pytest.fixture(scope="module")
def real_job(sock: Path) -> str:
    """A finished job, so generated paths can reach its outputs and events."""
    return finished_job(sock)


# targeted: requests cannot name files ---------------------------------------------------------
@pytest.mark.parametrize("model", ["../../etc/passwd", "/etc/passwd", "tiny/../x", "./tiny", "~/tiny", "tiny/",
                                   "/dev/zero", "file:///etc/passwd", "synthetic:compute_ms=1", "tiny\x00"])
def test_model_names_that_look_like_paths_are_unknown_models(sock: Path, model: str) -> None:
    for path, body in (("/v1/jobs", {"model": model, "prompt": "x"}),
                       ("/v1/images/generations", {"model": model, "prompt": "x"})):
        status, answer = call_json(sock, "POST", path, body)
        assert status == 404, answer
        assert answer["error"]["code"] == "model_not_found" and answer["error"]["field"] == "model", answer
    status, listing = call_json(sock, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in listing["data"]] == list(MODELS)


@pytest.mark.parametrize("suffix", ["..%2F..%2Fetc/outputs/0", "..%2F..%2Fetc%2Fpasswd", "%2E%2E/outputs/0",
                                    "{job}/outputs/..%2F..%2Fetc%2Fpasswd", "{job}/outputs/%2e%2e",
                                    "{job}/outputs/-1", "{job}/outputs/1", "{job}/outputs/0x0", "{job}/outputs/%200",
                                    "{job}/outputs/0_0", "{job}/outputs/+0", "{job}/outputs/%D9%A0",
                                    "{job}/outputs/1e0",
                                    "{job}%2F..%2F..%2Fetc/outputs/0", "{job}/../../../etc/passwd"])
def test_job_and_output_ids_that_look_like_paths_are_404(sock: Path, real_job: str, suffix: str) -> None:
    path = "/v1/jobs/" + suffix.format(job=real_job)
    status, headers, raw = call(sock, "GET", path)
    answer = check_answer("GET", path, status, headers, raw)
    assert status == 404, (path, answer)
    assert b"root:" not in raw


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/zero", "/dev/stdin", "/proc/self/fd/0", "/proc/self/environ",
                                  "/", "../../etc/shadow", "",
                                  "\x00", "/etc/passwd\x00.safetensors"])
def test_lora_paths_that_are_not_loras_are_refused_and_nothing_of_the_file_leaks(sock: Path, path: str) -> None:
    status, answer = call_json(sock, "POST", "/v1/loras", {"name": "probe", "path": path})
    assert status == 400 and answer["error"]["field"] == "path", answer
    assert "root:" not in answer["error"]["message"] and "PATH=" not in answer["error"]["message"], answer
    status, listing = call_json(sock, "GET", "/v1/loras")
    assert status == 200 and sorted(e["name"] for e in listing["data"]) == sorted(LORAS), listing


def test_unknown_method_is_refused_by_the_parser(sock: Path) -> None:
    """aiohttp's HTTP parser refuses a method it does not know before any routing: a plain-text
    400 (outside the JSON error shape, which only the application's middleware can give), and the
    connection is closed. Nothing reaches the engine."""
    status, _, raw = call(sock, "FOO", "/v1/jobs")  # no body: the server closes right after its answer
    assert status == 400 and b"method" in raw.lower(), raw
    status, h = call_json(sock, "GET", "/health")
    assert status == 200 and h["status"] == "ok", h


@pytest.mark.parametrize(("model", "scheduler", "fits"), [
    ("tiny", "bogus", False), ("tiny", "", False), ("tiny", "flow-match", False), ("tiny", "ddim", True),
    ("tiny", "euler", True), ("fz", "bogus", False), ("fz", "flow-match", True), ("fz", "unipc", True),
    ("tiny", "flow-sde", False), ("fz", "flow-sde", True),
])
def test_scheduler_is_checked_at_admission(sock: Path, model: str, scheduler: str, fits: bool) -> None:
    """An unknown scheduler, or one the model cannot use, is a 400 naming the field on both
    endpoints (it used to be accepted and fail in the worker: a 500 on the synchronous one)."""
    job = {"model": model, "prompt": "x", "width": 64, "height": 64, "steps": 2, "scheduler": scheduler}
    images = {"model": model, "prompt": "x", "size": "64x64", "num_inference_steps": 2, "scheduler": scheduler}
    status, answer = call_json(sock, "POST", "/v1/jobs", job)
    if fits:
        assert status == 202, answer
        cancel_if_accepted(sock, status, answer)
        status, answer = call_json(sock, "POST", "/v1/images/generations", images)
        assert status == 200, answer
        return
    assert status == 400 and answer["error"]["field"] == "scheduler", answer
    assert repr(scheduler) in answer["error"]["message"], answer
    status, answer = call_json(sock, "POST", "/v1/images/generations", images)
    assert status == 400 and answer["error"]["field"] == "scheduler", answer


def test_a_negative_prompt_the_model_would_ignore_is_a_400(sock: Path) -> None:
    """FLUX reads a negative prompt only at a true CFG scale the daemon never sets: one was dropped silently
    and still written into the job's request and the PNG's metadata as if it had acted.
    GET /v1/models says which models take one; an empty one is no negative prompt, so it is taken."""
    status, listing = call_json(sock, "GET", "/v1/models")
    takes = {m["id"]: m["negative_prompt"] for m in listing["data"]}
    assert takes["tiny-flux"] is False and takes["tiny"] is True and takes["tiny-inpaint"] is True, takes
    for path, body in (("/v1/jobs", {**FLUX, "negative_prompt": "blurry"}),
                       ("/v1/images/generations", {"model": "tiny-flux", "prompt": "x", "size": "64x64",
                                                   "num_inference_steps": 2, "negative_prompt": "blurry"})):
        status, answer = call_json(sock, "POST", path, body)
        assert status == 400 and answer["error"]["field"] == "negative_prompt", answer
        assert "'tiny-flux'" in answer["error"]["message"] and "leave negative_prompt out" in answer["error"]["message"]
    for body in ({**FLUX, "negative_prompt": ""}, {**TINY, "negative_prompt": "blurry"}):
        status, answer = call_json(sock, "POST", "/v1/jobs", body)
        assert status == 202, answer
        cancel_if_accepted(sock, status, answer)


@pytest.mark.parametrize(("path", "sent", "takes"), [
    ("/v1/jobs", "num_inference_steps", "steps"), ("/v1/images/generations", "steps", "num_inference_steps"),
    ("/v1/images/edits", "steps", "num_inference_steps"), ("/v1/jobs", "guidance", "guidance_scale"),
    ("/v1/images/generations", "guidance", "guidance_scale"),
])
def test_the_other_endpoints_spelling_is_told_this_ones(sock: Path, path: str, sent: str, takes: str) -> None:
    """/v1/jobs says ``steps``, the OpenAI-style endpoints ``num_inference_steps`` (and the CLI ``--guidance``): a
    body in the other spelling got only msgspec's "unknown field". No alias: it is refused."""
    if path == "/v1/images/edits":
        body, headers = multipart([(b"prompt", b"x", False), (sent.encode(), b"2", False),
                                   (b"image", _png((64, 64)), True)])
        status, headers, raw = call(sock, "POST", path, body, headers)
        answer = check_answer("POST", path, status, headers, raw)
    else:
        status, answer = call_json(sock, "POST", path, {"prompt": "x", "size": "64x64", sent: 2})
    assert status == 400 and answer["error"]["field"] == sent, answer
    assert answer["error"]["message"] == f"unknown field {sent!r}: this endpoint takes {takes}", answer


def test_scheduler_names_checked_at_admission_are_the_pipelines() -> None:
    from diffusiond import protocol
    from diffusiond.pipelines.diffusers_pipeline import FLOW_SCHEDULERS, SCHEDULERS

    assert set(protocol.SCHEDULERS) == set(SCHEDULERS) and set(protocol.FLOW_SCHEDULERS) == set(FLOW_SCHEDULERS)


# the new features together (ControlNets with edits, union modes, several IP-Adapters, FLUX's): each input
# succeeds, run to the end, or is a 400 naming its field. The first ones failed in the worker (found by
# test_fuzz_combined_requests_run_to_the_end's family and by hand); the rest are what random drawing seldom meets.
def _pic(size: tuple[int, int], mode: str = "RGB") -> str:
    return base64.b64encode(_png(size, mode)).decode()


P64, P72, P128, L64 = _pic((64, 64)), _pic((72, 64)), _pic((128, 128)), _pic((64, 64), "L")
EDGES, BLOBS = {"name": "edges", "image": P64}, {"name": "blobs", "image": P64}
LINES, UNION = {"name": "flux-lines", "image": P64}, {"name": "flux-union", "image": P64, "mode": 1}
REF = lambda name="style", **kw: {"name": name, "image": P64, **kw}  # noqa: E731
TINY = {"prompt": "x", "model": "tiny", "width": 64, "height": 64, "steps": 3, "seed": 1}
FLUX = {**TINY, "model": "tiny-flux"}
RUN = None  # the input succeeds
COMBINED: dict[str, tuple[dict[str, Any] | bytes, str | None]] = {
    "flux reference + control + inpainting": ({**FLUX, "image": P64, "mask": L64, "control": [LINES],
                                               "ip_adapter": [REF("flux-style")]}, RUN),
    "flux reference + control + image-to-image": ({**FLUX, "image": P64, "strength": 0.7, "control": [UNION, LINES],
                                                   "ip_adapter": [REF("flux-style"), REF("flux-style", scale=0)]}, RUN),
    "flux union mode + image-to-image, n 2": ({**FLUX, "n": 2, "image": P64, "strength": 0.7, "control": [UNION]}, RUN),
    "flux union mode + inpainting, n 2": ({**FLUX, "n": 2, "image": P64, "mask": L64, "control": [UNION, LINES]}, RUN),
    "control + edit of other sizes": ({**TINY, "image": P72, "strength": 0.7,
                                       "control": [{**EDGES, "image": P128}]}, RUN),
    "4 references + 2 controls + image-to-image + upscale": (
        {**TINY, "image": P64, "strength": 0.7, "control": [EDGES, BLOBS], "upscale": {"name": "esr"},
         "ip_adapter": [REF(), REF("style2"), REF(scale=0.5), REF("style2", scale=0)]}, RUN),
    "4 references + control + hires + upscale": (
        {**TINY, "control": [EDGES], "hires": {"scale": 2, "upscaler": "esr"}, "upscale": {"name": "esr", "scale": 1.5},
         "ip_adapter": [REF(), REF("style2"), REF(scale=4), REF(scale=0)]}, RUN),
    "a reference + control + inpainting": (
        {**TINY, "image": P64, "mask": L64, "control": [EDGES], "ip_adapter": [REF("style2")]}, RUN),
    "a mask of another size, with control": ({**TINY, "image": P64, "mask": _pic((72, 72), "L"),
                                              "control": [EDGES]}, "mask"),
    "a mask without an image, with control": ({**TINY, "mask": L64, "control": [EDGES]}, "mask"),
    "mode on an IP-Adapter entry": ({**TINY, "ip_adapter": [REF(mode=1)]}, "ip_adapter[0]"),
    "mode on a single-mode ControlNet": ({**TINY, "control": [{**EDGES, "mode": 0}]}, "control[0].mode"),
    "a union ControlNet without mode": ({**FLUX, "control": [{**UNION, "mode": None}]}, "control[0].mode"),
    "a mode past the union's": ({**FLUX, "control": [{**UNION, "mode": 3}]}, "control[0].mode"),
    "a mode of 2**64": ({**FLUX, "control": [{**UNION, "mode": 2**64}]}, "control[0].mode"),
    "a mode of 400 digits": (json.dumps({**FLUX, "control": [{**UNION, "mode": 7}]}).replace('"mode": 7', '"mode": '
                             + "9" * 400).encode(), "control[0].mode"),
    "a mode by name": ({**FLUX, "control": [{**UNION, "mode": "canny"}]}, "control[0].mode"),
    "5 references": ({**TINY, "ip_adapter": [REF()] * 5}, "ip_adapter"),
    "bad base64 control image": ({**TINY, "control": [{**EDGES, "image": "!!!"}]}, "control[0].image"),
    "bad base64 reference": ({**TINY, "ip_adapter": [REF(image="AAA")]}, "ip_adapter[0].image"),
    "a huge control scale": ({**TINY, "control": [{**EDGES, "scale": 1e308}]}, "control[0].scale"),
    "a reference scale past 4": ({**TINY, "ip_adapter": [REF(scale=4.5)]}, "ip_adapter[0].scale"),
    "start after end": ({**TINY, "control": [{**EDGES, "start": 0.8, "end": 0.2}]}, "control[0].start"),
    "start at end": ({**TINY, "control": [{**EDGES, "start": 0.5, "end": 0.5}]}, "control[0].start"),
    "a FLUX adapter on tiny": ({**TINY, "ip_adapter": [REF("flux-style")]}, "ip_adapter[0].name"),
    "an SD ControlNet on tiny-flux": ({**FLUX, "control": [EDGES]}, "control[0].name"),
    "a reference on the inpainting model": ({**TINY, "model": "tiny-inpaint", "image": P64, "mask": L64,
                                             "ip_adapter": [REF()]}, "ip_adapter"),
    "control + image-to-image on the inpainting model": ({**TINY, "model": "tiny-inpaint", "image": P64,
                                                          "strength": 0.7, "control": [EDGES]}, "mask"),
    # an inpainting model given only an image needs a mask, not another model
    "an image without a mask on the inpainting model": ({**TINY, "model": "tiny-inpaint", "image": P64}, "mask"),
    "no image on the inpainting model": ({**TINY, "model": "tiny-inpaint"}, "image"),
    "NaN scale": (json.dumps({**TINY, "control": [{**EDGES, "scale": math.nan}]}).encode(), "invalid_json"),
    "Infinity reference scale": (json.dumps({**TINY, "ip_adapter": [REF(scale=math.inf)]}).encode(), "invalid_json"),
    # several pictures for one edit (issue 30): these models take one, so ``images`` is refused whatever it holds
    "images on tiny": ({**TINY, "images": [P64, P64]}, "images"),
    "images on the inpainting model": ({**TINY, "model": "tiny-inpaint", "images": [P64], "mask": L64}, "images"),
    "an empty images list": ({**TINY, "images": []}, "images"),
    "images as a string": ({**TINY, "images": P64}, "images"),
    "an images entry of another type": ({**TINY, "images": [7]}, "images[0]"),
    "1e999 start": (json.dumps({**TINY, "control": [EDGES]}).replace('"image"', '"start": 1e999, "image"', 1).encode(),
                    "control[0].start"),
}


@pytest.mark.parametrize("name", COMBINED)
def test_the_new_features_together_run_or_are_a_400_naming_the_field(sock: Path, name: str) -> None:
    body, field = COMBINED[name]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, headers, raw = call(sock, "POST", "/v1/jobs", data, {"Content-Type": "application/json"})
    answer = check_answer("POST", "/v1/jobs", status, headers, raw, name)
    if field is None:
        assert status == 202, answer
        job = wait_job(sock, answer["id"])
        assert job["status"] == "succeeded", job.get("error")
    elif field == "invalid_json":
        assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    else:
        assert status == 400 and answer["error"]["field"] == field, answer
        assert len(answer["error"]["message"]) < 400, "a message a person reads, not the input echoed back"


def test_a_client_that_leaves_an_event_stream_leaves_no_traceback(sock: Path, fuzz_daemon: Daemon,
                                                                  real_job: str) -> None:
    """A HEAD of a finished job's events (the client reads the headers and closes): the stream's next
    write raised ConnectionResetError, which the daemon took for a bug of its own, an ERROR with a
    traceback each time (found by scripts/fuzz.py's ``urls`` family)."""
    import socket

    offset = fuzz_daemon.log_path.stat().st_size
    for _ in range(20):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(sock))
        c.sendall(f"HEAD /v1/jobs/{real_job}/events HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        assert c.recv(4096).startswith(b"HTTP/1.1 200")
        c.close()
    assert call_json(sock, "GET", "/health")[0] == 200
    with open(fuzz_daemon.log_path, "rb") as f:
        f.seek(offset)
        new = f.read().decode(errors="replace")
    assert "Traceback" not in new and "unexpected error" not in new, new[-3000:]


# sleep levels: the daemon test (test_daemon_lifecycle) sends a few; any other query or body is a 400 on
# `level` or an INVALID_JSON 400, never anything else, without putting a daemon to sleep (fuzz family)
SLEEP_BODIES = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda v: json.dumps({"level": v}).encode(),
              st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=4), st.none(),
                        st.booleans(), st.lists(st.integers(), max_size=2))),
)


@settings(max_examples=400, deadline=None)
@given(query=st.one_of(st.none(), st.text(max_size=12)), body=SLEEP_BODIES)
def test_any_sleep_level_is_1_2_or_a_400(query: str | None, body: bytes) -> None:
    from diffusiond.daemon.edge.api import sleep_level
    from diffusiond.daemon.errors import InvalidRequest

    try:
        level = sleep_level(query, body)
    except InvalidRequest as exc:
        assert exc.field in ("level", None), exc.field
        return
    assert level in (1, 2)
    assert query in ("1", "2") or (query is None and (not body.strip() or json.loads(body).get("level", 1) == level))


def test_daemon_is_healthy_after_the_targeted_inputs(sock: Path, fuzz_daemon: Daemon) -> None:
    """Runs last in this module (pytest keeps file order), as test_fuzz_http.py's own check does."""
    assert_healthy_after_fuzzing(sock, fuzz_daemon)
