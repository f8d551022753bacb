"""One aiohttp pool to one daemon's socket, and the one place a request's failure becomes the client's own.

Apart from ``aio.py`` so the client class reads as what it offers: how a pool is opened (lazily, on the loop that
first uses it), how long connecting may take, and which of aiohttp's and asyncio's exceptions turns into which of
``errors.py``'s are rules every call shares, and a caller catching ``ClientError`` relies on all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from diffusiond.client.errors import OTHER_USER, ClientError, ClientTimeout, DaemonUnreachable, permission_denied
from diffusiond.client.transport import error_from, parse_json, reason

BASE_URL = "http://diffusiond"
"""The host part is ignored on a Unix socket; a fixed name keeps URLs readable in logs."""

_CONNECT_TIMEOUT_S = 30.0


class Connection:
    """The pool under ``AsyncClient``: ``socket_path`` and ``timeout`` are the client's (its docstring says what
    ``timeout`` bounds); every request goes through ``_request``."""

    def __init__(self, socket_path: str, timeout: float | None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        # Created lazily, inside the running loop: aiohttp binds a session to the loop it starts on.
        if self._closed:  # a pool opened now would be closed by nobody (aiohttp's "Unclosed client session")
            raise ClientError(f"the client of {self.socket_path} is closed; make a new AsyncClient")
        if self._session is None:
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path),
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self._connect_s()),
            )
        return self._session

    async def _close_pool(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    @asynccontextmanager
    async def _request(
        self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A response whose status is in ``ok``; any other status becomes a DaemonError.

        aiohttp's and asyncio's exceptions, raised before the answer or while its body is read
        inside the ``async with``, become the client's own (the tree is in ``diffusiond.client``).
        """
        session = self._open()
        try:
            async with session.request(method, BASE_URL + path, **kwargs) as resp:
                if resp.status not in ok:
                    raise await error_from(resp)
                yield resp
        except ClientError:
            raise
        except aiohttp.ConnectionTimeoutError as exc:  # the socket is there; its backlog did not move
            raise ClientTimeout(self.socket_path, f"connecting for {method} {path}", self._connect_s()) from exc
        except aiohttp.ClientConnectorError as exc:
            raise DaemonUnreachable(self.socket_path, reason(exc), OTHER_USER if permission_denied(exc) else None) \
                from exc
        except TimeoutError as exc:  # aiohttp's timeouts are also connection errors: the clearer of the two
            raise ClientTimeout(self.socket_path, f"{method} {path}", self.timeout) from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise DaemonUnreachable(self.socket_path, f"connection lost: {reason(exc)}") from exc
        except aiohttp.ClientError as exc:  # something answered, but not in HTTP that makes sense
            raise DaemonUnreachable(self.socket_path, f"not a diffusiond answer: {reason(exc)}") from exc

    def _connect_s(self) -> float:
        return _CONNECT_TIMEOUT_S if self.timeout is None else min(self.timeout, _CONNECT_TIMEOUT_S)

    async def _json(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any) -> dict[str, Any]:
        async with self._request(method, path, ok=ok, **kwargs) as resp:
            return parse_json(await resp.read(), resp.status)
