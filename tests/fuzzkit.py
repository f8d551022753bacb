"""Fuzzing every HTTP surface of a real daemon (issue 26): Hypothesis strategies that build whole
requests, a raw HTTP/1.1 sender, and the one oracle every answer is held to.

Shared by tests/test_fuzz_surfaces.py (a bounded number of examples per family, in `make test`)
and scripts/fuzz.py (the long mode, hundreds of thousands of inputs). Everything goes over HTTP,
to the Unix socket or the ``--web`` listener on 127.0.0.1, never anywhere else: a fuzzer that
imports the daemon's modules would test what they promise instead of what a client gets.

Requests are sent as raw bytes on a fresh connection each (``Connection: close``), because many
inputs are ones a well-behaved client library refuses to send: two ``Origin`` headers, bytes that
are not UTF-8 in ``Authorization``, a ``Content-Encoding`` the body does not have, form field
names that are not text, numbers JSON libraries cannot print.

The oracle (``problems``): never a 5xx (but a documented 503 or a synchronous 504); every 4xx and
5xx in the documented JSON shape ``{"error": {"code", "message", "field"?, "stage"?}}`` with
``Content-Type: application/json``; on the web listener, no request without the token, with a
foreign ``Origin`` or a ``Host`` that is not the listener's gets anything but 401/403; and the
daemon answers ``GET /health`` with ``ok`` afterwards.
"""

from __future__ import annotations

import base64
import functools
import gzip
import http.client
import io
import json
import math
import os
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

TIMEOUT_S = 60.0
# the daemon's limits for fuzzing: whatever valid request Hypothesis finds is cheap to run
CONFIG_LIMITS = """
[limits]
max_size = 128
max_n = 2
max_steps = 4
"""
SYNC_PATHS = ("/v1/images/generations", "/v1/images/edits")
ERROR_KEYS = {"code", "message", "field", "stage"}
# 503 is documented for a daemon that is starting, draining or has no worker; nothing else
DOCUMENTED_503 = {"starting", "shutting_down", "draining", "no_worker", "unavailable", "worker_unavailable"}
BOUNDARY = "fzkB0undary7"


# requests and answers --------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where the daemon listens. ``web_port`` is its ``--web`` listener on 127.0.0.1 (None: none)."""

    socket: str
    web_port: int | None = None
    token: str | None = None


@dataclass
class Req:
    """One request as bytes on the wire. ``auth``: on the web listener, add the bearer token
    unless the request carries its own credentials. ``must``: the statuses this input may get
    (an access rule: a foreign Origin is 403 whatever else holds), None for any non-5xx.
    ``parser``: the request breaks HTTP itself, so aiohttp's parser may refuse it with its own
    plain-text 400 before the application sees it."""

    surface: str
    listener: str  # "unix" or "web"
    method: str
    path: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    auth: bool = True
    host: bytes | None = None
    must: frozenset[int] | None = None
    parser: bool = False
    note: str = ""

    def describe(self, limit: int = 400) -> str:
        body = self.body if len(self.body) <= limit else self.body[:limit] + b"...(%d bytes)" % len(self.body)
        heads = [(k, v if len(v) <= limit else v[:limit] + b"...") for k, v in self.headers]
        return (f"[{self.surface}] {self.listener} {self.method} {self.path[:limit]!r} headers={heads!r} "
                f"body={body!r}{' ' + self.note if self.note else ''}")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float = 0.0

    def json(self) -> Any:
        return json.loads(self.body)


def _wire(target: Target, req: Req) -> bytes:
    names = {k.lower() for k, _ in req.headers}
    lines = [req.method.encode() + b" " + req.path + b" HTTP/1.1"]
    if req.host is not None:
        lines.append(b"Host: " + req.host)
    elif b"host" not in names:
        lines.append(b"Host: " + (f"127.0.0.1:{target.web_port}".encode() if req.listener == "web" else b"diffusiond"))
    if (req.listener == "web" and req.auth and target.token and b"authorization" not in names
            and b"cookie" not in names):
        lines.append(b"Authorization: Bearer " + target.token.encode())
    for name, value in req.headers:
        lines.append(name + b": " + value)
    if b"content-length" not in names and b"transfer-encoding" not in names:
        lines.append(b"Content-Length: %d" % len(req.body))
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + req.body


def connect(target: Target, listener: str, timeout: float) -> socket.socket:
    if listener == "web":
        if target.web_port is None:
            raise ValueError("this daemon has no web listener")
        sock = socket.create_connection(("127.0.0.1", target.web_port), timeout=timeout)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(target.socket)
    return sock


def send(target: Target, req: Req, timeout: float = TIMEOUT_S) -> Answer:
    """Send ``req`` on its own connection and read the whole answer (an event stream too: the
    fuzzed jobs are finished or unknown, so their streams end)."""
    t0 = time.monotonic()
    sock = connect(target, req.listener, timeout)
    try:
        try:
            sock.sendall(_wire(target, req))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed (a body over the limit): read that answer
        resp = http.client.HTTPResponse(sock, method=req.method)
        resp.begin()
        try:
            body = resp.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body, time.monotonic() - t0)
    finally:
        sock.close()


def request(target: Target, method: str, path: str, body: Any = None, listener: str = "unix") -> Answer:
    """A plain JSON request, for set-up and checks."""
    data = b"" if body is None else json.dumps(body).encode()
    headers = [(b"Content-Type", b"application/json")] if body is not None else []
    return send(target, Req("setup", listener, method, path.encode(), headers, data))


def health_problem(target: Target) -> str | None:
    """None while the daemon answers ``/health`` with ``ok`` (its event loop and every worker)."""
    try:
        ans = request(target, "GET", "/health")
        if ans.status == 200 and ans.json().get("status") == "ok":
            return None
        return f"/health answered {ans.status} {ans.body[:300]!r}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"/health did not answer: {exc!r}"


# the oracle ------------------------------------------------------------------------------------
def error_shape_problem(ans: Answer) -> str | None:
    ctype = ans.headers.get("content-type", "")
    if not ctype.startswith("application/json"):
        return f"a {ans.status} with Content-Type {ctype!r}, not application/json"
    try:
        doc = json.loads(ans.body)
    except ValueError:
        return f"a {ans.status} whose body is not JSON"
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(doc["error"], dict):
        return f"a {ans.status} whose body is not {{\"error\": {{...}}}}"
    err = doc["error"]
    if not (isinstance(err.get("code"), str) and err["code"] and isinstance(err.get("message"), str)
            and err["message"]):
        return f"a {ans.status} whose error lacks a code or a message"
    if not set(err) <= ERROR_KEYS:
        return f"a {ans.status} whose error has keys {sorted(set(err) - ERROR_KEYS)} beyond the documented ones"
    if err.get("field") is not None and not isinstance(err["field"], str):
        return f"a {ans.status} whose error field is not a string"
    return None


def _code(ans: Answer) -> str | None:
    try:
        return str(json.loads(ans.body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def problems(req: Req, ans: Answer) -> list[str]:
    """What is wrong with ``ans`` as the answer to ``req``; empty when it is a deliberate answer."""
    out: list[str] = []
    path = req.path.split(b"?", 1)[0].decode(errors="replace")
    if ans.status >= 500:
        documented = ((ans.status == 503 and _code(ans) in DOCUMENTED_503)
                      or (ans.status == 504 and path in SYNC_PATHS and _code(ans) == "deadline_exceeded"))
        if not documented:
            out.append(f"answered {ans.status} (never for a client's input)")
    if ans.status >= 400 and req.method != "HEAD":
        plain_parser_400 = req.parser and ans.status == 400 and ans.headers.get("content-type", "").startswith(
            "text/plain")
        if not plain_parser_400:
            shape = error_shape_problem(ans)
            if shape:
                out.append(shape)
    if req.must is not None and ans.status not in req.must:
        out.append(f"answered {ans.status}, where only {sorted(req.must)} may answer this input")
    return out


def check(target: Target, req: Req, *, health: bool = True) -> Answer:
    """Send ``req`` and fail with the input and the answer when the oracle objects."""
    try:
        ans = send(target, req)
    except (OSError, http.client.HTTPException) as exc:
        raise AssertionError(f"no answer ({exc!r}) to {req.describe()}") from exc
    found = problems(req, ans)
    if health:
        sick = health_problem(target)
        if sick:
            found.append(sick)
    assert not found, f"{'; '.join(found)}\n  input: {req.describe()}\n  answer: {ans.status} {ans.body[:600]!r}"
    return ans


# JSON that json.dumps cannot write ---------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text put into a document as is: numbers of any length, nesting of any depth."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''} len={len(self.text)})"


class Utf8(str):
    """A string to be written unescaped as UTF-8 (lone surrogates as their surrogatepass bytes)."""

    __slots__ = ()


def to_json(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Utf8):
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ",".join(f"{to_json(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
    return json.dumps(value)


def json_bytes(value: Any) -> bytes:
    return to_json(value).encode("utf-8", "surrogatepass")


def nested(depth: int, kind: str = "list") -> Raw:
    if kind == "dict":
        return Raw('{"a":' * depth + "1" + "}" * depth)
    if kind == "mixed":
        return Raw('[{"a":' * (depth // 2) + "1" + "}]" * (depth // 2))
    return Raw("[" * depth + "]" * depth)


DIGITS_4301 = "9" * 4301
# by kind, each kind drawn as often as the others: a rare kind is not starved by a long list
NASTY_KINDS: dict[str, list[Any]] = {
    "huge numbers": [Raw(str(10**309)), Raw("-" + str(10**309)), Raw(DIGITS_4301), Raw("-" + DIGITS_4301),
                     Raw("1" + "0" * 5000), Raw("1" * 4300 + ".5"), Raw("0." + "0" * 5000 + "1"), 2**63, 2**64,
                     -(2**63) - 1, 10**30],
    "non-finite": [Raw("1e309"), Raw("-1e309"), Raw("1e-400"), 1e308, -1e308, 5e-324],
    # not JSON at all: the whole body is refused, which hides every other field, so one kind of six
    "not json": [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), math.nan, math.inf, -math.inf],
    "wrong types": [-1, 0, 1, 1.5, -0.0, True, False, None, "", " ", "1", "64", "64x64", "nan", "inf", "1e309",
                    DIGITS_4301, [], {}, [1], {"a": 1}, [[[]]]],
    "deep nesting": [nested(1001), nested(1500, "dict"), nested(3000, "mixed"), nested(100_000),
                     [{"name": nested(1200)}], {"every": nested(1200, "dict")}],
    "unicode": ["\x00", "\ud800", "\udfff", Utf8("\ud800x"), "\u202e", "💥" * 50, "x" * 20_000, Raw('"\\ud800"'),
                Raw('"\\u0000"'), "ﬀ", "\u0301" * 100],
}
NASTY: list[Any] = [v for values in NASTY_KINDS.values() for v in values]
nasty_values = st.one_of([st.sampled_from(values) for values in NASTY_KINDS.values()])


# images of every format, and what can go wrong with them -----------------------------------------
def _save(img: Any, fmt: str, **kw: Any) -> bytes | None:
    buf = io.BytesIO()
    try:
        img.save(buf, format=fmt, **kw)
    except Exception:  # a format this Pillow cannot write (no encoder, no ghostscript): none of it
        return None
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (and one tiny IDAT): a bomb that costs nothing."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + _png_chunk(b"IEND", b""))


def bmp_header(width: int, height: int) -> bytes:
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 54 + 64, 0, 0, 54) + info + b"\0" * 64


def gif_header(width: int, height: int) -> bytes:
    return (b"GIF89a" + struct.pack("<HH", width, height) + b"\x80\x00\x00" + b"\0\0\0\xff\xff\xff"
            + b"\x2c" + struct.pack("<HHHH", 0, 0, width, height) + b"\x00\x02\x02\x44\x01\x00\x3b")


def jpeg_header(width: int, height: int, base: bytes) -> bytes:
    """A real JPEG whose SOF0 dimensions are rewritten."""
    i = base.find(b"\xff\xc0")
    if i < 0:
        return base
    return base[: i + 5] + struct.pack(">HH", height, width) + base[i + 9:]


def webp_header(width: int, height: int) -> bytes:
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0\0\0\0" + (width - 1).to_bytes(3, "little") + (
        height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def qoi_header(width: int, height: int) -> bytes:
    return b"qoif" + struct.pack(">II", width, height) + b"\x03\x00" + b"\0" * 7 + b"\x01"


def tiff_header(width: int, height: int) -> bytes:
    entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (273, 4, 1, 8 + 2 + 12 * 8 + 4), (278, 4, 1, height), (279, 4, 1, 16)]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\0\0\0\0"
    return b"II*\0" + struct.pack("<I", 8) + ifd + b"\0" * 16


ISSUE_GIF = base64.b64decode("R0lGODlh/////4AAAAAAAP///ywAAAAA/////wACAkQBADs=")


@functools.cache
def image_corpus() -> dict[str, bytes]:
    """Small real images in every format this Pillow writes, in several modes, then the hostile
    ones: headers claiming 10^10 pixels (above Pillow's own bomb limit) or just above the daemon's
    16.7 MP (between the two), formats the daemon has no business decoding (DDS with an unknown
    pixel format, SPIDER, a LAB TIFF), and nothing-images."""
    from PIL import Image

    Image.init()
    rgb = Image.new("RGB", (64, 64), (40, 120, 200))
    for x in range(0, 64, 4):
        rgb.putpixel((x, x), (255, 0, 0))
    out: dict[str, bytes] = {}
    for fmt in sorted(Image.SAVE):
        for mode in ("RGB", "RGBA", "L", "P", "1", "CMYK", "I;16", "F", "LAB"):
            data = _save(rgb.convert(mode) if mode not in ("I;16", "LAB") else rgb.convert("L").convert(mode)
                         if mode == "I;16" else rgb.convert("LAB"), fmt)
            if data:
                out[f"{fmt.lower()}-{mode.lower().replace(';', '')}"] = data
    anim = [Image.new("P", (64, 64), i * 40) for i in range(3)]
    gif = io.BytesIO()
    anim[0].save(gif, format="GIF", save_all=True, append_images=anim[1:])
    out["gif-animated"] = gif.getvalue()
    out["png-mask-72"] = _save(Image.new("RGBA", (72, 72), (0, 0, 0, 0)), "PNG") or b""
    out["png-72x64"] = _save(Image.new("RGB", (72, 64)), "PNG") or b""
    jpeg = out.get("jpeg-rgb", b"")
    for w, h, tag in ((100_000, 100_000, "bomb"), (4097, 4097, "over-limit"), (65500, 65500, "bomb-max"),
                      (1, 100_000_000, "bomb-thin")):
        out[f"png-{tag}"] = png_header(w, h)
        out[f"bmp-{tag}"] = bmp_header(w, h)
        out[f"tiff-{tag}"] = tiff_header(w, h)
        out[f"qoi-{tag}"] = qoi_header(w, h)
        if w <= 65535 and h <= 65535:
            out[f"gif-{tag}"] = gif_header(w, h)
            out[f"jpeg-{tag}"] = jpeg_header(w, h, jpeg)
        if w <= 1 << 24 and h <= 1 << 24:
            out[f"webp-{tag}"] = webp_header(w, h)
    out["gif-issue26"] = ISSUE_GIF
    dds = out.get("dds-rgba") or out.get("dds-rgb")
    if dds:
        out["dds-unknown-fourcc"] = dds[:84] + b"ZZZZ" + dds[88:]
        out["dds-fourcc-flag"] = dds[:80] + struct.pack("<I", 4) + b"ZZZZ" + dds[88:]
    out.update({"empty": b"", "png-magic": b"\x89PNG\r\n\x1a\n", "gif-magic": b"GIF89a", "zeros": b"\0" * 64,
                "text": b"hello, not an image", "svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
                "eps-magic": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100000 100000\n"})
    return out


def mutate(data: bytes, ops: Iterable[tuple[int, int, int]]) -> bytes:
    """Byte edits (kind, where, value): flip a byte, set a byte, cut the file, or repeat a slice.
    ``where`` counts from the start modulo the length, so most edits land in the header."""
    buf = bytearray(data)
    for kind, where, value in ops:
        if not buf:
            break
        i = where % len(buf)
        if kind == 0:
            buf[i] ^= 1 << (value % 8)
        elif kind == 1:
            buf[i] = value % 256
        elif kind == 2:
            del buf[i:]
        else:
            buf[i:i] = buf[i: i + value % 64]
    return bytes(buf)


@st.composite
def image_bytes(draw: st.DrawFn) -> bytes:
    """A real or hostile image, half the time mutated (flips in the header, truncations)."""
    corpus = image_corpus()
    data = corpus[draw(st.sampled_from(sorted(corpus)))]
    if draw(st.integers(0, 1)):
        ops = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 63) | st.integers(0, 1 << 20),
                                      st.integers(0, 255)), min_size=1, max_size=4))
        data = mutate(data, ops)
    return data


def as_base64(data: bytes, style: int) -> str:
    b64 = base64.b64encode(data).decode()
    return [b64, "data:image/png;base64," + b64, "data:image/gif;base64," + b64, b64[:-1], "data:;base64," + b64,
            b64 + "===="][style % 6]


# the environment the daemon runs in: files to read, LoRAs to register ------------------------------
def populate_input_dir(root: Path) -> list[str]:
    """The files ``image_path`` may name: every corpus image, then the traps (symlink loops, links
    out of the folder, a folder, names near the length limit). Returns the names."""
    root.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for name, data in image_corpus().items():
        (root / name).write_bytes(data)
        names.append(name)
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "in.png").write_bytes(image_corpus()["png-rgb"])
    links = {"loop": "loop", "loop-a": "loop-b", "loop-b": "loop-a", "escape": "/etc/passwd", "zero": "/dev/zero",
             "up": "..", "dangling": "missing", "self-dir": ".", "inside": "png-rgb"}
    for name, to in links.items():
        link = root / name
        if not link.is_symlink():
            os.symlink(to, link)
    (root / ("n" * 250 + ".png")).write_bytes(image_corpus()["png-rgb"])
    return [*names, "sub", "sub/in.png", *links, "n" * 250 + ".png"]


def safetensors(header: str | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def populate_lora_dir(root: Path) -> list[str]:
    """safetensors files a LoRA path may name: headers nested 100k deep, holding 5000-digit
    numbers, lengths that lie, dtypes and shapes that do not exist. Returns absolute paths."""
    root.mkdir(parents=True, exist_ok=True)
    t = '{"unet.x.lora_A.weight": {"dtype": "F32", "shape": [%s], "data_offsets": [%s]}}'
    files = {
        "deep100k.safetensors": safetensors('{"__metadata__": ' + '{"a":' * 100_000 + "1" + "}" * 100_000 + "}"),
        "deeplist.safetensors": safetensors('{"unet.x.lora_A.weight": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "digits.safetensors": safetensors(t % ("1" * 5000, "0, 4"), b"\0" * 4),
        "offsets.safetensors": safetensors(t % ("1", "0, " + "9" * 5000), b"\0" * 4),
        "float.safetensors": safetensors(t % ("1e309", "0, 4"), b"\0" * 4),
        "negative.safetensors": safetensors(t % ("-1", "0, 4"), b"\0" * 4),
        "huge-shape.safetensors": safetensors(t % (str(2**64), "0, 4"), b"\0" * 4),
        "dtype.safetensors": safetensors(t.replace("F32", "Q9") % ("1", "0, 4"), b"\0" * 4),
        "length-lies.safetensors": safetensors("{}", length=2**63),
        "length-zero.safetensors": safetensors("", length=0),
        "not-json.safetensors": safetensors("{not json"),
        "not-utf8.safetensors": safetensors(b'{"\xff\xfe": 1}'),
        "surrogate.safetensors": safetensors('{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                                             b"\0" * 4),
        "metadata-types.safetensors": safetensors('{"__metadata__": {"a": [1, 2, {"b": null}]}}'),
        "empty.safetensors": b"",
        "short.safetensors": b"\x05\0\0",
        "nul\x01name.safetensors": safetensors("{}"),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "dir.safetensors").mkdir(exist_ok=True)
    loop = root / "loop.safetensors"
    if not loop.is_symlink():
        os.symlink("loop.safetensors", loop)
    return [str(root / name) for name in [*files, "dir.safetensors", "loop.safetensors"]]


@dataclass(frozen=True)
class Ctx:
    """What the strategies build requests from: the daemon, a finished job with outputs and a
    preview, the LoRAs it serves, the folders it reads."""

    target: Target
    job_id: str
    loras: tuple[str, ...] = ()
    input_dir: str | None = None
    input_names: tuple[str, ...] = ()
    lora_paths: tuple[str, ...] = ()
    valid_lora: str | None = None

    @property
    def listeners(self) -> list[str]:
        return ["unix", "web"] if self.target.web_port is not None else ["unix"]


def finished_job(target: Target, timeout: float = 120) -> str:
    """A job that ran to the end with a preview and a trajectory, so URLs can reach its outputs, previews and
    trajectory arrays."""
    ans = request(target, "POST", "/v1/jobs", {"prompt": "fuzz", "model": "tiny", "width": 64, "height": 64,
                                                "steps": 2, "preview": {"every": 1, "max_side": 16},
                                                "scheduler": "ddim", "eta": 1.0, "trajectory": {}})
    assert ans.status == 202, ans.body
    job = ans.json()
    deadline = time.monotonic() + timeout
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        job = request(target, "GET", f"/v1/jobs/{job['id']}").json()
    assert job["status"] == "succeeded", job
    return str(job["id"])


def web_port_of(target: Target) -> int | None:
    """The --web listener's port, from the URL the daemon gives over its socket."""
    ans = request(target, "GET", "/v1/admin/web")
    if ans.status != 200:
        return None
    from urllib.parse import urlsplit

    return urlsplit(ans.json()["url"]).port


# strategies: one family per surface ----------------------------------------------------------------
JOB_BASE = {"prompt": "a fox", "model": "tiny", "width": 64, "height": 64, "steps": 1}
GEN_BASE = {"prompt": "a fox", "model": "tiny", "size": "64x64", "num_inference_steps": 1}
JOB_FIELDS = ["prompt", "model", "n", "width", "height", "steps", "guidance_scale", "negative_prompt", "seed",
              "output_format", "output_dtype", "num_frames", "fps", "timeout_s", "scheduler", "image", "image_path",
              "mask", "mask_path", "strength", "loras", "preview", "keep_alive", "noise_level", "eta",
              "control", "ip_adapter", "trajectory", "upscale", "hires"]
GEN_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
              "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "loras", "preview",
              "quality", "style", "user", "background", "moderation", "output_compression", "stream",
              "partial_images"]
EDIT_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
               "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "strength", "quality",
               "background", "input_fidelity", "user", "loras", "preview", "ip_adapter"]
NUMERIC_FIELDS = {"n", "width", "height", "steps", "num_inference_steps", "guidance_scale", "seed", "num_frames", "fps",
                  "timeout_s", "strength", "output_compression", "partial_images", "noise_level", "eta"}
# the scheduler a field belongs to (issue 29): sent with it half the time, so the value's own range check is reached
NOISE_SCHEDULERS = {"noise_level": "flow-sde", "eta": "ddim"}
UNKNOWN_FIELDS = ["zz", "", "\x00", "\ud800", "prompt ", "PROMPT", "__proto__", "x" * 300]


def listener(ctx: Ctx) -> st.SearchStrategy[str]:
    return st.sampled_from(ctx.listeners)


def lora_values(ctx: Ctx) -> st.SearchStrategy[Any]:
    names = st.sampled_from([*ctx.loras, "nope", "", "../x", "x" * 65]) | nasty_values
    entry = st.fixed_dictionaries({"name": names}, optional={"weight": nasty_values | st.floats(-5, 5)})
    return st.lists(entry, max_size=3) | nasty_values


def control_values(ctx: Ctx) -> st.SearchStrategy[Any]:
    """ControlNet entries: names none of these daemons serve, images and numbers nasty or plausible."""
    entry = st.fixed_dictionaries({"name": st.sampled_from(["edges", "", "../x", "x" * 65]) | nasty_values},
                                  optional={"image": st.builds(as_base64, image_bytes(), st.integers(0, 5))
                                            | nasty_values,
                                            "image_path": path_values(ctx) | nasty_values,
                                            "scale": nasty_values | st.floats(-1, 5),
                                            "start": nasty_values | st.floats(-1, 2),
                                            "end": nasty_values | st.floats(-1, 2),
                                            "preprocess": nasty_values | st.sampled_from(["none", "canny"])})
    return st.lists(entry, max_size=5) | nasty_values


def ip_adapter_values(ctx: Ctx) -> st.SearchStrategy[Any]:
    """IP-Adapter entries: names none of these daemons serve, images and scales nasty or plausible."""
    entry = st.fixed_dictionaries({"name": st.sampled_from(["style", "", "../x", "x" * 65]) | nasty_values},
                                  optional={"image": st.builds(as_base64, image_bytes(), st.integers(0, 5))
                                            | nasty_values,
                                            "image_path": path_values(ctx) | nasty_values,
                                            "scale": nasty_values | st.floats(-1, 5)})
    return st.lists(entry, max_size=3) | nasty_values


preview_values = st.fixed_dictionaries({}, optional={"every": nasty_values | st.integers(-1, 5),
                                                     "format": nasty_values | st.sampled_from(["jpeg", "png", "x"]),
                                                     "max_side": nasty_values | st.integers(0, 2000)}) | nasty_values


trajectory_values = st.fixed_dictionaries({}, optional={
    "latents": st.booleans() | nasty_values, "log_probs": st.booleans() | nasty_values,
    "dtype": st.sampled_from(["float32", "bfloat16", "float16", "float64", ""]) | nasty_values}) | nasty_values


upscale_values = st.fixed_dictionaries({"name": st.sampled_from(["esr", "", "../x", "x" * 65]) | nasty_values},
                                       optional={"scale": nasty_values | st.floats(-1, 10)}) | nasty_values
hires_values = st.fixed_dictionaries({}, optional={
    "scale": nasty_values | st.floats(0, 5), "strength": nasty_values | st.floats(-1, 2),
    "steps": nasty_values | st.integers(-1, 9), "upscaler": nasty_values | st.sampled_from(["esr", ""])}) | nasty_values


def field_value(ctx: Ctx, name: str) -> st.SearchStrategy[Any]:
    """Nasty values for any field; for some, ones of the field's own kind too."""
    if name in ("upscale", "hires"):
        return upscale_values if name == "upscale" else hires_values
    if name == "loras":
        return lora_values(ctx)
    if name == "preview":
        return preview_values
    if name == "control":
        return control_values(ctx)
    if name == "ip_adapter":
        return ip_adapter_values(ctx)
    if name in ("image", "mask"):
        return st.builds(as_base64, image_bytes(), st.integers(0, 5)) | nasty_values
    if name in ("image_path", "mask_path"):
        return path_values(ctx) | nasty_values
    if name in NOISE_SCHEDULERS:
        return st.floats(-1, 3) | st.sampled_from([0, 1, 2, 1e-300, -0.0]) | nasty_values
    if name == "trajectory":
        return trajectory_values
    return nasty_values


@st.composite
def json_body(draw: st.DrawFn, ctx: Ctx, base: dict[str, Any], fields: list[str]) -> Any:
    """A valid body with one to three fields changed or added (a real field or an unknown one)."""
    body = dict(base)
    numeric = [f for f in fields if f in NUMERIC_FIELDS]
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):  # one change mostly, so no other masks it
        # the numbers get half the draws: their range checks are where conversions overflow
        name = draw(st.sampled_from(numeric) | st.sampled_from(fields) | st.sampled_from(UNKNOWN_FIELDS))
        body[name] = draw(field_value(ctx, name))
        if name in NOISE_SCHEDULERS and draw(st.booleans()):
            body["scheduler"] = NOISE_SCHEDULERS[name]
        if name == "trajectory" and draw(st.booleans()):  # with its sampler, so its own checks are reached
            body.update(scheduler="ddim", eta=1.0)
    if draw(st.integers(0, 9)) == 0:
        return draw(nasty_values)  # a document that is not an object at all
    return body


def _json_req(surface: str, where: str, method: str, path: str, body: Any) -> Req:
    return Req(surface, where, method, path.encode(), [(b"Content-Type", b"application/json")], json_bytes(body))


def jobs_json(ctx: Ctx) -> st.SearchStrategy[Req]:
    return st.builds(lambda w, b: _json_req("jobs_json", w, "POST", "/v1/jobs", b), listener(ctx),
                     json_body(ctx, JOB_BASE, JOB_FIELDS))


def generations_json(ctx: Ctx) -> st.SearchStrategy[Req]:
    return st.builds(lambda w, b: _json_req("generations_json", w, "POST", "/v1/images/generations", b),
                     listener(ctx), json_body(ctx, GEN_BASE, GEN_FIELDS))


@st.composite
def images_base64(draw: st.DrawFn, ctx: Ctx) -> Req:
    """An edit on /v1/jobs with the image (and maybe a mask) in the JSON body, as base64 or a data URL."""
    body: dict[str, Any] = {**JOB_BASE, "strength": 1.0}
    del body["width"], body["height"]  # the image's own size
    body["image"] = as_base64(draw(image_bytes()), draw(st.integers(0, 5)))
    if draw(st.booleans()):
        body["mask"] = as_base64(draw(image_bytes()), draw(st.integers(0, 5)))
    if draw(st.integers(0, 3)) == 0:
        body["size"] = "64x64"  # only generations know size: an unknown field on jobs
        body["width"] = body["height"] = 64
    return _json_req("images_base64", draw(listener(ctx)), "POST", "/v1/jobs", body)


def path_values(ctx: Ctx) -> st.SearchStrategy[str]:
    names = list(ctx.input_names) or ["png-rgb"]
    root = ctx.input_dir or "/nonexistent"
    tricky = ["", ".", "..", "../", "../etc/passwd", "/etc/passwd", "/dev/zero", "sub/../../x", "sub/", "png-rgb\x00",
              "\x00", "png\x00-rgb", "a" * 256, "a/" * 3000, "n" * 250 + ".png/x", "%2e%2e/x", "\ud800", "png-rgb ",
              "~", "~/x", "loop/x", "./loop", root, root + "/png-rgb", root + "/../x", root + "/loop",
              "sub/in.png/..", "file:///etc/passwd", "\\..\\x", "png-rgb/"]
    return st.sampled_from(names) | st.sampled_from(tricky)


@st.composite
def image_path(draw: st.DrawFn, ctx: Ctx) -> Req:
    body: dict[str, Any] = {"prompt": "a fox", "model": "tiny", "steps": 1, "strength": 1.0,
                            "image_path": draw(path_values(ctx))}
    if draw(st.booleans()):
        body["mask_path"] = draw(path_values(ctx))
    if draw(st.integers(0, 3)) == 0:
        body["image"] = as_base64(image_corpus()["png-rgb"], 0)  # both ways at once
    return _json_req("image_path", draw(listener(ctx)), "POST", "/v1/jobs", body)


BAD_NAMES = [b"pro\xffmpt", b"\xc3\x28", b"image\x80", b"\xff", b"", b"prompt\x00", b"loras[][name]\xfe",
             b'pr"ompt', b"prompt; x", "ünïcode".encode(), b"\xed\xa0\x80"]


def _part(name: bytes, value: bytes, filename: bytes | None = None, ctype: bytes | None = None) -> bytes:
    head = b'Content-Disposition: form-data; name="' + name + b'"'
    if filename is not None:
        head += b'; filename="' + filename + b'"'
    if ctype is not None:
        head += b"\r\nContent-Type: " + ctype
    return head + b"\r\n\r\n" + value


def _text(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json_bytes(value)


@st.composite
def edits_multipart(draw: st.DrawFn, ctx: Ctx) -> Req:
    """The edits form with one to three fields mutated: names that are not UTF-8, values that are
    huge, deeply nested JSON in ``loras``/``preview``, the flattened spellings, images of every
    format and their mutations, fields twice."""
    fields: dict[bytes, bytes] = {b"prompt": b"a fox", b"model": b"tiny", b"num_inference_steps": b"1",
                                  b"strength": b"1"}
    extra: list[bytes] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 6))
        if kind == 0:
            extra.append(_part(draw(st.sampled_from(BAD_NAMES)), b"1"))
        elif kind == 1:
            name = draw(st.sampled_from(["loras", "preview", "ip_adapter"]))
            value = draw(st.sampled_from([nested(1001), nested(1500, "dict"), nested(100_000), nested(3000, "mixed"),
                                          Raw('[{"name": "ink", "weight": ' + DIGITS_4301 + "}]"),
                                          Raw('{"every": ' + str(10**309) + "}")]) | field_value(ctx, name))
            fields[name.encode()] = _text(value)
        elif kind == 2:
            extra.append(_part(b"loras[][name]", _text(draw(st.sampled_from([*ctx.loras, "nope", ""])))))
            extra.append(_part(b"loras[][weight]", _text(draw(nasty_values))))
        elif kind == 3:
            for flat in draw(st.lists(st.sampled_from([b"preview[every]", b"preview[format]", b"preview[max_side]",
                                                       b"preview[zz]", b"ip_adapter[][name]", b"ip_adapter[][image]",
                                                       b"ip_adapter[][scale]", b"ip_adapter[][zz]"]),
                                      min_size=1, max_size=3)):
                extra.append(_part(flat, _text(draw(nasty_values))))
        elif kind == 4:
            fields[draw(st.sampled_from(EDIT_FIELDS)).encode()] = _text(draw(nasty_values))
        elif kind == 5:
            name = draw(st.sampled_from([b"prompt", b"negative_prompt", b"user", b"zz"]))
            fields[name] = b"x" * draw(st.sampled_from([10_001, 1 << 20, 3 << 20]))
        else:
            extra.append(_part(draw(st.sampled_from([b"prompt", b"model", b"size", b"n"])), b"2"))  # twice
    parts = [_part(k, v) for k, v in fields.items()] + extra
    parts.append(_part(draw(st.sampled_from([b"image", b"image[]", b"image\xff"])), draw(image_bytes()),
                       draw(st.sampled_from([b"f.png", b"\xff.png", b"", b"../../x"])),
                       draw(st.sampled_from([b"image/png", b"application/octet-stream", b"text/plain\xff"]))))
    if draw(st.booleans()):
        parts.append(_part(b"mask", draw(image_bytes()), b"m.png", b"image/png"))
    body = b"".join(b"--" + BOUNDARY.encode() + b"\r\n" + p + b"\r\n" for p in parts) + f"--{BOUNDARY}--\r\n".encode()
    ctype = f"multipart/form-data; boundary={BOUNDARY}".encode()
    return Req("edits_multipart", draw(listener(ctx)), "POST", b"/v1/images/edits", [(b"Content-Type", ctype)], body)


ENCODINGS = [b"gzip", b"deflate", b"x-gzip", b"br", b"zstd", b"gzip, deflate", b"identity", b"compress", b"bogus",
             b"GZIP", b"gzip, gzip"]


def _encode(body: bytes, how: int) -> bytes:
    """0: not encoded at all (the lie), 1: gzip, 2: zlib, 3: raw deflate, 4: gzip cut short, 5: junk."""
    if how == 1:
        return gzip.compress(body)
    if how == 2:
        return zlib.compress(body)
    if how == 3:
        c = zlib.compressobj(wbits=-15)
        return c.compress(body) + c.flush()
    if how == 4:
        return gzip.compress(body)[:12]
    if how == 5:
        return b"\x1f\x8b\x08\x00" + body
    return body


@st.composite
def headers_family(draw: st.DrawFn, ctx: Ctx) -> Req:
    """Valid bodies with headers that lie: a Content-Encoding the body does not have, a
    Content-Type of another kind, chunked bodies, odd Accept-Encoding."""
    where = draw(listener(ctx))
    path, body, ctype = draw(st.sampled_from([
        ("/v1/jobs", json_bytes(JOB_BASE), b"application/json"),
        ("/v1/images/generations", json_bytes(GEN_BASE), b"application/json"),
        ("/v1/loras", json_bytes({"name": "ink", "path": "/nonexistent.safetensors"}), b"application/json"),
        ("/v1/images/edits", b"--" + BOUNDARY.encode() + b"\r\n" + _part(b"prompt", b"a fox") + b"\r\n--"
         + BOUNDARY.encode() + b"\r\n" + _part(b"image", image_corpus()["png-rgb"], b"f.png", b"image/png")
         + b"\r\n--" + BOUNDARY.encode() + b"--\r\n", f"multipart/form-data; boundary={BOUNDARY}".encode()),
    ]))
    headers: list[tuple[bytes, bytes]] = []
    if draw(st.integers(0, 3)):
        headers.append((b"Content-Encoding", draw(st.sampled_from(ENCODINGS))))
        body = _encode(body, draw(st.integers(0, 5)))
    if draw(st.booleans()):
        ctype = draw(st.sampled_from([b"image/png", b"text/plain", b"multipart/form-data",
                                      b"multipart/form-data; boundary=", b"multipart/form-data; boundary=\xff",
                                      b"application/json; charset=utf-16", b"application/json; charset=\xff",
                                      b"application/x-www-form-urlencoded", b"", b"application/json", ctype]))
    headers.append((b"Content-Type", ctype))
    if draw(st.integers(0, 3)) == 0:
        headers.append((b"Accept-Encoding", draw(st.sampled_from([b"gzip", b"*;q=x", b"\xff", b"br;q=1e309"]))))
    if draw(st.integers(0, 4)) == 0:
        headers.append((b"Transfer-Encoding", b"chunked"))
        body = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n" if body else b"0\r\n\r\n"
    return Req("headers", where, "POST", path.encode(), headers, body)


WEB_PATHS = [("GET", b"/v1/models"), ("GET", b"/v1/jobs"), ("POST", b"/v1/jobs"), ("GET", b"/health"),
             ("GET", b"/metrics"), ("GET", b"/v1/loras"), ("GET", b"/v1/controlnets"), ("GET", b"/v1/ip-adapters"),
             ("GET", b"/v1/upscalers"),
             ("DELETE", b"/v1/jobs/j_0"), ("GET", b"/"),
             ("GET", b"/static/app.js"), ("GET", b"/v1/admin/web"), ("GET", b"/?token=x")]


@st.composite
def web_auth(draw: st.DrawFn, ctx: Ctx) -> Req:
    """The web listener's access rules with hostile headers: Origins urlsplit rejects, two of
    them, Authorization and cookies holding bytes that are not UTF-8, Hosts that are not ours.
    Each input says which statuses its rules allow (``must``)."""
    port = ctx.target.web_port
    token = (ctx.target.token or "").encode()
    # the listener's own, with the trailing "/" some non-browser clients add (webauth.origin_allowed takes it)
    own_origins = [f"http://127.0.0.1:{port}".encode(), f"http://localhost:{port}".encode(),
                   f"http://127.0.0.1:{port}/".encode()]
    foreign = [b"http://[", b"http://]", b"http://[::1", b"null", b"",
               b"https://127.0.0.1:%d" % port, b"http://attacker.example", b"http://127.0.0.1:99999",
               b"http://127.0.0.1:-1", b"http://127.0.0.1:%d\xff" % port, b"http://%zz", b"http://user@127.0.0.1",
               b"\xff\xfe", b"http://127.0.0.1:" + b"9" * 5000, b"file://", b"http://127.0.0.1:%d.evil" % port]
    method, path = draw(st.sampled_from(WEB_PATHS))
    public = method == "GET" and (path == b"/" or path.startswith(b"/static/"))
    if path == b"/?token=x":
        path = b"/?token=" + draw(st.sampled_from([token, b"", b"\xff", token + b"\x80", quote("é").encode(),
                                                   b"%ff%fe", b"x" * 5000]))
    headers: list[tuple[bytes, bytes]] = []
    authorized = True
    cred = draw(st.integers(0, 6))
    cookie_name = f"diffusiond_token_{port}".encode()
    if cred == 1:
        headers.append((b"Authorization", draw(st.sampled_from([b"Bearer \xff", b"Bearer " + token + b"\x80",
                                                                b"Bearer \xed\xa0\x80", b"\xff\xfe", b"Basic \xff",
                                                                b"Bearer " + b"\xc3" * 40, b"Bearer ", b"Bearer"]))))
        authorized = False
    elif cred == 2:
        headers.append((b"Cookie", cookie_name + b"=" + draw(st.sampled_from([b"\xff", token + b"\xff", b"\xed\xa0\x80",
                                                                              b'"\xff"', b"", b"x" * 5000]))))
        authorized = False
    elif cred == 3:
        headers.append((b"Cookie", draw(st.sampled_from([b"=;;=", b"\xff=\xff", b";" * 100, b"a=b; " + b"c" * 5000,
                                                         cookie_name + b"=" + token[:-1]]))))
        authorized = False
    elif cred == 4:
        headers.append((b"Cookie", cookie_name + b"=" + token))
    elif cred == 5:
        authorized = False  # no credentials at all
    must: set[int] | None = None
    origins = draw(st.lists(st.sampled_from(own_origins) | st.sampled_from(foreign), min_size=0, max_size=2))
    for o in origins:
        headers.append((b"Origin", o))
    host = draw(st.sampled_from([None, None, b"localhost:%d" % port, b"[", b"127.0.0.1:%d\xff" % port, b"",
                                 b"attacker.example", b"127.0.0.1", b"127.0.0.1:%d:1" % port]))
    if host is not None and host != b"localhost:%d" % port:
        must = {403}
    elif any(o not in own_origins for o in origins) or len(origins) == 2:
        must = {403}  # a foreign Origin, first or second; or two at all (issue 26: refuse a request with two)
    elif not authorized and not public and not path.startswith(b"/?token="):
        must = {401}
    body = json_bytes(JOB_BASE) if method == "POST" else b""
    if body:
        headers.append((b"Content-Type", b"application/json"))
    raw_url = any(b > 0x7E for b in path)  # a raw byte in the request line: the parser's to refuse
    return Req("web_auth", "web", method, path, headers, body, auth=cred == 0, host=host,
               must=frozenset(must) if must and not raw_url else None, parser=raw_url)


def index_values() -> st.SearchStrategy[str]:
    return st.sampled_from(["0", "1", "-1", "+0", "00", " 0", "0x0", "1e0", "9" * 4301, "-" + "9" * 4301, "1" * 20,
                            "٣", "①", "%D9%A3", "%00", "%ff", "%2e%2e", "..", "1.0", "", "inf", "nan", "0_0",
                            "18446744073709551616", "%F0%9F%92%A5"])


@st.composite
def urls(draw: st.DrawFn, ctx: Ctx) -> Req:
    """History pages and job, output, preview and event URLs with ids and numbers that are not."""
    job = draw(st.sampled_from([ctx.job_id, "j_0000000000000000", "j_" + "f" * 5000, "%00", "..%2F..", "%ff",
                                "j_%F0%9F%92%A5", ctx.job_id + "%00"]))
    k = draw(index_values())
    kind = draw(st.integers(0, 5))
    method = "GET"
    if kind == 0:
        params = []
        for name in draw(st.lists(st.sampled_from(["limit", "before", "status", "model", "zz"]), max_size=3)):
            value = draw(index_values() if name == "limit" else st.sampled_from(
                [ctx.job_id, "j_0", "succeeded", "queued", "bogus", "tiny", "", "%ff", "9" * 4301, "٣", "%00"]))
            params.append(f"{name}={value}")
        if draw(st.integers(0, 4)) == 0:
            params.append(params[0] if params else "limit=1")  # a parameter twice
        path = "/v1/jobs?" + "&".join(params)
    elif kind == 1:
        path = f"/v1/jobs/{job}/outputs/{k}"
        if draw(st.booleans()):  # a trajectory's arrays (issue 29), by name, real and not
            path += "/trajectory/" + draw(st.sampled_from(["latents", "log_probs", "timesteps", "sigmas", "LATENTS",
                                                           "", "..", "%00", "%ff", "x" * 300, "latents.npy"]))
    elif kind == 2:
        path = f"/v1/jobs/{job}/preview/{k}"
    elif kind == 3:
        path = f"/v1/jobs/{job}" + draw(st.sampled_from(["", "/events", "?finished=keep", "/", "/outputs"]))
        method = draw(st.sampled_from(["GET", "HEAD", "DELETE"]))
        if method == "DELETE" and job == ctx.job_id:
            path = f"/v1/jobs/{job}?finished=keep"  # a plain DELETE would delete the job the others read
    elif kind == 4:
        path = draw(st.sampled_from(["/v1/admin/web", "/v1/admin/trace", "/v1/models", "/v1/loras", "/metrics",
                                     "/v1/controlnets", "/v1/ip-adapters", "/v1/upscalers",
                                     "/ready", "/static/../index.html", "/static/%2e%2e/web.py", "/static/" + "a" * 300,
                                     "/static/%00", "/v1/" + "a/" * 2000, "/%ff", "/v1/jobs/" + "%" * 3]))
        method = draw(st.sampled_from(["GET", "HEAD", "OPTIONS", "PATCH"]))
    else:
        query = draw(st.sampled_from(["format=png", "x=%ff", "=", "&&", "a=" + "9" * 5000]))
        path = f"/v1/jobs/{job}/outputs/{k}?{query}"
    # percent-encoded as a client library would (raw spaces or non-ASCII break the request line itself)
    wire = quote(path, safe="/?=&%+").encode()
    # a request line over aiohttp's 8190 bytes is refused by its parser, before any handler
    return Req("urls", draw(listener(ctx)), method, wire, [], b"", parser=len(wire) > 8000)


@st.composite
def loras_post(draw: st.DrawFn, ctx: Ctx) -> Req:
    """``POST /v1/loras`` with paths over the file-name limit, crafted safetensors files, and
    names of every kind. New valid registrations are few (four names), so the registry stays small."""
    long_component = "/tmp/" + "a" * 300 + ".safetensors"
    long_path = "/tmp/" + "a/" * 3000 + "x.safetensors"
    others = [long_component, long_path, "", "relative.safetensors", "/nonexistent.safetensors", "/etc/passwd",
              "/tmp/x\x00.safetensors", "\ud800.safetensors", "/dev/zero", "/proc/self/environ", "~/x.safetensors",
              *([ctx.valid_lora] if ctx.valid_lora else [])]
    path = draw(st.sampled_from(ctx.lora_paths or ["/nonexistent"]) | st.sampled_from(others) | nasty_values)
    crafted = [p for p in ctx.lora_paths if Path(p).name.split(".")[0] in ("deep100k", "deeplist", "digits", "offsets",
                                                                             "float", "huge-shape", "loop")]
    if draw(st.booleans()):  # half: a name that would register, with a crafted file or an over-long path
        name: Any = draw(st.sampled_from(["fz0", "fz1", "fz2", "fz3"]))
        path = draw(st.sampled_from([*crafted, long_component, long_path]))
    else:
        name = draw(st.sampled_from([*ctx.loras, "fz0", "", "x" * 65, "a b", "../x", "é", "\x00", "\ud800"])
                    | nasty_values)
    body: Any = {"name": name, "path": path}
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.sampled_from(UNKNOWN_FIELDS))] = draw(nasty_values)
    if draw(st.integers(0, 9)) == 0:
        body = draw(nasty_values)
    return _json_req("loras_post", draw(listener(ctx)), "POST", "/v1/loras", body)


PARSER_BREAKERS: list[tuple[str, bytes, list[tuple[bytes, bytes]], bytes]] = [
    ("FOO", b"/v1/jobs", [], b""),
    ("GET", b"/v1/jobs", [(b"Bad Header", b"x")], b""),
    ("GET", b"/v1/jobs", [(b"X\xff", b"x")], b""),
    ("GET", b"/v1/jobs", [(b"X-Long", b"a" * 9000)], b""),
    ("POST", b"/v1/jobs", [(b"Content-Length", b"abc")], b""),
    ("POST", b"/v1/jobs", [(b"Content-Length", b"-1")], b""),
    ("POST", b"/v1/jobs", [(b"Content-Length", b"1"), (b"Content-Length", b"2")], b"{}"),
    ("POST", b"/v1/jobs", [(b"Transfer-Encoding", b"chunked")], b"zz\r\n{}\r\n0\r\n\r\n"),
    ("POST", b"/v1/jobs", [(b"Transfer-Encoding", b"gzip, chunked, x")], b"0\r\n\r\n"),
    ("GET", b"/v1/jobs\x00", [], b""),
    ("GET", b"/v1/jobs x", [], b""),
    ("GET", b"v1/jobs", [], b""),
    ("GET", b"/v1/" + b"a" * 9000, [], b""),
    ("GET", b"/v1/jobs", [(b"X-Fold", b"a\r\n b")], b""),
    ("GET", b"/v1/jobs", [(b"X-Nul", b"a\x00b")], b""),
]


@st.composite
def parser_family(draw: st.DrawFn, ctx: Ctx) -> Req:
    """Requests that break HTTP/1.1 itself: aiohttp's parser answers them (a plain-text 400 is
    fine there), and they must never cost a traceback in the log."""
    method, path, headers, body = draw(st.sampled_from(PARSER_BREAKERS))
    return Req("parser", draw(listener(ctx)), method, path, list(headers), body, parser=True)


FAMILIES: dict[str, Callable[[Ctx], st.SearchStrategy[Req]]] = {
    "jobs_json": jobs_json,
    "generations_json": generations_json,
    "images_base64": images_base64,
    "image_path": image_path,
    "edits_multipart": edits_multipart,
    "headers": headers_family,
    "web_auth": web_auth,
    "urls": urls,
    "loras_post": loras_post,
    "parser": parser_family,
}


def strategies(ctx: Ctx) -> dict[str, st.SearchStrategy[Req]]:
    """Every family that applies to this daemon (``web_auth`` needs the web listener)."""
    return {name: make(ctx) for name, make in FAMILIES.items() if name != "web_auth" or ctx.target.web_port}


def cleanup(target: Target, req: Req, ans: Answer) -> None:
    """Accepted jobs are cancelled at once: the fuzzing must not pile up work."""
    if ans.status == 202 and req.path.startswith(b"/v1/jobs"):
        try:
            job_id = ans.json()["id"]
        except (ValueError, KeyError, TypeError):
            return
        request(target, "DELETE", f"/v1/jobs/{job_id}?finished=keep")


# a daemon to fuzz ------------------------------------------------------------------------------
def daemon_args(tmp: Path, lora_files: dict[str, Path], web: bool = True) -> tuple[list[str], Path, Path]:
    """The ``serve`` arguments of a daemon fit for fuzzing (tiny, two LoRAs, small limits,
    ``--input-dir``, ``--web`` on a free loopback port with a known token), after writing the
    files it reads. Returns (args, input dir, crafted LoRA dir)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "fuzz.toml"
    config.write_text(f'max_loras = 2\n[[models]]\nname = "tiny"\nspec = "tiny"\n{CONFIG_LIMITS}\n[loras]\n'
                      f'ink = "{lora_files["ink"]}"\ndots = "{lora_files["dots"]}"\n')
    inputs, crafted = tmp / "inputs", tmp / "crafted-loras"
    populate_input_dir(inputs)
    populate_lora_dir(crafted)
    args = ["--config", str(config), "--retention-s", "60", "--job-timeout", "60", "--max-batch", "2",
            "--input-dir", str(inputs)]
    if web:
        (tmp / "token").write_text(FUZZ_TOKEN + "\n")
        args += ["--web", "127.0.0.1:0", "--token-file", str(tmp / "token")]
    return args, inputs, crafted


FUZZ_TOKEN = "fuzz-token-0123456789abcdef0123"


def make_ctx(target: Target, input_dir: Path | None, crafted: Path | None, valid_lora: Path | None,
             loras: tuple[str, ...] = ("ink", "dots")) -> Ctx:
    names = tuple(populate_input_dir(input_dir)) if input_dir else ()
    paths = tuple(populate_lora_dir(crafted)) if crafted else ()
    return Ctx(target, finished_job(target), loras, str(input_dir) if input_dir else None, names, paths,
               str(valid_lora) if valid_lora else None)
