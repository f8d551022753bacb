"""Who may use a listener: on the Unix socket the peer's uid (SO_PEERCRED, with ``--allow-uid``), on TCP
a bearer token compared in constant time. The web listener adds its own rules (``webauth.py``)."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from aiohttp import web

from diffusiond.daemon.edge.status import Handler, HttpError
from diffusiond.protocol import BEARER_NEEDED, ErrorCode, bearer_authorized


def peer_uid(request: web.Request) -> int | None:
    sock: socket.socket | None = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    return socket_peer_uid(sock)


def socket_peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def make_access_middleware(allow_uid: tuple[int, ...], token: str | None) -> Any:
    """Unix-socket peers are checked by uid (SO_PEERCRED) when ``allow_uid`` is set; TCP peers
    must send ``Authorization: Bearer <token>`` (constant-time compare), read as the web listener reads it."""
    allowed = set(allow_uid) | {os.getuid()}

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        sock: socket.socket | None = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None and sock.family == socket.AF_UNIX:
            if allow_uid:
                uid = peer_uid(request)
                if uid not in allowed:
                    raise HttpError(403, ErrorCode.FORBIDDEN,
                                    f"uid {uid} is not allowed to use this daemon (--allow-uid)")
        else:
            if token is None or not bearer_authorized(request.headers.get("Authorization"), token):
                raise HttpError(401, ErrorCode.UNAUTHORIZED, BEARER_NEEDED,
                                headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return access
