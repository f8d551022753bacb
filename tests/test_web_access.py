"""Who may use the web listener (``serve --web``): the rules of ``daemon/webauth.py`` one by one,
then the same rules against a real daemon over real TCP on loopback: the sign-in URL and its
cookie, the token on every API request, Host and Origin checks, ``diffusiond web-url``.

The page itself is driven in a real browser in test_web_page.py.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx
import pytest
from daemonkit import Daemon, http, shared_daemon

from conftest import ROOT
from diffusiond.daemon.config import ConfigError, parse_host_port
from diffusiond.daemon.edge import webauth

TOKEN = "web+test/token-0123456789abcdef="  # as `openssl rand -base64` makes them: + / =
HOLD = {"model": "hold", "prompt": "held", "width": 64, "height": 64, "steps": 500}
ENV = {"OMP_NUM_THREADS": "1"}  # see test_daemon_lifecycle.py


# the rules alone ----------------------------------------------------------------------------------
def test_own_hosts_are_the_connected_address_the_configured_name_and_localhost_on_loopback() -> None:
    assert webauth.own_hosts("127.0.0.1", 7860, "127.0.0.1") == {"127.0.0.1:7860", "localhost:7860"}
    assert webauth.own_hosts("::1", 7860, "::1") == {"[::1]:7860", "localhost:7860"}
    assert webauth.own_hosts("127.0.0.1", 7860, "studio.lan") == {"127.0.0.1:7860", "studio.lan:7860",
                                                                  "localhost:7860"}
    # a LAN address is not loopback: "localhost" would name another machine for the browser
    assert webauth.own_hosts("192.168.1.20", 7860, "0.0.0.0") == {"192.168.1.20:7860"}
    assert webauth.own_hosts("::ffff:192.168.1.20", 7860, "::") == {"192.168.1.20:7860"}
    assert "127.0.0.1" in webauth.own_hosts("127.0.0.1", 80, "127.0.0.1")  # browsers leave out :80


def test_a_host_that_does_not_name_the_listener_is_refused() -> None:
    hosts = webauth.own_hosts("127.0.0.1", 7860, "127.0.0.1")
    assert webauth.host_allowed("127.0.0.1:7860", hosts)
    assert webauth.host_allowed("LOCALHOST:7860", hosts)
    for bad in ("attacker.example:7860", "127.0.0.1:7861", "127.0.0.1", "localhost", "", None):
        assert not webauth.host_allowed(bad, hosts), bad


def test_only_the_listeners_own_http_origin_is_accepted() -> None:
    hosts = webauth.own_hosts("127.0.0.1", 7860, "127.0.0.1")
    assert webauth.origin_allowed("http://127.0.0.1:7860", hosts)
    assert webauth.origin_allowed("http://localhost:7860", hosts)
    for bad in ("http://attacker.example", "https://127.0.0.1:7860", "null", "http://127.0.0.1:7861",
                "file://", "http://127.0.0.1:7860/x", "http://127.0.0.1:7860.attacker.example"):
        assert not webauth.origin_allowed(bad, hosts), bad


def test_the_cookie_or_a_bearer_token_authorizes_nothing_else_does() -> None:
    t = "s3cret-token-0123456789"
    assert webauth.authorized(t, t, None)
    assert webauth.authorized(t, None, f"Bearer {t}")
    assert webauth.authorized(t, "wrong", f"Bearer {t}")
    for cookie, auth in ((None, None), ("wrong", None), (t[:-1], None), (None, t), (None, f"Basic {t}"),
                         (None, "Bearer "), ("é" * 5, "Bearer é")):  # non-ASCII must not raise
        assert not webauth.authorized(t, cookie, auth), (cookie, auth)


def test_only_the_page_and_its_files_are_public() -> None:
    assert webauth.is_public("GET", "/") and webauth.is_public("HEAD", "/")
    assert webauth.is_public("GET", "/static/app.js")
    for method, path in (("POST", "/"), ("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("DELETE", "/v1/jobs/j_1"),
                         ("GET", "/metrics"), ("GET", "/health"), ("GET", "/static/../daemon/web.py"),
                         ("POST", "/static/app.js")):
        assert not webauth.is_public(method, path), (method, path)


def test_web_addresses_are_host_port_with_ipv6_in_brackets() -> None:
    assert parse_host_port("127.0.0.1:7860", "--web") == ("127.0.0.1", 7860)
    assert parse_host_port("[::1]:0", "--web") == ("::1", 0)
    assert parse_host_port(":7860", "--web") == ("", 7860)  # every address
    for bad in ("7860", "::1:7860", "localhost:http", "localhost:65536", "localhost:"):
        with pytest.raises(ConfigError, match="--web"):
            parse_host_port(bad, "--web")


def test_the_cookie_is_named_per_port_so_two_daemons_keep_their_sign_ins() -> None:
    assert webauth.cookie_name(7860) != webauth.cookie_name(7861)


# against a real daemon ------------------------------------------------------------------------------
def web_url_cli(sock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diffusiond", "web-url", "--socket", str(sock)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)


@pytest.fixture(scope="module")
def web_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("web")
    (tmp / "token").write_text(TOKEN + "\n")
    args = ["--model", "tiny", "--model", "hold=synthetic:compute_ms=300000", "--job-timeout", "120",
            "--web", "127.0.0.1:0", "--token-file", str(tmp / "token")]
    with shared_daemon(tmp, args, model_cache, ENV) as d:
        yield d


@pytest.fixture(scope="module")
def base(web_daemon: Daemon) -> str:
    r = web_url_cli(web_daemon.socket)
    assert r.returncode == 0, r.stderr
    parts = urlsplit(r.stdout.strip())
    return f"{parts.scheme}://{parts.netloc}"


def jobs_with_prompt(d: Daemon, prompt: str) -> list[dict[str, object]]:
    async def go() -> list[dict[str, object]]:
        async with http(d.socket) as s, s.get("/v1/jobs") as r:
            return [j for j in (await r.json())["data"] if j["request"]["prompt"] == prompt]

    return asyncio.run(go())


def cancel_all(d: Daemon, jobs: list[dict[str, object]]) -> None:
    async def go() -> None:
        async with http(d.socket) as s:
            for j in jobs:
                async with s.delete(f"/v1/jobs/{j['id']}"):
                    pass

    asyncio.run(go())


def test_web_url_prints_the_one_logged_url_with_the_token_file_s_token(web_daemon: Daemon, base: str) -> None:
    r = web_url_cli(web_daemon.socket)
    url = r.stdout.strip()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=" + re.escape(quote(TOKEN, safe="")), url), url
    assert int(urlsplit(url).port or 0) > 0  # port 0 was asked for: the URL has the real one
    assert web_daemon.log().count(url) == 1, web_daemon.log()


def test_the_token_url_sets_an_httponly_samesite_strict_cookie_and_counts_a_session(base: str) -> None:
    with httpx.Client(base_url=base) as c:
        before = _metric(c, "diffusiond_web_sessions_total")
        r = c.get(f"/?token={quote(TOKEN, safe='')}")
        assert r.status_code == 303 and r.headers["Location"] == "/"  # the token leaves the address bar
        cookie = r.headers["Set-Cookie"]
        port = urlsplit(base).port
        jar = SimpleCookie(cookie)
        assert jar[f"diffusiond_token_{port}"].value == TOKEN, cookie
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie, cookie
        assert c.get("/v1/models").status_code == 200  # the cookie alone signs the client in
        assert _metric(c, "diffusiond_web_sessions_total") == before + 1


def test_a_wrong_token_in_the_url_is_refused_and_sets_nothing(base: str) -> None:
    r = httpx.get(f"{base}/?token=not-the-token")
    assert r.status_code == 401 and "Set-Cookie" not in r.headers
    assert r.json()["error"]["code"] == "unauthorized"
    assert "diffusiond web-url" in r.json()["error"]["message"]


def test_every_request_but_the_page_needs_the_cookie_or_the_bearer_token(web_daemon: Daemon, base: str) -> None:
    assert httpx.get(f"{base}/").status_code == 200  # the page loads and then shows how to sign in
    assert httpx.get(f"{base}/static/app.js").status_code == 200
    prompt = "no cookie, no job"
    for method, path in (("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("POST", "/v1/images/generations"), ("DELETE", "/v1/jobs/j_0"), ("POST", "/v1/admin/sleep")):
        r = httpx.request(method, f"{base}{path}", json={"prompt": prompt, **HOLD} if method == "POST" else None)
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["code"] == "unauthorized"
        assert "diffusiond web-url" in r.json()["error"]["message"]
    bad = httpx.post(f"{base}/v1/jobs", json={**HOLD, "prompt": prompt}, headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401
    assert jobs_with_prompt(web_daemon, prompt) == []  # refused means nothing was admitted

    by_bearer = httpx.post(f"{base}/v1/jobs", json={**HOLD, "prompt": prompt},
                           headers={"Authorization": f"Bearer {TOKEN}"})
    cookie = {webauth.cookie_name(int(urlsplit(base).port or 0)): TOKEN}
    by_cookie = httpx.post(f"{base}/v1/jobs", json={**HOLD, "prompt": prompt}, cookies=cookie)
    assert by_bearer.status_code == 202 and by_cookie.status_code == 202, (by_bearer.text, by_cookie.text)
    jobs = jobs_with_prompt(web_daemon, prompt)
    assert len(jobs) == 2
    cancel_all(web_daemon, jobs)


def test_a_host_header_that_does_not_name_the_listener_is_refused(web_daemon: Daemon, base: str) -> None:
    """DNS rebinding: the browser sends the attacker's name as Host, even with the right cookie."""
    port = urlsplit(base).port
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prompt = "rebound"
    for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1:{(port or 0) + 1}"):
        r = httpx.post(f"{base}/v1/jobs", json={**HOLD, "prompt": prompt}, headers={**auth, "Host": host})
        assert r.status_code == 403, (host, r.text)
        assert r.json()["error"]["code"] == "wrong_host" and host in r.json()["error"]["message"]
        assert httpx.get(f"{base}/", headers={"Host": host}).status_code == 403  # not even the page
    assert jobs_with_prompt(web_daemon, prompt) == []
    assert httpx.get(f"{base}/v1/models", headers={**auth, "Host": f"localhost:{port}"}).status_code == 200


def test_a_request_from_another_sites_page_is_refused_even_with_the_cookie(web_daemon: Daemon, base: str) -> None:
    cookie = {webauth.cookie_name(int(urlsplit(base).port or 0)): TOKEN}
    prompt = "cross-site"
    for origin in ("http://attacker.example", "null", base.replace("http:", "https:")):
        r = httpx.post(f"{base}/v1/jobs", json={**HOLD, "prompt": prompt}, cookies=cookie,
                       headers={"Origin": origin})
        assert r.status_code == 403, (origin, r.text)
        assert r.json()["error"]["code"] == "cross_origin"
    assert jobs_with_prompt(web_daemon, prompt) == []
    same = httpx.post(f"{base}/v1/jobs", json={**HOLD, "prompt": prompt}, cookies=cookie, headers={"Origin": base})
    assert same.status_code == 202, same.text
    cancel_all(web_daemon, jobs_with_prompt(web_daemon, prompt))
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        assert 'diffusiond_web_refused_total{reason="cross_origin"}' in c.get("/metrics").text


def test_the_page_may_not_be_framed_or_load_from_elsewhere(base: str) -> None:
    r = httpx.get(f"{base}/")
    assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
    assert "default-src 'self'" in r.headers["Content-Security-Policy"]
    assert r.headers["X-Frame-Options"] == "DENY"
    assert not re.search(r"(src|href)=\"(https?:)?//", r.text)  # nothing from a CDN


def test_the_pages_scripts_are_revalidated_so_an_upgrade_serves_the_new_ones(base: str) -> None:
    """The page (never cached) and its scripts must come from the same daemon: a browser may reuse a
    file that names no Cache-Control for a while by its own rule, and old scripts under a new page break it."""
    for name in ("app.js", "steer.js", "style.css"):
        r = httpx.get(f"{base}/static/{name}")
        assert r.status_code == 200 and r.headers.get("Cache-Control") == "no-cache", (name, r.headers)
        again = httpx.get(f"{base}/static/{name}", headers={"If-None-Match": r.headers["ETag"]})
        assert again.status_code == 304, (name, again.status_code)  # unchanged: not sent again
    assert httpx.get(f"{base}/").headers["Cache-Control"] == "no-store"


def test_web_url_is_not_given_over_the_web_listener_itself(base: str) -> None:
    r = httpx.get(f"{base}/v1/admin/web", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text  # docs/api.md: 403
    assert TOKEN not in r.text


def test_a_random_token_without_token_file_and_web_url_without_web(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--web", "127.0.0.1:0", env=ENV)
    url = web_url_cli(d.socket).stdout.strip()
    token = url.split("?token=", 1)[1]
    assert len(token) >= 32 and d.log().count(url) == 1
    base = url.split("/?token=")[0]
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    d.stop()

    plain = daemon_factory("--model", "tiny", env=ENV)
    r = web_url_cli(plain.socket)
    assert r.returncode == 1
    assert "no web listener" in r.stderr and "serve --web" in r.stderr, r.stderr


def test_web_address_errors_name_the_flag(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        for value, words, code in (("::1:7860", "put an IPv6 address in brackets", 2),
                                   ("127.0.0.1:99999", "a port of 0-65535", 2),
                                   (f"127.0.0.1:{port}", f"cannot listen on --web 127.0.0.1:{port}", 1)):
            r = subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--socket", str(tmp_path / "s.sock"),
                                "--model", "tiny", "--web", value], capture_output=True, text=True, cwd=ROOT,
                               timeout=120, check=False)
            assert r.returncode == code, (value, r.stderr)
            assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        busy.close()


def _metric(c: httpx.Client, name: str) -> float:
    text = c.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def raw_request(base: str, lines: list[bytes]) -> tuple[int, dict[str, object]]:
    """One request with header bytes as given (httpx would refuse or re-encode them)."""
    host, port = urlsplit(base).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as c:
        c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: " + f"{host}:{port}".encode() + b"\r\nConnection: close\r\n"
                  + b"".join(line + b"\r\n" for line in lines) + b"\r\n")
        data = b""
        while chunk := c.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head, data
    return status, __import__("json").loads(body)


@pytest.mark.parametrize(("lines", "status", "code"), [
    ([b"Origin: http://["], 403, "cross_origin"),
    ([b"Origin: http://[::1"], 403, "cross_origin"),
    ([b"Origin: \xff\xfe"], 403, "cross_origin"),
    ([b"Authorization: Bearer \xff" + TOKEN.encode()], 401, "unauthorized"),
    ([b"Authorization: Bearer " + TOKEN.encode() + b"\xc3"], 401, "unauthorized"),
    ([b"Cookie: diffusiond_token_{port}=\xff\xfe"], 401, "unauthorized"),
    ([b"Authorization: \xff"], 401, "unauthorized"),
    ([b"Origin: {base}", b"Origin: http://attacker.example", b"Authorization: Bearer " + TOKEN.encode()], 403,
     "cross_origin"),
    ([b"Origin: http://attacker.example", b"Origin: {base}", b"Authorization: Bearer " + TOKEN.encode()], 403,
     "cross_origin"),
    ([b"Origin: {base}", b"Origin: {base}", b"Authorization: Bearer " + TOKEN.encode()], 403, "cross_origin"),
    ([b"Origin: {base}", b"Authorization: Bearer " + TOKEN.encode()], 200, None),
])
def test_headers_that_broke_the_checks_are_refused_before_any_token(base: str, lines: list[bytes], status: int,
                                                                     code: str | None) -> None:
    """An Origin urlsplit rejects (403), a token or cookie that is not UTF-8 (401: it is simply not
    the token), two Origin headers (403: with the first checked, a foreign second went through)."""
    port = str(urlsplit(base).port).encode()
    lines = [line.replace(b"{base}", base.encode()).replace(b"{port}", port) for line in lines]
    got, answer = raw_request(base, lines)
    assert got == status, answer
    if code is not None:
        assert answer["error"]["code"] == code, answer  # type: ignore[index]
