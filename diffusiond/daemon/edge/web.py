"""The web listener (``serve --web``): the page at ``/`` and the same API under ``/v1``, on TCP.

Browsers cannot reach a Unix socket, so this listener is TCP, and anything on the machine (or, on
a non-loopback address, the network) can connect; the page and every API route are therefore
behind a token, as Jupyter does it: without ``--token-file`` the daemon makes a random one and
logs one URL that carries it (a journal gets the address alone). Opening that URL sets an HttpOnly,
SameSite=Strict cookie and redirects to ``/`` (so the token leaves the address bar and the history).
The rules themselves (Host, Origin, cookie or bearer) are in ``webauth.py``; this module applies them, serves the page
from the package (``diffusiond/web/``, plain files, no build step) and reuses the API's handlers
through ``api.add_api_routes``.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from urllib.parse import quote

from aiohttp import web
from aiohttp.typedefs import Middleware

from diffusiond.daemon.core.engine import Engine
from diffusiond.daemon.edge import webauth
from diffusiond.daemon.edge.api import add_api_routes, admin_web
from diffusiond.daemon.edge.status import ENGINE, Handler, HttpError, errors_middleware
from diffusiond.daemon.metrics import Metrics
from diffusiond.protocol import ErrorCode, same_token

log = logging.getLogger(__name__)

PAGE_DIR = Path(__file__).resolve().parents[2] / "web"  # diffusiond/web
# The page loads nothing from elsewhere and may not be framed (clickjacking); previews come as data: URLs.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
SIGN_IN = "open the URL that `diffusiond web-url` prints (it carries the token)"


def bind_tcp(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts so the URL (and a port 0's real
    port) is known; an address in use is a message, not a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host or "0.0.0.0", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def sign_in_url(listen_host: str, port: int, token: str, *, for_log: bool = False) -> str:
    """Percent-encoded: a token from ``openssl rand -base64`` holds ``+`` and ``/``, and a query reads ``+`` as a
    space, so the URL printed did not sign in.

    ``for_log``: what the daemon logs. Into the journal not the token: groups adm and systemd-journal read
    it, and the token is the page's and the API's key. A terminal's user gets the URL itself."""
    page_url = f"http://{webauth.host_port(webauth.url_host(listen_host), port)}/"
    if for_log and stderr_is_the_journal():
        return f"{page_url} (sign in with the URL `diffusiond web-url` prints; its token is kept out of the journal)"
    return f"{'open ' if for_log else ''}{page_url}?token={quote(token, safe='')}"


def stderr_is_the_journal() -> bool:
    """systemd.exec(5)'s test: JOURNAL_STREAM is the device:inode of the stream it connected. A shell started
    from a service (a terminal under a user manager) inherits the variable, not the stream."""
    try:
        device, inode = (int(part) for part in os.environ.get("JOURNAL_STREAM", "").split(":"))
        stat = os.fstat(2)
    except (ValueError, OSError):
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


def make_web_access(token: str, listen_host: str, metrics: Metrics) -> Middleware:
    def refuse(status: int, code: ErrorCode, message: str) -> HttpError:
        metrics.web_refused.labels(code.value).inc()
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return HttpError(status, code, message, headers=headers)

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        local = request.transport.get_extra_info("sockname") if request.transport else None
        if not local:
            raise HttpError(400, ErrorCode.HTTP_ERROR, "the connection closed")
        hosts = webauth.own_hosts(str(local[0]), int(local[1]), listen_host)
        if not webauth.host_allowed(request.headers.get("Host"), hosts):
            raise refuse(403, ErrorCode.WRONG_HOST,
                         f"Host {request.headers.get('Host')!r} is not this listener's address "
                         f"({', '.join(sorted(hosts))}); open the page as `diffusiond web-url` prints it")
        origins = request.headers.getall("Origin", [])
        if len(origins) > 1:  # a browser sends one; with two, a check of the first would let a foreign second through
            raise refuse(403, ErrorCode.CROSS_ORIGIN,
                         f"the request has {len(origins)} Origin headers; a request has at most one")
        origin = origins[0] if origins else None
        if origin is not None and not webauth.origin_allowed(origin, hosts):
            raise refuse(403, ErrorCode.CROSS_ORIGIN,
                         f"requests from the page of {origin!r} are refused; only this listener's own page may call it")
        cookie = webauth.cookie_name(int(local[1]))
        if request.path == "/" and "token" in request.query:
            if not same_token(request.query["token"], token):
                raise refuse(401, ErrorCode.UNAUTHORIZED, f"the token in this URL is not this daemon's; {SIGN_IN}")
            metrics.web_sessions.inc()
            resp = web.Response(status=303, headers={"Location": "/"})
            resp.set_cookie(cookie, token, httponly=True, samesite="Strict", path="/")
            return resp
        if not webauth.is_public(request.method, request.path) and not webauth.authorized(
            token, request.cookies.get(cookie), request.headers.get("Authorization")
        ):
            raise refuse(401, ErrorCode.UNAUTHORIZED,
                         f"not signed in: {SIGN_IN}, or send 'Authorization: Bearer <token>'")
        return await handler(request)

    return access


async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(PAGE_DIR / "index.html", headers={"Cache-Control": "no-store"})


# The page's files, named: a path from the request never reaches the file system (aiohttp's static
# route resolved any name it was given, and a name past the file system's length limit was a 500).
STATIC = {p.name: p for p in PAGE_DIR.iterdir() if p.suffix in (".html", ".js", ".css", ".svg")}


async def static(request: web.Request) -> web.FileResponse:
    path = STATIC.get(request.match_info["name"])
    if path is None:
        raise web.HTTPNotFound()
    # no-cache: revalidated (ETag) on every load. Without it a browser may reuse an upgraded daemon's old
    # scripts under its new page (index.html is never cached) for a while, and the two do not fit.
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(SECURITY_HEADERS)


def create_web_app(engine: Engine, *, token: str, listen_host: str) -> web.Application:
    app = web.Application(
        client_max_size=engine.config.limits.max_body_bytes,
        middlewares=[errors_middleware, make_web_access(token, listen_host, engine.metrics)],
    )
    app[ENGINE] = engine
    app.on_response_prepare.append(_security_headers)
    add_api_routes(app)
    app.router.add_get("/v1/admin/web", admin_web)  # a 403 here (docs/api.md): the URL is for the Unix socket only
    app.router.add_get("/", page)
    app.router.add_get("/static/{name:.*}", static)
    return app
