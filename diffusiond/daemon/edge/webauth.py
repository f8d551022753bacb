"""Who may use the web listener: the rules alone, as functions of headers and the socket's address.

A browser can be made to talk to a TCP port on this machine by any page it opens, so the web
listener trusts neither its network nor the browser's good intentions:

- DNS rebinding: a hostile name that resolves to 127.0.0.1 makes the browser send the attacker's
  requests here as "same-origin". Its Host header still carries the hostile name, so a Host that
  does not name this listener (the address the client connected to, the name it was configured
  with, or ``localhost`` on loopback) is refused, whatever else the request holds.
- Cross-site requests: another site's page can send a POST here (a "simple" request needs no
  preflight). The browser marks it with that site's Origin, which is refused; the cookie is also
  SameSite=Strict, so such a request would arrive without it anyway.
- Everything but the page itself (its HTML, CSS and JS, which hold nothing) needs the token: the
  cookie set when the token URL was opened, or ``Authorization: Bearer <token>`` for programs.

Kept free of aiohttp so each rule is tested on its own (tests/test_web_access.py); ``web.py``
applies them to requests.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from diffusiond.protocol import bearer_authorized, same_token

COOKIE_PREFIX = "diffusiond_token_"
PUBLIC_PREFIX = "/static/"
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def cookie_name(port: int) -> str:
    """Per port: browsers share cookies between the ports of one host, and two daemons on one
    machine (7860 and 7861) must not overwrite each other's sign-in."""
    return f"{COOKIE_PREFIX}{port}"


def host_port(host: str, port: int) -> str:
    """``host:port`` as it appears in a Host header and a URL (IPv6 addresses in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_host(listen_host: str) -> str:
    """The host to put in the URL a person opens: a wildcard listener is reached on loopback."""
    if listen_host in WILDCARD_HOSTS:
        return "::1" if listen_host == "::" else "127.0.0.1"
    return listen_host


def own_hosts(local_ip: str, port: int, listen_host: str) -> frozenset[str]:
    """The Host header values that name this listener, for a connection that arrived at
    ``local_ip:port``: that address, the host the listener was configured with (it may be a
    name), and ``localhost`` when the address is loopback. Port 80 may also come without a port."""
    ip = local_ip.removeprefix("::ffff:") if "." in local_ip else local_ip  # IPv4 on a dual-stack socket
    names = {ip.lower()}
    if listen_host not in WILDCARD_HOSTS:
        names.add(listen_host.lower())
    try:
        loopback = ipaddress.ip_address(ip.split("%", 1)[0]).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        names.add("localhost")
    hosts = {host_port(n, port) for n in names}
    if port == 80:
        hosts |= {f"[{n}]" if ":" in n else n for n in names}
    return frozenset(hosts)


def host_allowed(host_header: str | None, hosts: frozenset[str]) -> bool:
    return host_header is not None and host_header.lower() in hosts


def origin_allowed(origin: str, hosts: frozenset[str]) -> bool:
    """An Origin is ``scheme://host[:port]``; only this listener's own, over http, is ours
    (``null``, sent by sandboxed frames and files, is not; nor is one ``urlsplit`` cannot parse,
    such as ``http://[``, which raises ValueError)."""
    try:
        parts = urlsplit(origin)
        netloc = parts.netloc
    except ValueError:
        return False
    if parts.scheme != "http" or parts.path not in ("", "/") or parts.query or parts.fragment:
        return False
    return netloc.lower() in hosts


def authorized(token: str, cookie: str | None, authorization: str | None) -> bool:
    """The sign-in cookie or a bearer token."""
    return same_token(cookie, token) or bearer_authorized(authorization, token)


def is_public(method: str, path: str) -> bool:
    """The page itself: anyone who can reach the port may load the HTML, CSS and JS (they hold
    nothing; what they fetch needs the token). Every other request, reading or changing, needs it."""
    return method in ("GET", "HEAD") and (path == "/" or (path.startswith(PUBLIC_PREFIX) and ".." not in path))
