"""``diffusiond unload --all`` against a real daemon of two models: each model is tried on its own, so one whose
unload fails is reported and the other still leaves, and the exit status says that one failed.

The daemon itself never refuses to unload a model it serves (one with work leaves once that is done, a pinned
one leaves all the same: daemon/residency/byhand.py and policy.py's ``evict``), so the failure comes from a proxy
in front of it: one model's unload is answered with the daemon's own error shape, and every other request goes
through to the daemon.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from daemonkit import Daemon, get, http

from conftest import ROOT

REFUSED = "a"
"""Listed first (the daemon lists its models in the order they were given), so a loop that stopped at the first
failure would never reach the other one."""


@asynccontextmanager
async def refusing_proxy(daemon: Path, path: Path, refused: str) -> AsyncIterator[None]:
    """A socket at ``path`` that passes requests through to ``daemon``, but answers ``refused``'s unload with a
    500 ``internal_error``, as the daemon's last-resort handler shapes it."""
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(daemon))) as session:
        async def forward(request: web.Request) -> web.Response:
            if request.method == "POST" and request.path == f"/v1/models/{refused}/unload":
                return web.json_response({"error": {"code": "internal_error", "message": "moving it failed"}},
                                         status=500)
            async with session.request(request.method, "http://diffusiond" + request.path_qs,
                                       data=await request.read()) as r:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.UnixSite(runner, str(path)).start()
            yield
        finally:
            await runner.cleanup()


async def residency(s: aiohttp.ClientSession) -> dict[str, Any]:
    status, body = await get(s, "/v1/models")
    assert status == 200, body
    return {m["id"]: m["residency"] for m in body["data"]}


def test_unload_all_tries_every_model_reports_the_one_that_failed_and_exits_1(
        daemon_factory: Any, tmp_path: Path) -> None:
    d: Daemon = daemon_factory("--model", f"{REFUSED}=synthetic:compute_ms=5", "--model", "b=synthetic:compute_ms=5",
                               "--no-persist")
    proxy = tmp_path / "proxy.sock"

    async def go() -> None:
        async with http(d.socket) as s:
            assert await residency(s) == {REFUSED: "device", "b": "device"}
            async with refusing_proxy(d.socket, proxy, REFUSED):
                cli = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "diffusiond", "unload", "--all", "--socket", str(proxy), cwd=ROOT,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = (b.decode() for b in await asyncio.wait_for(cli.communicate(), 120))
            assert cli.returncode == 1, (out, err)
            assert f"error: {REFUSED}: " in err and "moving it failed" in err, err
            assert "Traceback" not in err, err
            assert out.startswith("b: disk"), (out, err)  # the one after the failure was still tried
            assert await residency(s) == {REFUSED: "device", "b": "disk"}

    asyncio.run(go())
