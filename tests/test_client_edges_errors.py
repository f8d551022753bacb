"""The client's own errors as a person reads them: one found on this side names no HTTP status, and a closed
client says it is closed rather than open a pool nobody closes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from diffusiond.client import AsyncClient, ClientError, DaemonError


def test_an_error_found_on_this_side_names_no_http_status() -> None:
    """Status 0 read "(stream_ended, HTTP 0)": no HTTP answer said 0."""
    assert str(DaemonError(0, "stream_ended", "the stream kept ending")) == "the stream kept ending (stream_ended)"
    assert str(DaemonError(409, "conflict", "finished")) == "finished (conflict, HTTP 409)"


def test_a_closed_async_client_refuses_further_calls(tmp_path: Path) -> None:
    """Its next call opened a fresh pool that nothing closed (aiohttp: "Unclosed client session")."""
    async def after_close() -> None:
        c = AsyncClient(str(tmp_path / "d.sock"))
        await c.close()
        await c.health()

    with pytest.raises(ClientError, match=r"the client of .*d\.sock is closed; make a new AsyncClient"):
        asyncio.run(after_close())
