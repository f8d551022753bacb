"""The fuzzing kit's families for the request around a body (part of tests/fuzzkit.py): headers
that lie (a Content-Encoding the body lacks, Content-Types of another kind, chunked bodies), the web
listener's access rules under hostile Origins, Hosts, tokens and cookies, URLs with ids and numbers
that are not, and request lines that break HTTP/1.1 itself.

Apart from tests/fuzzkit_bodies.py because these reach the daemon's HTTP parser, routing and access
rules rather than its body decoders; they borrow the valid bodies from there.
"""

from __future__ import annotations

import gzip
import zlib
from urllib.parse import quote

from fuzzkit_bodies import BOUNDARY, GEN_BASE, JOB_BASE, _part, listener
from fuzzkit_env import Ctx
from fuzzkit_images import image_corpus
from fuzzkit_json import json_bytes
from fuzzkit_wire import Req
from hypothesis import strategies as st

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
                                                           "", "..", "%00", "%ff", "x" * 300, "latents.npy", "audio"]))
        elif draw(st.integers(0, 3)) == 0:  # its sound track as WAV (issue 30): these models make none
            path += draw(st.sampled_from(["/audio", "/audio/", "/AUDIO", "/audio.wav"]))
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
