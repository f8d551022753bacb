"""No input gets a 500 (issue 26), and what is logged when one does: a real daemon, real sockets.

- The last resort (``edge/status.py``): an exception nobody expected answers ``500
  internal_error`` in the one JSON shape, on the Unix socket and on the web listener alike,
  with an id that is in the one log line written for it (the traceback at that one place). The
  daemon is started through a launcher that breaks one handler's view (``views.loras``), the
  only way to reach code that, by design, no input reaches.
- aiohttp's parser refusals (a malformed request line, a bad header, a body not in its
  Content-Encoding) are answered 400 and logged as one INFO line, without a traceback, at most
  once per ten seconds (``server.ClientErrorLog``).
"""

from __future__ import annotations

import logging
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from daemonkit import Daemon

from conftest import ROOT
from diffusiond.daemon.server import ClientErrorLog

TOKEN = "no500-test-token-0123456789abcdef"
LAUNCHER = """
import sys
from diffusiond.daemon.edge import views

def broken(engine):
    raise RuntimeError("a bug planted by tests/test_no500.py")

views.loras = broken
from diffusiond.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


class BrokenDaemon(Daemon):
    """A daemon whose ``GET /v1/loras`` fails with an unexpected exception."""

    launcher: Path

    def spawn(self) -> None:
        import os
        import subprocess

        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(self.launcher), "serve", "--socket", str(self.socket), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[BrokenDaemon]:
    tmp = tmp_path_factory.mktemp("no500")
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "launch.py").write_text(LAUNCHER)
    d = BrokenDaemon(tmp / "d.sock", ["--model", "fz=synthetic:compute_ms=5", "--web", "127.0.0.1:0",
                                      "--token-file", str(tmp / "token"), "--log-level", "info"],
                     tmp / "d.log", env={"DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"})
    d.launcher = tmp / "launch.py"
    try:
        d.start()
        yield d
    finally:
        d.stop()


def raw(sock: Path | tuple[str, int], data: bytes) -> bytes:
    """Send ``data`` as it is and read the whole answer (the server closes after a refusal)."""
    family = socket.AF_UNIX if isinstance(sock, Path) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(10)
        c.connect(str(sock) if isinstance(sock, Path) else sock)
        c.sendall(data)
        chunks = []
        while chunk := c.recv(65536):
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and not data.startswith(b"GET /v1/loras"):
                break
        return b"".join(chunks)


def unix_get(d: Daemon, path: str) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), base_url="http://d") as c:
        return c.get(path)


def web_base(d: Daemon) -> str:
    url = re.findall(r"web page: open (\S+)", d.log_path.read_text())[-1]
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def test_an_unexpected_exception_is_a_json_500_with_an_id_in_one_log_line_on_both_listeners(
        daemon: BrokenDaemon) -> None:
    answers = [unix_get(daemon, "/v1/loras"),
               httpx.get(f"{web_base(daemon)}/v1/loras", headers={"Authorization": f"Bearer {TOKEN}"})]
    log = daemon.log_path.read_text()
    for r in answers:
        assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
        err = r.json()["error"]
        assert err["code"] == "internal_error", err
        err_id = re.search(r"err_[0-9a-f]{12}", err["message"])
        assert err_id, err
        assert "planted" not in err["message"]  # the cause stays in the log
        lines = [line for line in log.splitlines() if err_id.group() in line]
        assert len(lines) == 1 and " ERROR " in lines[0] and "/v1/loras" in lines[0], lines
        after = log.split(lines[0], 1)[1]
        assert after.lstrip("\n").startswith("Traceback") and "a bug planted" in after.split("\n20", 1)[0]
    assert answers[0].json()["error"]["message"] != answers[1].json()["error"]["message"]  # one id per failure
    assert unix_get(daemon, "/health").status_code == 200


MALFORMED = [b"GET /v1/models HTTP/1.1 extra\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
             b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
             b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"]


def test_parser_refusals_are_400s_logged_as_one_line_without_a_traceback(daemon: BrokenDaemon) -> None:
    before = daemon.log_path.read_text()
    host, port = urlsplit(web_base(daemon)).netloc.split(":")
    for data in MALFORMED:
        for where in (daemon.socket, (host, int(port))):
            answer = raw(where, data)
            assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0], (data[:40], answer)
    assert unix_get(daemon, "/health").status_code == 200
    new = daemon.log_path.read_text()[len(before):]
    assert "Traceback" not in new and "Error handling request" not in new and "Unhandled" not in new, new
    lines = [line for line in new.splitlines() if "refused a malformed HTTP request" in line]
    assert 1 <= len(lines) <= 2 and all(" INFO aiohttp.server" in line for line in lines), new  # rate-limited


def test_the_client_error_filter_keeps_real_faults_and_rate_limits_refusals(caplog: pytest.LogCaptureFixture) -> None:
    from aiohttp.http_exceptions import BadHttpMessage

    caplog.set_level(logging.INFO, logger="aiohttp.server")
    now = [100.0]
    f = ClientErrorLog(every_s=10, clock=lambda: now[0])

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                 ("peer",), (type(exc), exc, None))

    r = record(BadHttpMessage("bad request line"))
    assert f.filter(r) and r.levelno == logging.INFO and r.exc_info is None and "bad request line" in r.getMessage()
    assert not f.filter(record(BadHttpMessage("again")))  # within ten seconds: left out, counted
    now[0] += 11
    r = record(BadHttpMessage("later"))
    assert f.filter(r) and "1 more" in r.getMessage()
    fault = record(RuntimeError("a real fault"))
    assert f.filter(fault) and fault.levelno == logging.ERROR and fault.exc_info is not None
