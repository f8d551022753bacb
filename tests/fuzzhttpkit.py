"""The daemon and the client shared by tests/test_fuzz_http.py and tests/test_fuzz_http_targeted.py:
the daemon's configuration with small limits (size 128, n 4, steps 8, frames 8; each module starts
one), a bare ``http.client`` over its socket that sends header values and paths as given, the
properties every answer must have (``check_answer``, ``refused``) and every accepted job
(``within_limits``), and the images the tests send (PNGs, headers claiming bombs in each format,
pictures in any mode, multipart forms).

Apart from the test modules because both use it, and from tests/fuzzhttpkit_strategies.py because it
draws nothing: it is what the tests send with and check against.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from daemonkit import Daemon, shared_daemon

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

[[models]]
name = "tiny-inpaint"
spec = "tiny-inpaint"

[[models]]
name = "tiny-flux"
spec = "tiny-flux"

[limits]
max_size = 128
max_n = 4
max_steps = 8
max_frames = 8
"""
LIMITS = {"max_size": 128, "max_n": 4, "max_steps": 8, "max_frames": 8}
SYNC_PATHS = ("/v1/images/generations", "/v1/images/edits")
MODELS = ("fz", "fv", "tiny", "tiny-inpaint", "tiny-flux")
SYNTHETIC = ("fz", "fv")  # no LoRA, ControlNet, IP-Adapter, preview or hires pass fits them
# each model's ControlNets and IP-Adapters (the others are refused for it); a union ControlNet's mode count
SERVED = {"tiny": {"control": ("edges", "blobs"), "ip": ("style", "style2")},
          "tiny-inpaint": {"control": ("edges", "blobs"), "ip": ()},
          "tiny-flux": {"control": ("flux-lines", "flux-union"), "ip": ("flux-style",)}}
MODES = {"flux-union": 3}
LORAS = ("ink", "dots")
MAX_LORAS = 2
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


@contextlib.contextmanager
def fuzz_daemon_in(tmp: Path, model_cache: Path, lora_files: dict[str, Path], controlnet_dir: Path,
                   ip_adapter_file: Path, upscaler_file: Path, adapters: dict[str, Path]) -> Iterator[Daemon]:
    """The daemon these tests fuzz, started in ``tmp`` (its inputs and LoRA files beside its socket): the
    models of ``MODELS`` with the ControlNets and IP-Adapters of ``SERVED`` (``adapters``: conftest's
    ``fuzz_adapters``), so requests reach every pipeline those combine into."""
    # ink fits tiny and not the synthetic models: a request may be refused for either reason; esr runs in tiles
    # of 32, so the fuzzed sizes (56 to 136, odd ones too) upscale in tiles whose last one is moved back
    controls = {"edges": controlnet_dir, **{k: adapters[k] for k in ("blobs", "flux-lines", "flux-union")}}
    references = {"style": ip_adapter_file, **{k: adapters[k] for k in ("style2", "flux-style")}}
    table = lambda paths: "".join(f'{k} = "{v}"\n' for k, v in paths.items())  # noqa: E731
    (tmp / "diffusiond.toml").write_text(f"max_loras = {MAX_LORAS}\n{CONFIG}\n[loras]\n"
                                         f'ink = "{lora_files["ink"]}"\ndots = "{lora_files["dots"]}"\n'
                                         f"[controlnets]\n{table(controls)}[ip_adapters]\n{table(references)}"
                                         f'[upscalers.esr]\npath = "{upscaler_file}"\ntile = 32\noverlap = 8\n')
    (tmp / "inputs").mkdir()
    (tmp / "inputs" / "in.png").write_bytes(PNG_64)  # for image_path; nothing else is readable
    args = ["--config", str(tmp / "diffusiond.toml"), "--retention-s", "30", "--job-timeout", "60", "--max-batch", "4",
            "--input-dir", str(tmp / "inputs")]
    with shared_daemon(tmp, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        # the kit waits for the preload to end; the tests expect every worker ready too (their /health checks)
        deadline = time.monotonic() + 120
        while call(d.socket, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, d.log()[-4000:]
            time.sleep(0.1)
        yield d


def wait_job(sock: Path, job_id: str, timeout: float = 120) -> dict[str, Any]:
    """The job once it reached a terminal state; one that does not within ``timeout`` fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = call_json(sock, "GET", f"/v1/jobs/{job_id}")[1]
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, f"job left without a terminal state: {job}"
        time.sleep(0.05)


def finished_job(sock: Path) -> str:
    """A finished job, so generated paths can reach its outputs and events."""
    status, job = call_json(sock, "POST", "/v1/jobs", {"model": "fz", "prompt": "real", "width": 64, "height": 64,
                                                      "steps": 1})
    assert status == 202, job
    job = wait_job(sock, job["id"], 60)
    assert job["status"] == "succeeded", job
    return str(job["id"])


def cancel_if_accepted(sock: Path, status: int, body: Any) -> None:
    """Accepted jobs are cancelled at once: the fuzzing must not pile up work."""
    if status == 202:
        code, answer = call_json(sock, "DELETE", f"/v1/jobs/{body['id']}")
        assert code in (200, 409), answer


def within_limits(job: dict[str, Any]) -> None:
    """What an accepted job asked for is inside the configured limits."""
    r = job["request"]
    assert 1 <= r["n"] <= LIMITS["max_n"], job
    for side in ("width", "height"):
        assert 64 <= r[side] <= LIMITS["max_size"] and r[side] % 8 == 0, job
    assert 1 <= r["steps"] <= LIMITS["max_steps"], job
    assert r["num_frames"] is None or 1 <= r["num_frames"] <= LIMITS["max_frames"], job
    assert job["model"] in MODELS and r["prompt"].strip(), job
    assert not (r["negative_prompt"] or "").strip() or job["model"] != "tiny-flux", job  # FLUX would ignore it
    # issue 29: each noise only with its scheduler, and in its range
    assert r["noise_level"] is None or (r["scheduler"] == "flow-sde" and 0 < r["noise_level"] <= 2), job
    assert r["eta"] is None or (r["scheduler"] == "ddim" and 0 < r["eta"] <= 1), job
    t = r["trajectory"]
    assert t is None or ((t["latents"] or t["log_probs"]) and t["dtype"] in ("float32", "bfloat16", "float16")
                         and (r["scheduler"] == "flow-sde" or (r["scheduler"] == "ddim" and r["eta"]))), job
    assert len(r["loras"]) <= MAX_LORAS and len({e["name"] for e in r["loras"]}) == len(r["loras"]), job
    assert all(e["name"] in LORAS and -4 <= e["weight"] <= 4 for e in r["loras"]), job
    assert not r["loras"] or job["model"] not in SYNTHETIC, job  # the synthetic models take no LoRA
    served = SERVED.get(job["model"], {"control": (), "ip": ()})
    for c in r["control"]:  # ControlNets: served, in range, on the models they fit
        assert c["name"] in served["control"], job
        assert 0 <= c["scale"] <= 4 and 0 <= c["start"] < c["end"] <= 1 and c["preprocess"] in ("none", "canny"), job
        # a union ControlNet's mode in its range; a mode for another one is refused
        assert (c["mode"] is None) if c["name"] not in MODES else 0 <= c["mode"] < MODES[c["name"]], job
    # ControlNets act with the edits that take a strength only, with a reference or not
    assert not r["control"] or r["task"] in (None, "image-to-image", "inpainting"), job
    for a in r["ip_adapter"]:  # IP-Adapters: served, in range, on the models they fit (with control or an edit)
        assert a["name"] in served["ip"], job
        assert 0 <= a["scale"] <= 4 and len(a["image_digest"]) == 24 and len(r["ip_adapter"]) <= 4, job
    u, h = r["upscale"], r["hires"]  # issue 30: served upscalers, image-to-image models, sizes in their bounds
    assert u is None or (u["name"] == "esr" and 1 <= u["scale"] <= 8 and u["width"] <= 16384), job
    assert h is None or (job["model"] in ("tiny", "tiny-flux") and h["upscaler"] in (None, "esr")
                         and 0 < h["strength"] <= 1 and max(h["width"], h["height"]) <= LIMITS["max_size"]
                         and h["steps"] >= 1), job
    p = r["preview"]
    if p is not None:
        assert job["model"] not in SYNTHETIC, job  # the synthetic models have no preview decoder
        assert 1 <= p["every"] <= r["steps"] and p["format"] in ("jpeg", "webp", "png"), job
        assert 16 <= p["max_side"] <= 1024, job


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, (40, 120, 200, 0)[: len(mode)] if mode != "L" else 255).save(buf, format="PNG")
    return buf.getvalue()


PNG_64, PNG_72, MASK_64, MASK_72 = _png((64, 64)), _png((72, 64)), _png((64, 64), "RGBA"), _png((72, 72), "RGBA")
IMAGE_BYTES = [PNG_64, PNG_72, MASK_64, MASK_72, b"", b"\x89PNG\r\n\x1a\n", PNG_64[:40], b"GIF89a", b"\0" * 64,
               _png((4000, 10), "L"), _png((60, 60))]


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


def assert_healthy_after_fuzzing(sock: Path, fuzz_daemon: Daemon) -> None:
    """What the last test of each module that fuzzes a daemon asserts: the daemon is healthy, no worker
    restarted, every model still makes a picture, and its log holds no traceback since it was ready."""
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
        body: dict[str, Any] = {"model": model, "prompt": "after the fuzz", "width": 64, "height": 64, "steps": 2}
        if model == "fv":
            body["num_frames"] = 4
        if model == "tiny-inpaint":  # it inpaints only
            body.update(image=base64.b64encode(PNG_64).decode(), mask=base64.b64encode(MASK_64).decode())
        status, job = call_json(sock, "POST", "/v1/jobs", body)
        assert status == 202, job
        while job["status"] in ("queued", "running") and time.monotonic() < deadline + 60:
            time.sleep(0.05)
            job = call_json(sock, "GET", f"/v1/jobs/{job['id']}")[1]
        assert job["status"] == "succeeded", job
        status, _, raw = call(sock, "GET", job["outputs"][0]["url"])
        assert status == 200 and len(raw) == job["outputs"][0]["bytes"]
    log = fuzz_daemon.log_path.read_text(errors="replace")
    assert "Error handling request" not in log and "Traceback" not in log.split("preload done", 1)[-1], \
        log[-4000:]
