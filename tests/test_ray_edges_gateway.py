"""The gateway and the replica's relay together, without a cluster: a request goes through ``Gateway.__call__``
to ``DaemonReplica.forward`` (a handle that calls it in this process stands in for Serve's) and on to a real
daemon on ``tiny``, so what the client is given (job URLs, ``Location``, ids, status) is what Serve's proxy would
give it; Serve's own routing is what test_ray.py runs on a cluster."""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from daemonkit import until

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'diffusiond[ray]')")

from ray.exceptions import ActorDiedError
from starlette.requests import Request
from starlette.responses import Response

from diffusiond.ray import ids
from diffusiond.ray.gateway import Gateway, unanswered
from diffusiond.ray.replica import DaemonReplica

JOB = {"model": "tiny", "width": 64, "height": 64, "steps": 2, "prompt": "a cat", "seed": 1}


class _Stream:
    def __init__(self, parts: AsyncIterator[bytes]) -> None:
        self.parts = parts

    async def __anext__(self) -> bytes:
        return await self.parts.__anext__()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.parts

    def cancel(self) -> None:
        pass


class _Handle:
    """Serve's handle to the daemon deployment, reduced to the one replica it would route to."""

    def __init__(self, replica: DaemonReplica) -> None:
        self.forward = types.SimpleNamespace(remote=lambda raw, **kw: _Stream(replica.forward(raw, **kw)))

    def options(self, **_: Any) -> _Handle:
        return self


@contextlib.asynccontextmanager
async def gateway_to(daemon: Any) -> AsyncIterator[Gateway]:
    r = DaemonReplica.__new__(DaemonReplica)  # its daemon started by the test, not by Serve
    r.replica = r.store = "r1"
    r.socket, r.proc, r.adoption, r._session = daemon.socket, daemon.proc, None, None
    try:
        yield Gateway(_Handle(r))
    finally:
        await r._http().close()


async def call(gw: Gateway, method: str, path: str, body: bytes = b"", prefix: str = "",
               query: str = "") -> tuple[Response, bytes]:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {"type": "http", "method": method, "path": prefix + path, "root_path": prefix,
             "query_string": query.encode(), "headers": [(b"content-type", b"application/json")]}
    resp = await gw(Request(scope, receive))
    if hasattr(resp, "body_iterator"):
        return resp, b"".join([c if isinstance(c, bytes) else c.encode() async for c in resp.body_iterator])
    return resp, bytes(resp.body)


async def test_job_urls_and_location_are_under_the_applications_route_prefix(daemon_factory: Any) -> None:
    """With ``route_prefix=/gen`` the gateway answered at /gen but gave out /v1/jobs/... URLs, which 404."""
    async with gateway_to(daemon_factory("--model", "tiny", "--device", "cpu", "--no-persist")) as gw:
        await _prefixed(gw)


async def _prefixed(gw: Gateway) -> None:
    resp, body = await call(gw, "POST", "/v1/jobs", json.dumps(JOB).encode(), prefix="/gen")
    assert resp.status_code == 202, body
    job = json.loads(body)["id"]
    assert job.startswith("r1.j_") and resp.headers["location"] == f"/gen/v1/jobs/{job}"

    async def finished() -> dict[str, Any] | None:
        _, b = await call(gw, "GET", f"/v1/jobs/{job}", prefix="/gen")
        doc: dict[str, Any] = json.loads(b)
        return doc if doc["status"] == "succeeded" else None

    doc = await until(finished, timeout=120, what="the job finished")
    url = doc["outputs"][0]["url"]
    assert url == f"/gen/v1/jobs/{job}/outputs/0"
    resp, png = await call(gw, "GET", url.removeprefix("/gen"), prefix="/gen")
    assert resp.status_code == 200 and png.startswith(b"\x89PNG")

    resp, body = await call(gw, "POST", "/v1/images/generations",
                            json.dumps({"model": "tiny", "size": "64x64", "num_inference_steps": 2, "prompt": "a cat",
                                        "response_format": "url"}).encode(), prefix="/gen")
    assert resp.status_code == 200, body
    assert json.loads(body)["data"][0]["url"].startswith("/gen/v1/jobs/r1.j_")

    resp, body = await call(gw, "POST", "/v1/jobs", json.dumps(JOB).encode())  # no prefix: as before
    assert resp.headers["location"] == f"/v1/jobs/{json.loads(body)['id']}"


async def test_a_deeply_nested_body_head_requests_and_a_model_named_like_a_job(daemon_factory: Any) -> None:
    async with gateway_to(daemon_factory("--model", "j_1=tiny", "--device", "cpu", "--no-persist")) as gw:
        await _edges(gw)


async def _edges(gw: Gateway) -> None:
    # json.loads raises RecursionError, not ValueError, for deep nesting: the gateway answered 500
    resp, body = await call(gw, "POST", "/v1/jobs", b"[" * 100_000)
    assert resp.status_code == 400 and json.loads(body)["error"]["code"] in ("invalid_json", "invalid_request"), body

    resp, body = await call(gw, "GET", "/v1/models")
    assert [m["id"] for m in json.loads(body)["data"]] == ["j_1"], "a model's name is not a job id"

    resp, body = await call(gw, "POST", "/v1/jobs", json.dumps({**JOB, "model": "j_1"}).encode())
    job = json.loads(body)["id"]
    for path in ("/health", "/v1/models", f"/v1/jobs/{job}"):  # the daemon answers HEAD on its GET routes
        resp, body = await call(gw, "HEAD", path)
        assert resp.status_code == 200 and body == b"", (path, resp.status_code, body)
    resp, body = await call(gw, "HEAD", "/v1/images/generations")
    assert resp.status_code == 405 and "HEAD /v1/images/generations" in json.loads(body)["error"]["message"]


def test_a_503_says_the_replica_ended_only_when_it_did() -> None:
    died = unanswered(ActorDiedError(), "r1", adopts=True)
    assert "replica r1 ended" in died and "adopted" in died
    assert "lost with it" in unanswered(ActorDiedError(), None, adopts=False)
    refused = unanswered(RuntimeError("queue full at the router"), None, adopts=False)
    assert "ended" not in refused and "lost" not in refused and "queue full at the router" in refused


def test_head_is_routed_as_get_and_refused_where_get_is() -> None:
    assert ids.route("HEAD", "/v1/jobs/r1.j_00ab/outputs/0") == ("r1", "/v1/jobs/j_00ab/outputs/0")
    assert ids.route_query("HEAD", "/v1/jobs", "before=r1.j_00ab") == ("r1", "before=j_00ab")
    with pytest.raises(ids.RouteError) as err:
        ids.route("HEAD", "/v1/jobs/r1.j_00ab/events/x")
    assert err.value.status == 404 and "HEAD" in str(err.value)


def test_msgpack_calls_without_a_prefix_still_decode() -> None:
    """A gateway and replicas of different versions meet during a rolling redeploy."""
    from diffusiond.ray.replica import Call

    old = msgspec.msgpack.encode({"method": "GET", "path": "/v1/jobs", "replica": None})
    assert msgspec.msgpack.decode(old, type=Call).prefix == ""
