"""Property-based fuzzing of the HTTP API against one real daemon (issue 7).

Hypothesis generates JSON bodies that mix the real field names with values of every type (huge
and negative numbers, NaN, unicode, null, nested lists and objects), undecodable garbage, random
Content-Type values, and random methods and paths under ``/v1/``. Every answer must be a
deliberate one: below 500 (a valid body may run, so 2xx is fine, and a synchronous request whose
``timeout_s`` is tiny may end 504 with ``deadline_exceeded``), every error in the one JSON shape
``{"error": {"code", "message"}}``, and an accepted job must be within the configured limits.
After the fuzzing the daemon must be healthy, its log free of unhandled exceptions, and a normal
job must succeed. Requests must not reach files: model names and job or output ids that look like
paths are unknown names (404), never paths.

The daemon runs with small limits (size 128, n 4, steps 8, frames 8) so that whatever valid body
Hypothesis finds is cheap to run; accepted jobs are cancelled at once. The requests go through a
bare ``http.client`` over the socket, which sends header values and paths as given.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
from daemonkit import Daemon, shared_daemon
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

CONFIG = """
[[models]]
name = "fz"
spec = "synthetic:compute_ms=50"

[[models]]
name = "fv"
spec = "synthetic:task=video,compute_ms=50"

[[models]]
name = "tiny"
spec = "tiny"

[limits]
max_size = 128
max_n = 4
max_steps = 8
max_frames = 8
"""
LIMITS = {"max_size": 128, "max_n": 4, "max_steps": 8, "max_frames": 8}
SYNC_PATHS = ("/v1/images/generations", "/v1/images/edits")
MODELS = ("fz", "fv", "tiny")
LORAS = ("ink", "dots")
MAX_LORAS = 2
# 150 examples per test in the suite; FUZZ_EXAMPLES=5000 for a longer hunt
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
TIMEOUT_S = 30.0  # a valid body's job at these limits takes well under a second


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("diffusiond", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def call(sock: Path, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = UnixHTTPConnection(str(sock), TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def call_json(sock: Path, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    status, _, raw = call(sock, method, path, data, {"Content-Type": "application/json"})
    return status, json.loads(raw)


def check_answer(method: str, path: str, status: int, headers: dict[str, str], data: bytes,
                 sent: Any = None) -> Any:
    """The properties every answer must have; returns the parsed body (None if not JSON)."""
    where = f"{method} {path!r} {sent!r} -> {status} {data[:300]!r}"
    body: Any = None
    if method != "HEAD" and headers.get("content-type", "").startswith("application/json"):
        body = json.loads(data)
    if status >= 400 and method != "HEAD":
        assert headers.get("content-type", "").startswith("application/json"), where
        assert isinstance(body, dict) and set(body) == {"error"}, where
        err = body["error"]
        assert isinstance(err, dict) and isinstance(err.get("code"), str) and err["code"], where
        assert isinstance(err.get("message"), str) and err["message"], where
    if status == 504:  # a valid synchronous request with a deadline shorter than its job
        assert path in SYNC_PATHS and body["error"]["code"] == "deadline_exceeded", where
    else:
        assert status < 500, where
        assert 200 <= status < 300 or status in (400, 404, 405, 409, 413, 429), where
    return body


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
                lora_files: dict[str, Path], controlnet_dir: Path, ip_adapter_file: Path,
                upscaler_file: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("fuzz")
    # ink fits tiny and not the synthetic models: a request may be refused for either reason; esr runs in tiles
    # of 32, so the fuzzed sizes (56 to 136, odd ones too) upscale in tiles whose last one is moved back
    (tmp / "diffusiond.toml").write_text(f"max_loras = {MAX_LORAS}\n{CONFIG}\n[loras]\n"
                                         f'ink = "{lora_files["ink"]}"\ndots = "{lora_files["dots"]}"\n'
                                         f'[controlnets]\nedges = "{controlnet_dir}"\n'
                                         f'[ip_adapters]\nstyle = "{ip_adapter_file}"\n'
                                         f'[upscalers.esr]\npath = "{upscaler_file}"\ntile = 32\noverlap = 8\n')
    (tmp / "inputs").mkdir()
    (tmp / "inputs" / "in.png").write_bytes(PNG_64)  # for image_path; nothing else is readable
    args = ["--config", str(tmp / "diffusiond.toml"), "--retention-s", "30", "--job-timeout", "60", "--max-batch", "4",
            "--input-dir", str(tmp / "inputs")]
    with shared_daemon(tmp, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d


@pytest.fixture(scope="module")
def sock(fuzz_daemon: Daemon) -> Path:
    return fuzz_daemon.socket


@pytest.fixture(scope="module")
def real_job(sock: Path) -> str:
    """A finished job, so generated paths can reach its outputs and events."""
    status, job = call_json(sock, "POST", "/v1/jobs", {"model": "fz", "prompt": "real", "width": 64, "height": 64,
                                                      "steps": 1})
    assert status == 202, job
    deadline = time.monotonic() + 60
    while job["status"] not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = call_json(sock, "GET", f"/v1/jobs/{job['id']}")[1]
    assert job["status"] == "succeeded", job
    return str(job["id"])


def cancel_if_accepted(sock: Path, status: int, body: Any) -> None:
    """Accepted jobs are cancelled at once: the fuzzing must not pile up work."""
    if status == 202:
        code, answer = call_json(sock, "DELETE", f"/v1/jobs/{body['id']}")
        assert code in (200, 409), answer


# strategies -----------------------------------------------------------------------------------
INTERESTING: list[Any] = [
    "", " ", "64", "64x64", "128x128", "auto", "npy", "png", "jpeg", "webp", "mp4", "gif", "float32", "float16",
    "uint8", "bfloat16", "euler", "flow-match", "../../etc/passwd", "/etc/passwd", "tiny/../x", "\x00", "\u202e",
    "ﬀ", "💥", "%s%n", "${jndi:x}", 0, -1, 1, 7, 8, 64, 65, 128, 136, 4096, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63),
    10**30, 0.5, -0.0, 1e-300, 1e308, math.inf, -math.inf, math.nan, True, False, None,
]
scalars = st.one_of(
    st.sampled_from(INTERESTING),
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),
    st.text(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=8)

JOB_FIELDS = ["prompt", "model", "n", "width", "height", "size", "steps", "guidance_scale", "negative_prompt", "seed",
              "output_format", "output_dtype", "num_frames", "fps", "timeout_s", "scheduler", "noise_level", "eta",
              "image", "image_path", "mask", "mask_path", "strength", "loras",
              "preview", "keep_alive", "control", "ip_adapter", "trajectory", "upscale", "hires"]
EDIT_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
               "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "strength", "quality",
               "background", "input_fidelity", "user", "ip_adapter"]
IMAGE_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
                "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "quality", "style",
                "user", "background", "moderation", "output_compression", "stream", "partial_images", "loras",
                "preview"]


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, (40, 120, 200, 0)[: len(mode)] if mode != "L" else 255).save(buf, format="PNG")
    return buf.getvalue()


PNG_64, PNG_72, MASK_64, MASK_72 = _png((64, 64)), _png((72, 64)), _png((64, 64), "RGBA"), _png((72, 72), "RGBA")
IMAGE_BYTES = [PNG_64, PNG_72, MASK_64, MASK_72, b"", b"\x89PNG\r\n\x1a\n", PNG_64[:40], b"GIF89a", b"\0" * 64,
               _png((4000, 10), "L"), _png((60, 60))]
# plausible values per field, so that many bodies get past decoding into the range checks
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.text(max_size=30) | st.sampled_from(["a fox", " ", "x" * 10_001]),
    "model": st.sampled_from([*MODELS, None, "../../etc/passwd", "/etc/passwd", "tiny/../x", "TINY", ""]),
    "n": st.integers(min_value=-1, max_value=6),
    "width": st.sampled_from([56, 63, 64, 72, 128, 129, 136, 0, -64]),
    "height": st.sampled_from([56, 64, 72, 128, 136]),
    "size": st.sampled_from(["64x64", "128x72", "72x128", "136x64", "64x", "x64", "64X64", "auto", "0x0",
                             "64x64x64", " 64x64"]),
    "steps": st.integers(min_value=-1, max_value=9),
    "num_inference_steps": st.integers(min_value=-1, max_value=9),
    "guidance_scale": st.floats(min_value=-1, max_value=101) | st.sampled_from([math.nan, math.inf]),
    "seed": st.integers(min_value=-1, max_value=2**64),
    "output_format": st.sampled_from(["png", "jpeg", "webp", "npy", "mp4", "gif", "bmp", "PNG", ""]),
    "output_dtype": st.sampled_from(["uint8", "float16", "float32", "bfloat16", "int64"]),
    "num_frames": st.integers(min_value=-1, max_value=9),
    "fps": st.integers(min_value=-1, max_value=241),
    "timeout_s": st.sampled_from([0, 0.0001, 0.001, 0.01, 5.0, -1.0, 1e9, math.nan]),
    "scheduler": st.sampled_from(["euler", "euler-a", "dpm++", "ddim", "unipc", "flow-match", "flow-sde", "bogus", ""]),
    # issue 29: the stochastic samplers' noise, in and out of range, with and without their scheduler
    "noise_level": st.floats(min_value=-1, max_value=3) | st.sampled_from([0, 2, 1e-9, math.nan, math.inf, -0.0]),
    "eta": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, math.nan, math.inf, -0.0]),
    "response_format": st.sampled_from(["b64_json", "url", "file", ""]),
    "loras": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from([*LORAS, "nope", "", "../ink", "INK"])},
        optional={"weight": st.floats(min_value=-5, max_value=5) | st.sampled_from([0, 4, -4, math.nan, math.inf])},
    ), max_size=3),
    # ControlNets: known and unknown names, images good and bad, scales and step ranges in and out of range
    "control": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["edges", "nope", "", "EDGES", "../edges"])},
        optional={"image": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode())
                  | st.sampled_from(["", "%%%"]) | values,
                  "image_path": st.sampled_from(["in.png", "../in.png", "/dev/zero", ""]),
                  "scale": st.floats(min_value=-1, max_value=5) | st.sampled_from([0, 4, math.nan, math.inf]),
                  "start": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, math.nan]),
                  "end": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, math.inf]),
                  "preprocess": st.sampled_from(["none", "canny", "depth", ""]) | values},
    ), max_size=3) | values,
    # IP-Adapters: the served one and others, reference images good and bad, scales in and out of range
    "ip_adapter": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["style", "nope", "", "STYLE"])},
        optional={"image": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode())
                  | st.sampled_from(["", "%%%"]) | values,
                  "image_path": st.sampled_from(["in.png", "../in.png", "/dev/zero", ""]),
                  "scale": st.floats(min_value=-1, max_value=5) | st.sampled_from([0, 4, math.nan, math.inf])},
    ), max_size=2) | values,
    # issue 30: an upscaler known or not at scales in and out of range; a hires pass on models with and without
    # image-to-image, its sizes past the limits
    "upscale": st.fixed_dictionaries({"name": st.sampled_from(["esr", "nope", "", "ESR"]) | values}, optional={
        "scale": st.floats(min_value=-1, max_value=10) | st.sampled_from([1, 2, 8, 9, math.nan, math.inf]) | values,
    }) | values,
    "hires": st.fixed_dictionaries({}, optional={
        "scale": st.floats(min_value=0, max_value=5) | st.sampled_from([1, 1.5, 2, 4, math.nan, math.inf]) | values,
        "strength": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, 1e-9, math.nan]) | values,
        "steps": st.integers(min_value=-1, max_value=9) | values,
        "upscaler": st.sampled_from(["esr", "nope", ""]) | values,
    }) | values,
    "preview": st.fixed_dictionaries({}, optional={
        "every": st.integers(min_value=-1, max_value=10) | values,
        "format": st.sampled_from(["jpeg", "webp", "png", "gif", "JPEG", ""]) | values,
        "max_side": st.sampled_from([0, 15, 16, 64, 256, 1024, 1025, -1]) | values,
    }) | values,
    "image": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode())
    | st.sampled_from(["", "%%%", "data:image/png;base64," + base64.b64encode(PNG_64).decode(), "AAAA"]),
    "mask": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode()),
    "image_path": st.sampled_from(["in.png", "../in.png", "/etc/passwd", "", ".", "/dev/zero", "in.png\x00"]),
    "mask_path": st.sampled_from(["in.png", "/etc/shadow", "..", "x/../../y"]),
    "keep_alive": st.sampled_from(["10m", "0", "-1", "1h30m", "250ms", "5 m", "m5", "", "1e400s", "9" * 5000,
                                   0, -1, 2.5, 1e309, True, None, [], {"s": 1}]),
    "strength": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, 0.5, math.nan, 1e-9]),
    # issue 29: what of the run each output carries back; only under a stochastic sampler
    "trajectory": st.fixed_dictionaries({}, optional={
        "latents": st.booleans() | values, "log_probs": st.booleans() | values,
        "dtype": st.sampled_from(["float32", "bfloat16", "float16", "float64", "uint8", ""]) | values,
    }) | values,
}


def valid_base(fields: list[str], model: str) -> dict[str, Any]:
    """A body the daemon accepts, for the endpoint whose fields are ``fields``."""
    if "num_inference_steps" in fields:  # OpenAI's bodies (/v1/jobs takes size too, beside width and height)
        return {"prompt": "a fox", "model": model, "size": "64x64", "num_inference_steps": 2,
                **({"output_format": "webp"} if model == "fv" else {})}
    return {"prompt": "a fox", "model": model, "width": 64, "height": 64, "steps": 2,
            **({"num_frames": 4} if model == "fv" else {})}


@st.composite
def bodies(draw: st.DrawFn, fields: list[str]) -> Any:
    """A third: a valid body with a field or two changed (plausible or wild values); a half: an
    object built from the real field names with plausible or wild values; the rest: any JSON."""
    mode = draw(st.integers(0, 5))
    if mode == 0:
        return draw(values)
    if mode <= 2:
        body = valid_base(fields, draw(st.sampled_from(MODELS)))
        names = draw(st.lists(st.sampled_from(fields), unique=True, max_size=2))
    else:
        body = {}
        names = draw(st.lists(st.sampled_from(fields), unique=True, max_size=len(fields)))
    for name in names:
        plausible = PLAUSIBLE.get(name)
        body[name] = draw(plausible if plausible is not None and draw(st.booleans()) else values)
    if mode > 2 and draw(st.booleans()):
        body["prompt"] = draw(PLAUSIBLE["prompt"])
    if draw(st.integers(0, 5)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=10), values, max_size=2)))
    return body


header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
content_types = st.one_of(
    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                     "application/json; charset=utf-16", "application/json; charset=latin-1", "*/*", ""]),
    header_values,
)


def within_limits(job: dict[str, Any]) -> None:
    """What an accepted job asked for is inside the configured limits."""
    r = job["request"]
    assert 1 <= r["n"] <= LIMITS["max_n"], job
    for side in ("width", "height"):
        assert 64 <= r[side] <= LIMITS["max_size"] and r[side] % 8 == 0, job
    assert 1 <= r["steps"] <= LIMITS["max_steps"], job
    assert r["num_frames"] is None or 1 <= r["num_frames"] <= LIMITS["max_frames"], job
    assert job["model"] in MODELS and r["prompt"].strip(), job
    # issue 29: each noise only with its scheduler, and in its range
    assert r["noise_level"] is None or (r["scheduler"] == "flow-sde" and 0 < r["noise_level"] <= 2), job
    assert r["eta"] is None or (r["scheduler"] == "ddim" and 0 < r["eta"] <= 1), job
    t = r["trajectory"]
    assert t is None or ((t["latents"] or t["log_probs"]) and t["dtype"] in ("float32", "bfloat16", "float16")
                         and (r["scheduler"] == "flow-sde" or (r["scheduler"] == "ddim" and r["eta"]))), job
    assert len(r["loras"]) <= MAX_LORAS and len({e["name"] for e in r["loras"]}) == len(r["loras"]), job
    assert all(e["name"] in LORAS and -4 <= e["weight"] <= 4 for e in r["loras"]), job
    assert not r["loras"] or job["model"] == "tiny", job  # the synthetic models take no LoRA
    for c in r["control"]:  # ControlNets: served, in range, on the one model they fit
        assert c["name"] == "edges" and job["model"] == "tiny", job
        assert 0 <= c["scale"] <= 4 and 0 <= c["start"] < c["end"] <= 1 and c["preprocess"] in ("none", "canny"), job
    assert not (r["control"] and r["task"]), job  # ControlNets with an edit are refused, with a reference or not
    for a in r["ip_adapter"]:  # IP-Adapters: served, in range, on the one model it fits (with control or an edit)
        assert a["name"] == "style" and job["model"] == "tiny", job
        assert 0 <= a["scale"] <= 4 and len(a["image_digest"]) == 24 and len(r["ip_adapter"]) == 1, job
    u, h = r["upscale"], r["hires"]  # issue 30: served upscalers, image-to-image models, sizes in their bounds
    assert u is None or (u["name"] == "esr" and 1 <= u["scale"] <= 8 and u["width"] <= 16384), job
    assert h is None or (job["model"] == "tiny" and h["upscaler"] in (None, "esr") and 0 < h["strength"] <= 1
                         and max(h["width"], h["height"]) <= LIMITS["max_size"] and h["steps"] >= 1), job
    p = r["preview"]
    if p is not None:
        assert job["model"] == "tiny", job  # the synthetic models have no preview decoder
        assert 1 <= p["every"] <= r["steps"] and p["format"] in ("jpeg", "webp", "png"), job
        assert 16 <= p["max_side"] <= 1024, job


# fuzz tests -----------------------------------------------------------------------------------
@FUZZ
@given(body=bodies(JOB_FIELDS), content_type=content_types)
def test_fuzz_job_bodies(sock: Path, body: Any, content_type: str) -> None:
    data = json.dumps(body).encode()
    status, headers, raw = call(sock, "POST", "/v1/jobs", data, {"Content-Type": content_type})
    answer = check_answer("POST", "/v1/jobs", status, headers, raw, body)
    event(f"HTTP {status}")
    if status == 202:
        within_limits(answer)
    cancel_if_accepted(sock, status, answer)


@st.composite
def combined_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with a reference image (``ip_adapter``) and control images or an edit's image and
    mask, or both (refused): plausible values, so many get past decoding into the pairing rules."""
    png64, mask64 = base64.b64encode(PNG_64).decode(), base64.b64encode(MASK_64).decode()
    valid: dict[str, Any] = {"ip_adapter": [{"name": "style", "image": png64, "scale": 0.5}],
                             "control": [{"name": "edges", "image": png64}], "image": png64, "mask": mask64,
                             "strength": 0.5, "hires": {"scale": 1.5, "steps": 1}}
    body = valid_base(JOB_FIELDS, "tiny")
    for name in ["ip_adapter", *draw(st.lists(st.sampled_from(list(valid)[1:]), min_size=1, unique=True))]:
        body[name] = valid[name] if draw(st.booleans()) else draw(PLAUSIBLE[name])
    return body


@FUZZ
@given(body=combined_bodies())
def test_fuzz_job_bodies_with_a_reference_and_control_or_an_edit(sock: Path, body: Any) -> None:
    data = json.dumps(body).encode()
    status, headers, raw = call(sock, "POST", "/v1/jobs", data, {"Content-Type": "application/json"})
    answer = check_answer("POST", "/v1/jobs", status, headers, raw, body)
    event(f"HTTP {status}")
    if status == 202:
        within_limits(answer)
    cancel_if_accepted(sock, status, answer)


@FUZZ
@given(body=bodies(IMAGE_FIELDS))
def test_fuzz_images_bodies(sock: Path, body: Any) -> None:
    data = json.dumps(body).encode()
    status, headers, raw = call(sock, "POST", "/v1/images/generations", data, {"Content-Type": "application/json"})
    answer = check_answer("POST", "/v1/images/generations", status, headers, raw, body)
    event(f"HTTP {status}")
    if status == 200:
        assert isinstance(answer["data"], list) and answer["data"], answer


@FUZZ
@given(data=st.binary(max_size=300) | st.text(max_size=100).map(str.encode),
       path=st.sampled_from(["/v1/jobs", "/v1/images/generations", "/v1/images/edits"]), content_type=content_types)
def test_fuzz_garbage_bodies(sock: Path, data: bytes, path: str, content_type: str) -> None:
    status, headers, raw = call(sock, "POST", path, data, {"Content-Type": content_type})
    answer = check_answer("POST", path, status, headers, raw, data)
    event(f"HTTP {status}")
    cancel_if_accepted(sock, status, answer)


@st.composite
def edit_forms(draw: st.DrawFn) -> tuple[bytes, str, Any]:
    """A multipart body for /v1/images/edits: text fields from the real names with plausible or
    wild values (as text, as a form sends them), image and mask parts that are images, images of
    the wrong size, or junk; now and then a part without a name, a broken boundary or a cut body."""
    boundary = draw(st.sampled_from(["b0und", "x" * 70, "--", "a b"]))
    parts: list[bytes] = []
    fields: dict[str, Any] = {}
    base = {"prompt": "a fox", "model": "tiny", "size": "64x64", "num_inference_steps": "4", "strength": "0.5"}
    names = draw(st.lists(st.sampled_from(EDIT_FIELDS), unique=True, max_size=3))
    if draw(st.booleans()):
        fields.update(base)
    for name in names:
        plausible = PLAUSIBLE.get(name)
        fields[name] = draw(plausible if plausible is not None and draw(st.booleans()) else values)
    for name, value in fields.items():
        text = value if isinstance(value, str) else json.dumps(value)
        parts.append(f'Content-Disposition: form-data; name="{name}"\r\n\r\n{text}'.encode(errors="replace"))
    files = draw(st.lists(st.sampled_from(["image", "image[]", "mask", "other", ""]), max_size=3))
    if "prompt" in fields and draw(st.booleans()):  # a valid start: an image that fits
        parts.append(b'Content-Disposition: form-data; name="image"; filename="f.png"\r\n\r\n' + PNG_64)
    for name in files:
        data = draw(st.sampled_from(IMAGE_BYTES))
        parts.append(f'Content-Disposition: form-data; name="{name}"; filename="f.png"\r\n'
                     f"Content-Type: image/png\r\n\r\n".encode() + data)
    body = b"".join(b"--" + boundary.encode() + b"\r\n" + p + b"\r\n" for p in parts) + f"--{boundary}--\r\n".encode()
    cut = draw(st.sampled_from([None, None, None, 0, 10, len(body) // 2, len(body) - 3]))
    if cut is not None:
        body = body[:cut]
    ctype = draw(st.sampled_from([f"multipart/form-data; boundary={boundary}",
                                  f'multipart/form-data; boundary="{boundary}"', "multipart/form-data",
                                  "multipart/mixed; boundary=zz", "application/json"]))
    return body, ctype, fields


@FUZZ
@given(form=edit_forms())
def test_fuzz_edit_forms(sock: Path, form: tuple[bytes, str, Any]) -> None:
    body, ctype, fields = form
    status, headers, raw = call(sock, "POST", "/v1/images/edits", body, {"Content-Type": ctype})
    answer = check_answer("POST", "/v1/images/edits", status, headers, raw, fields)
    event(f"HTTP {status}")
    if status == 200:
        assert isinstance(answer["data"], list) and answer["data"], answer
    elif status == 400:
        assert answer["error"]["code"] in ("invalid_request", "invalid_image", "invalid_json"), answer


SEGMENTS = ["v1", "jobs", "images", "generations", "models", "outputs", "events", "preview", "admin", "health",
            "metrics", "0", "1", "-1", "99999999999999999999", "..", ".", "%2e%2e", "..%2F..%2Fetc", "%2F", "%00",
            "etc", "passwd", "j_0000000000000000", "", "~", "%", "%zz", "%ff", "?", "#", ";", "*"]


ROUTES = ["/v1/jobs", "/v1/jobs/{id}", "/v1/jobs/{id}/events", "/v1/jobs/{id}/outputs/{k}",
          "/v1/jobs/{id}/outputs/{k}/trajectory/{k}", "/v1/jobs/{id}/outputs/0/trajectory/{k}",
          "/v1/jobs/{id}/preview/{k}", "/v1/models",
          "/v1/images/generations", "/v1/images/edits", "/v1/admin/{k}", "/v1/loras",
          "/v1/controlnets", "/v1/ip-adapters", "/v1/upscalers"]


@st.composite
def paths(draw: st.DrawFn, job_id: str) -> str:
    """Half: a real route with its ids replaced (the real job, traversal, junk); half: any segments."""
    segment = st.sampled_from([*SEGMENTS, job_id]) | st.text(max_size=12).map(quote)
    if draw(st.booleans()):
        path = draw(st.sampled_from(ROUTES)).format(id=draw(segment), k=draw(segment))
    else:
        path = "/v1/" + "/".join(draw(st.lists(segment, max_size=5)))
    if draw(st.booleans()):
        path += "?" + quote(draw(st.text(max_size=20)), safe="=&")
    low = unquote(path).lower()
    assume("sleep" not in low and "wake" not in low)  # admin power commands are tested elsewhere
    return path


# Methods HTTP knows. A token the HTTP parser does not know ("FOO") is refused by aiohttp's parser
# before any routing, with a plain-text 400: see test_unknown_method_is_refused_by_the_parser.
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "PROPFIND", "SEARCH", "PURGE"]


@FUZZ
@given(data=st.data())
def test_fuzz_methods_paths_and_headers(sock: Path, real_job: str, data: st.DataObject) -> None:
    method = data.draw(st.sampled_from(METHODS))
    path = data.draw(paths(real_job))
    assume(not (method == "DELETE" and real_job in path))  # keep the real job for the other examples
    headers = {"Content-Type": data.draw(content_types)}
    for name in data.draw(st.lists(st.sampled_from(["Accept", "X-Foo", "Authorization", "User-Agent", "Range",
                                                    "If-None-Match", "Accept-Encoding"]), unique=True, max_size=3)):
        headers[name] = data.draw(header_values)
    body = data.draw(st.none() | st.binary(max_size=64))
    status, got, raw = call(sock, method, path, body, headers)
    answer = check_answer(method, path, status, got, raw, (headers, body))
    event(f"HTTP {status}")
    cancel_if_accepted(sock, status, answer)


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


def test_scheduler_names_checked_at_admission_are_the_pipelines() -> None:
    from diffusiond import protocol
    from diffusiond.pipelines.diffusers_pipeline import FLOW_SCHEDULERS, SCHEDULERS

    assert set(protocol.SCHEDULERS) == set(SCHEDULERS) and set(protocol.FLOW_SCHEDULERS) == set(FLOW_SCHEDULERS)


# issue 26: inputs that were 500s -----------------------------------------------------------------
# Each is a regression test (the defect's own input) and a family for the fuzzers above: a new
# field or listener behaviour gets its cases here in the same change.
JSON = {"Content-Type": "application/json"}
BOMB_SIDE = 30000  # 900 MP: past Pillow's own bound (179 MP), which used to fire before the daemon's


def _chunk(kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb(fmt: str, side: int = BOMB_SIDE) -> bytes:
    """A small file whose header claims ``side`` x ``side`` pixels, in each format that has one."""
    import struct
    import zlib

    if fmt == "png":
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
                + _chunk(b"IDAT", zlib.compress(b"\0" * 100)) + _chunk(b"IEND", b""))
    if fmt == "bmp":
        return b"BM" + struct.pack("<IHHI", 0, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, side, side, 1, 24, 0, 0,
                                                                       0, 0, 0, 0)
    if fmt == "gif":
        return base64.b64decode("R0lGODlh/////4AAAAAAAP///ywAAAAA/////wACAkQBADs=")  # the issue's own: 65535 a side
    if fmt == "jpeg":
        sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, side, side, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
        sos = b"\xff\xda\x00\x0c\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00"
        return b"\xff\xd8" + sof + sos + b"\0" * 64 + b"\xff\xd9"
    if fmt == "webp":
        side = min(side, 16383)  # WebP's own limit: 268 MP
        body = b"WEBPVP8X" + struct.pack("<I", 10) + b"\0" * 4 + (side - 1).to_bytes(3, "little") * 2
        return b"RIFF" + struct.pack("<I", len(body)) + body
    assert fmt == "tiff"
    tags = [(256, 4, side), (257, 4, side), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8), (277, 3, 1),
            (278, 4, side), (279, 4, 1)]
    ifd = b"".join(struct.pack("<HHII", t, k, 1, v) if k == 4 else struct.pack("<HHIHH", t, k, 1, v, 0)
                   for t, k, v in tags)
    return b"II*\0" + struct.pack("<I", 8) + struct.pack("<H", len(tags)) + ifd + b"\0\0\0\0"


def picture(fmt: str, mode: str, size: tuple[int, int] = (64, 64), **save: Any) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format=fmt, **save)
    return buf.getvalue()


def multipart(fields: list[tuple[bytes, bytes, bool]], boundary: str = "b0und") -> tuple[bytes, dict[str, str]]:
    """A multipart body of (name, value, is_file) parts, names as raw bytes."""
    parts = []
    for name, value, is_file in fields:
        disposition = b'Content-Disposition: form-data; name="' + name + b'"' + (b'; filename="f"' if is_file else b"")
        parts.append(b"--" + boundary.encode() + b"\r\n" + disposition + b"\r\n\r\n" + value + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


EDIT_TEXT = [(b"prompt", b"x", False), (b"model", b"tiny", False), (b"size", b"64x64", False),
             (b"num_inference_steps", b"2", False)]


def refused(status: int, headers: dict[str, str], raw: bytes, field: str | None, code: str | None = None,
            statuses: tuple[int, ...] = (400,)) -> dict[str, Any]:
    answer = check_answer("POST", "?", status, headers, raw)
    assert status in statuses, (status, answer)
    if field is not None:
        assert answer["error"].get("field") == field, answer
    if code is not None:
        assert answer["error"]["code"] == code, answer
    return dict(answer["error"])


@pytest.mark.parametrize("fmt", ["png", "bmp", "gif", "jpeg", "webp", "tiff"])
@pytest.mark.parametrize("where", ["image", "mask", "multipart", "multipart-mask", "image_path"])
def test_an_image_header_past_pillows_bound_is_a_400_naming_the_field(sock: Path, fmt: str, where: str) -> None:
    data = bomb(fmt)
    if where in ("image", "mask"):
        body = {"prompt": "x", "model": "tiny", "width": 64, "height": 64, "steps": 2,
                "image": base64.b64encode(data if where == "image" else PNG_64).decode()}
        if where == "mask":
            body["mask"] = base64.b64encode(data).decode()
        status, headers, raw = call(sock, "POST", "/v1/jobs", json.dumps(body).encode(),
                                    {"Content-Type": "application/json"})
        field = where
    elif where == "image_path":
        (sock.parent / "inputs" / f"bomb.{fmt}").write_bytes(data)
        body = {"prompt": "x", "model": "tiny", "steps": 2, "image_path": f"bomb.{fmt}"}
        status, headers, raw = call(sock, "POST", "/v1/jobs", json.dumps(body).encode(),
                                    {"Content-Type": "application/json"})
        field = "image_path"
    else:
        files = [(b"image", data, True)] if where == "multipart" else [(b"image", PNG_64, True), (b"mask", data, True)]
        form, headers_out = multipart(EDIT_TEXT + files)
        status, headers, raw = call(sock, "POST", "/v1/images/edits", form, headers_out)
        field = "image" if where == "multipart" else "mask"
    err = refused(status, headers, raw, field, "invalid_image")
    if fmt != "webp":  # libwebp will not open a header without a picture: refused as undecodable, not by size
        assert f"{BOMB_SIDE if fmt != 'gif' else 65535}x" in err["message"] and "16777216" in err["message"], err


def _other_formats() -> list[tuple[str, bytes]]:
    out = [("qoi", b"qoif" + b"\0\0\0\x40\0\0\0\x40\x03\x00" + b"\0" * 32), ("dds", picture("DDS", "RGBA")),
           ("spider", picture("SPIDER", "F")), ("ico", picture("ICO", "RGBA")), ("psd", b"8BPS\0\1" + b"\0" * 40),
           ("pdf", b"%PDF-1.4\n"), ("tga", picture("TGA", "RGB")), ("pcx", picture("PCX", "RGB")),
           ("ppm", picture("PPM", "RGB"))]
    return out


@pytest.mark.parametrize(("name", "data"), _other_formats())
def test_a_format_outside_the_allow_list_is_refused_as_invalid_image(sock: Path, name: str, data: bytes) -> None:
    body = {"prompt": "x", "model": "tiny", "width": 64, "height": 64, "steps": 2,
            "image": base64.b64encode(data).decode()}
    status, headers, raw = call(sock, "POST", "/v1/jobs", json.dumps(body).encode(), JSON)
    err = refused(status, headers, raw, "image", "invalid_image")
    assert "PNG, JPEG, WebP, GIF, BMP or TIFF" in err["message"], err


MODES = [("TIFF", "LAB", {}), ("JPEG", "CMYK", {}), ("PNG", "I;16", {}), ("TIFF", "I;16", {}), ("TIFF", "F", {}),
         ("TIFF", "I", {}), ("PNG", "P", {"transparency": 0}), ("PNG", "1", {}), ("GIF", "P", {}), ("TIFF", "CMYK", {}),
         ("TIFF", "YCbCr", {}), ("PNG", "LA", {}), ("BMP", "RGB", {}), ("WEBP", "RGBA", {}), ("TIFF", "RGBA", {})]


@pytest.mark.parametrize(("fmt", "mode", "save"), MODES, ids=[f"{f}-{m}" for f, m, _ in MODES])
def test_every_mode_of_the_accepted_formats_is_converted_as_image_and_as_mask(sock: Path, fmt: str, mode: str,
                                                                              save: dict[str, Any]) -> None:
    data = base64.b64encode(picture(fmt, mode, **save)).decode()
    for body in ({"image": data}, {"image": base64.b64encode(PNG_64).decode(), "mask": data}):
        full = {"prompt": "x", "model": "tiny", "steps": 2, **body}
        status, headers, raw = call(sock, "POST", "/v1/jobs", json.dumps(full).encode(),
                                    {"Content-Type": "application/json"})
        answer = check_answer("POST", "/v1/jobs", status, headers, raw, (fmt, mode))
        assert status == 202, answer
        cancel_if_accepted(sock, status, answer)


@pytest.mark.parametrize("path", ["in.png\x00", "in.png\x00.png", "x" * 300, "a/" * 3000 + "in.png", "loop",
                                  "loop/in.png", "é" * 200, " ", ""])
@pytest.mark.parametrize("field", ["image_path", "mask_path"])
def test_a_path_no_file_can_have_is_a_400_naming_the_field(sock: Path, path: str, field: str) -> None:
    loop = sock.parent / "inputs" / "loop"
    if not loop.is_symlink():
        loop.symlink_to("loop")  # a symlink loop inside --input-dir
    body: dict[str, Any] = {"prompt": "x", "model": "tiny", "steps": 2, field: path}
    if field == "mask_path":
        body["image_path"] = "in.png"
    data = json.dumps(body).encode()  # a lone surrogate goes as its \\udcff escape
    status, headers, raw = call(sock, "POST", "/v1/jobs", data, {"Content-Type": "application/json"})
    refused(status, headers, raw, field)


@pytest.mark.parametrize("path", ["/v1/jobs?limit=" + "9" * 5000, "/v1/jobs?limit=1" + "0" * 4400,
                                  "/v1/jobs/{job}/outputs/" + "9" * 5000, "/v1/jobs/{job}/preview/" + "9" * 5000,
                                  "/v1/jobs/{job}/outputs/" + "0" * 4301, "/v1/jobs/{job}/outputs/9999999999"])
def test_an_index_or_limit_of_thousands_of_digits_is_a_400_naming_it(sock: Path, real_job: str, path: str) -> None:
    path = path.format(job=real_job)
    status, headers, raw = call(sock, "GET", path)
    answer = check_answer("GET", path[:80], status, headers, raw)
    assert status == 400, answer
    assert answer["error"]["field"] == ("limit" if "limit" in path else "k"), answer


@pytest.mark.parametrize(("path", "field"), [("/v1/jobs", "n"), ("/v1/jobs", "steps"), ("/v1/jobs", "seed"),
                                             ("/v1/jobs", "width"), ("/v1/jobs", "fps"),
                                             ("/v1/jobs", "noise_level"), ("/v1/jobs", "eta"),
                                             ("/v1/images/generations", "n"),
                                             ("/v1/images/generations", "num_inference_steps")])
@pytest.mark.parametrize("digits", [310, 400, 4000])
def test_a_json_integer_past_a_float_is_a_400_naming_the_field(sock: Path, path: str, field: str,
                                                               digits: int) -> None:
    body = b'{"prompt": "x", "model": "fz", "%s": 1%s}' % (field.encode(), b"0" * (digits - 1))
    status, headers, raw = call(sock, "POST", path, body, {"Content-Type": "application/json"})
    refused(status, headers, raw, field)


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/jobs", '{"prompt": "x", "loras": ' + DEEP + "}"), ("/v1/jobs", DEEP), ("/v1/jobs", '{"a":' * 5000 + "1"),
    ("/v1/images/generations", '{"prompt": "x", "user": ' + DEEP + "}"),
    ("/v1/images/generations", '{"prompt": "x", "quality": {"a": ' + DEEP + "}}"),
    ("/v1/loras", '{"name": ' + DEEP + "}")])
def test_json_nested_past_msgspecs_depth_is_a_400(sock: Path, path: str, body: str) -> None:
    status, headers, raw = call(sock, "POST", path, body.encode(), {"Content-Type": "application/json"})
    refused(status, headers, raw, None)


@pytest.mark.parametrize("name", [b"loras", b"preview"])
def test_nested_json_in_an_edit_forms_text_field_is_a_400_naming_it(sock: Path, name: bytes) -> None:
    form, headers_out = multipart([*EDIT_TEXT, (name, DEEP.encode(), False), (b"image", PNG_64, True)])
    status, headers, raw = call(sock, "POST", "/v1/images/edits", form, headers_out)
    refused(status, headers, raw, name.decode())


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "GZIP"])
@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/images/generations", "/v1/images/edits", "/v1/loras"])
def test_a_body_not_in_its_content_encoding_is_a_400(sock: Path, path: str, encoding: str) -> None:
    if path == "/v1/images/edits":
        body, headers_out = multipart([*EDIT_TEXT, (b"image", PNG_64, True)])
    else:
        body, headers_out = b'{"prompt": "x", "name": "n", "path": "/x"}', {"Content-Type": "application/json"}
    status, headers, raw = call(sock, "POST", path, body, {**headers_out, "Content-Encoding": encoding})
    err = refused(status, headers, raw, None)
    assert "Content-Encoding" in err["message"], err
    status, h = call_json(sock, "GET", "/health")
    assert status == 200, h


@pytest.mark.parametrize("name", ["nope", "..%2F..%2Fetc", "%00", "x" * 5000, "%ff%fe", "tiny%2F..", "%20"])
@pytest.mark.parametrize("verb", ["load", "unload"])
def test_a_move_by_hand_of_a_model_that_is_not_served_is_a_404_naming_it(sock: Path, name: str, verb: str) -> None:
    status, body = call_json(sock, "POST", f"/v1/models/{name}/{verb}")
    assert status == 404 and body["error"]["code"] in ("model_not_found", "not_found"), body


@pytest.mark.parametrize("value", ["10m", 0, -1, "1h30m", 30, "bogus", "9" * 5000, 1e308, True, [], {"s": 1}, "-5m"])
def test_keep_alive_is_taken_as_a_duration_or_refused_naming_it(sock: Path, value: Any) -> None:
    status, body = call_json(sock, "POST", "/v1/jobs", {"prompt": "a fox", "width": 64, "height": 64, "steps": 1,
                                                        "keep_alive": value})
    if status == 202:
        return
    assert status == 400 and body["error"]["field"] == "keep_alive", body


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "x-gzip"])
def test_a_compressed_json_body_is_read_as_its_content_encoding_says(sock: Path, encoding: str) -> None:
    import gzip
    import zlib

    body = json.dumps({"prompt": "a fox", "width": 64, "height": 64, "steps": 1}).encode()
    packed = zlib.compress(body) if encoding == "deflate" else gzip.compress(body)
    status, _, raw = call(sock, "POST", "/v1/jobs", packed,
                          {"Content-Type": "application/json", "Content-Encoding": encoding})
    assert status == 202, raw


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, deflate"])
def test_an_encoding_the_daemon_does_not_take_is_a_json_400_naming_it(sock: Path, encoding: str) -> None:
    status, headers, raw = call(sock, "POST", "/v1/jobs", b'{"prompt": "x"}',
                                {"Content-Type": "application/json", "Content-Encoding": encoding})
    err = refused(status, headers, raw, None)
    assert encoding.split(",")[0] in err["message"] and "uncompressed" in err["message"], err


def test_a_compressed_body_that_inflates_past_the_limit_is_a_413(sock: Path) -> None:
    import gzip

    bomb = gzip.compress(b'{"prompt": "' + b"a" * (64 << 20) + b'"}')  # 64 MiB inflated, about 64 KiB sent
    status, headers, raw = call(sock, "POST", "/v1/jobs", bomb,
                                {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 413 and headers.get("content-type", "").startswith("application/json"), (status, raw[:200])


@pytest.mark.parametrize("name", [b"pro\xffmpt", b"\xff", b"image\xfe", b"\xc3"])
def test_an_edit_form_field_name_that_is_not_utf8_is_a_400(sock: Path, name: bytes) -> None:
    form, headers_out = multipart([*EDIT_TEXT, (name, b"v", False), (b"image", PNG_64, True)])
    status, headers, raw = call(sock, "POST", "/v1/images/edits", form, headers_out)
    refused(status, headers, raw, None)


def test_lora_paths_and_headers_that_break_the_reader_are_400s_naming_the_file(sock: Path) -> None:
    import struct

    folder = sock.parent / "loras"
    folder.mkdir(exist_ok=True)
    deep, digits = folder / "deep.safetensors", folder / "digits.safetensors"
    for file, header in ((deep, b"[" * 100_000 + b"]" * 100_000),
                         (digits, b'{"a.lora_A.weight": {"shape": [1%s]}}' % (b"0" * 5000))):
        file.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    for path in ("/" + "x" * 5000, "/tmp/" + "y" * 300, "/tmp/" + "z/" * 3000, str(deep), str(digits)):
        status, answer = call_json(sock, "POST", "/v1/loras", {"name": "probe", "path": path})
        assert status == 400 and answer["error"]["field"] == "path", answer
        if path in (str(deep), str(digits)):
            assert path in answer["error"]["message"], answer


@st.composite
def mutated_images(draw: st.DrawFn) -> bytes:
    """A real file of an accepted format (some modes each, a bomb header now and then), with bytes
    flipped, cut or inserted: what a decoder meets from a broken upload or a hostile one."""
    fmt, mode = draw(st.sampled_from([("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "I;16"), ("JPEG", "RGB"),
                                      ("JPEG", "CMYK"), ("WEBP", "RGB"), ("GIF", "P"), ("BMP", "RGB"),
                                      ("TIFF", "LAB"), ("TIFF", "RGB"), ("BOMB", "")]))
    data = bytearray(bomb(draw(st.sampled_from(["png", "bmp", "gif", "jpeg", "tiff"]))) if fmt == "BOMB"
                     else _SEEDS[(fmt, mode)])
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        op = draw(st.integers(0, 2))
        if op == 0:
            data[at] = draw(st.integers(0, 255))
        elif op == 1:
            del data[at:at + draw(st.integers(1, 64))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


_SEEDS = {(f, m): picture(f, m, (64, 64)) for f, m in [
    ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "I;16"), ("JPEG", "RGB"), ("JPEG", "CMYK"), ("WEBP", "RGB"),
    ("GIF", "P"), ("BMP", "RGB"), ("TIFF", "LAB"), ("TIFF", "RGB")]}


@FUZZ
@given(data=mutated_images(), as_mask=st.booleans())
def test_fuzz_image_inputs(sock: Path, data: bytes, as_mask: bool) -> None:
    b64 = base64.b64encode(data).decode()
    body = {"prompt": "x", "model": "tiny", "width": 64, "height": 64, "steps": 2,
            **({"image": base64.b64encode(PNG_64).decode(), "mask": b64} if as_mask else {"image": b64})}
    status, headers, raw = call(sock, "POST", "/v1/jobs", json.dumps(body).encode(), JSON)
    answer = check_answer("POST", "/v1/jobs", status, headers, raw, len(data))
    event(f"HTTP {status}")
    if status == 400:
        assert answer["error"]["field"] in ("image", "mask"), answer
    cancel_if_accepted(sock, status, answer)


@FUZZ
@given(encoding=st.sampled_from(["gzip", "deflate", "br", "identity", "x-gzip", "gzip, gzip"]) | header_values,
       data=st.binary(max_size=200),
       path=st.sampled_from(["/v1/jobs", "/v1/images/generations", "/v1/images/edits", "/v1/loras"]))
def test_fuzz_content_encodings(sock: Path, encoding: str, data: bytes, path: str) -> None:
    try:
        status, headers, raw = call(sock, "POST", path, data, {"Content-Type": "application/json",
                                                               "Content-Encoding": encoding})
    except (BrokenPipeError, ConnectionResetError):  # refused at the header, closed before the body was sent
        assert call_json(sock, "GET", "/health")[0] == 200
        return
    if status == 400 and headers.get("content-type", "").startswith("text/plain"):
        # aiohttp's parser refuses, with its own text page and before any routing (as it does a method it
        # does not know), an encoding it does not take (br without brotli, a list), and a body that it
        # finds is not in its encoding while parsing (a short one, all in one packet: at its end)
        assert raw and len(raw) < 300, raw
        return
    answer = check_answer("POST", path, status, headers, raw, (encoding, data))
    event(f"HTTP {status}")
    cancel_if_accepted(sock, status, answer)


def test_daemon_is_healthy_after_the_fuzzing(sock: Path, fuzz_daemon: Daemon) -> None:
    """Runs last in this module (pytest keeps file order): the fuzzing left no damage behind."""
    deadline = time.monotonic() + 60
    while True:
        status, h = call_json(sock, "GET", "/health")
        if (h["jobs"]["queued"] == h["jobs"]["running"] == 0 and h["queue_depth"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200 and h["status"] == "ok", h
    assert h["jobs"]["queued"] == h["jobs"]["running"] == 0 and h["queue_depth"] == 0, h
    assert all(w["restarts"] == 0 and w["state"] == "ready" for w in h["workers"]), h
    for model in MODELS:
        body = {"model": model, "prompt": "after the fuzz", "width": 64, "height": 64, "steps": 2}
        status, job = call_json(sock, "POST", "/v1/jobs", {**body, "num_frames": 4} if model == "fv" else body)
        assert status == 202, job
        while job["status"] in ("queued", "running") and time.monotonic() < deadline + 60:
            time.sleep(0.05)
            job = call_json(sock, "GET", f"/v1/jobs/{job['id']}")[1]
        assert job["status"] == "succeeded", job
        status, _, raw = call(sock, "GET", job["outputs"][0]["url"])
        assert status == 200 and len(raw) == job["outputs"][0]["bytes"]
    log = fuzz_daemon.log_path.read_text(errors="replace")
    assert "Error handling request" not in log and "Traceback" not in log.split("ready: admitting jobs", 1)[-1], \
        log[-4000:]


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
