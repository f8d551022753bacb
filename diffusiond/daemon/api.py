"""The HTTP API (API.md): OpenAI-shaped images endpoint, jobs with SSE, service endpoints.

Handlers are thin: parse and validate (``requests``), call the engine, render JSON. Every error
leaves as ``{"error": {...}}`` through one middleware, including aiohttp's own (413 for a body
over the limit, 404/405 for unknown routes), so clients only ever parse one error shape.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from diffusiond.daemon.engine import Engine
from diffusiond.daemon.errors import ApiError
from diffusiond.daemon.jobs import Status
from diffusiond.daemon.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from diffusiond.daemon.requests import parse_images, parse_job

log = logging.getLogger(__name__)

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SSE_HEARTBEAT_S = 15.0
STREAM_CHUNK = 4 << 20
_FAILURE_STATUS = {"deadline_exceeded": 504, "shutting_down": 503, "cancelled": 409}


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(ApiError(413, "request_too_large", f"request body is too large: {exc.text}"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return error_response(ApiError(exc.status, code, f"{exc.reason}: {request.method} {request.path}"))


def peer_uid(request: web.Request) -> int | None:
    sock: socket.socket | None = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def make_access_middleware(allow_uid: tuple[int, ...], token: str | None) -> Any:
    """Unix-socket peers are checked by uid (SO_PEERCRED) when ``allow_uid`` is set; TCP peers
    must send ``Authorization: Bearer <token>`` (constant-time compare)."""
    allowed = set(allow_uid) | {os.getuid()}

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        sock: socket.socket | None = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None and sock.family == socket.AF_UNIX:
            if allow_uid:
                uid = peer_uid(request)
                if uid not in allowed:
                    raise ApiError(403, "forbidden", f"uid {uid} is not allowed to use this daemon (--allow-uid)")
        else:
            given = request.headers.get("Authorization", "")
            if token is None or not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise ApiError(401, "unauthorized", "this listener needs 'Authorization: Bearer <token>'",
                               headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return access


# jobs -----------------------------------------------------------------------------------------
async def create_job(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    req = parse_job(await request.read(), engine.config.limits, lambda m: _model_info(engine, m))
    job = engine.submit(req)
    return web.json_response(job.to_json(), status=202, headers={"Location": f"/v1/jobs/{job.id}"})


async def list_jobs(request: web.Request) -> web.Response:
    jobs = sorted(request.app[ENGINE].jobs.values(), key=lambda j: j.created, reverse=True)
    return web.json_response({"object": "list", "data": [j.to_json() for j in jobs[:100]]})


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].get(request.match_info["job_id"]).to_json())


async def delete_job(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].cancel(request.match_info["job_id"]).to_json())


async def job_events(request: web.Request) -> web.StreamResponse:
    job = request.app[ENGINE].get(request.match_info["job_id"])
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
    job.listeners.add(queue)
    try:
        await _sse(resp, "status", job.to_json())  # a late subscriber gets the current state first
        if job.terminal:
            await _sse(resp, "done" if job.status == Status.SUCCEEDED else "error", job.to_json())
            return resp
        while True:
            try:
                event, data = await asyncio.wait_for(queue.get(), SSE_HEARTBEAT_S)
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            await _sse(resp, event, data)
            if event in ("done", "error"):
                return resp
    finally:
        job.listeners.discard(queue)


async def _sse(resp: web.StreamResponse, event: str, data: dict[str, Any]) -> None:
    await resp.write(f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode())


async def job_output(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    job = engine.get(request.match_info["job_id"])
    raw = request.match_info["k"]
    # ASCII digits only: int() would also take "-1" (Python's last item), " 1", "1_0" and non-ASCII digits
    k = int(raw) if raw.isascii() and raw.isdigit() else -1
    if not 0 <= k < len(job.items):
        raise ApiError(404, "output_not_found", f"job {job.id} has outputs 0..{len(job.items) - 1}")
    item = job.items[k]
    if not item.done:
        raise ApiError(409, "output_not_ready", f"output {k} of job {job.id} is not ready (job {job.status.value})",
                       stage=job.stage.label)
    ext = job.request.output_format
    headers = {"Content-Disposition": f'inline; filename="{job.id}-{k}.{ext}"', "X-Seed": str(item.seed)}
    if item.data is not None:
        return web.Response(body=item.data, content_type=item.content_type, headers=headers)
    if item.desc is None:
        raise ApiError(410, "output_released",
                       f"output {k} of job {job.id} was already streamed: npy outputs are sent once, straight "
                       "from shared memory, and then released; fetch it once, or ask for png/webp/mp4 to keep "
                       "an encoded copy")
    engine.outputs.pin(item)
    delivered = False
    try:
        header, payload = engine.outputs.npy_parts(item)
        resp = web.StreamResponse(headers={**headers, "Content-Type": item.content_type})
        resp.content_length = len(header) + len(payload)
        await resp.prepare(request)
        stall = engine.config.stream_stall_s
        try:
            await asyncio.wait_for(resp.write(header), stall)
            for off in range(0, len(payload), STREAM_CHUNK):
                await asyncio.wait_for(resp.write(payload[off : off + STREAM_CHUNK]), stall)
        except TimeoutError:
            # A reader that stopped reading must not pin shared memory for ever: drop it.
            log.warning("client stopped reading output %d of job %s for %gs; closing", k, job.id, stall)
            if request.transport is not None:
                request.transport.close()
            return resp
        await resp.write_eof()
        delivered = True
        return resp
    finally:
        with contextlib.suppress(NameError):
            del payload
        engine.outputs.unpin(item)
        if delivered:
            engine.outputs.streamed(item)


# OpenAI-shaped --------------------------------------------------------------------------------
async def images_generations(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    req, response_format = parse_images(await request.read(), engine.config.limits,
                                        lambda m: _model_info(engine, m))
    job = engine.submit(req, sync=True)
    try:
        await job.finished.wait()
    except asyncio.CancelledError:  # the client went away: nobody will read the result
        if not job.terminal:
            engine.cancel(job.id)
        raise
    if job.status != Status.SUCCEEDED:
        err = job.error or {}
        code = err.get("code", "generation_failed")
        raise ApiError(_FAILURE_STATUS.get(code, 500), code, err.get("message", "the job failed"),
                       stage=err.get("stage"))
    data = []
    for item in job.items:
        entry: dict[str, Any] = {"revised_prompt": None, "seed": item.seed}
        if response_format == "url":
            entry["url"] = f"/v1/jobs/{job.id}/outputs/{item.index}"
        else:
            entry["b64_json"] = base64.b64encode(_output_bytes(engine, item)).decode()
        data.append(entry)
    if response_format != "url":
        engine.outputs.release_all(job)  # delivered: the synchronous caller will not come back
    return web.json_response({"created": int(job.created), "data": data, "job_id": job.id})


def _output_bytes(engine: Engine, item: Any) -> bytes:
    if item.data is not None:
        return item.data
    header, payload = engine.outputs.npy_parts(item)
    out = header + bytes(payload)
    del payload
    return out


# service --------------------------------------------------------------------------------------
def _model_info(engine: Engine, name: str | None) -> Any:
    return engine.model(name)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    data = [{"id": m.name, "object": "model", "owned_by": "diffusiond", "task": m.task, "spec": m.config.spec,
             "device": ",".join(m.config.devices), "dtype": m.config.dtype, "state": m.state,
             "synthetic": m.config.spec.startswith(("random:", "synthetic"))}
            for m in engine.models.values()]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    snap = request.app[ENGINE].snapshot()
    ok = bool(snap["workers"]) and all(w["state"] in ("ready", "sleeping") and w["answering"]
                                       for w in snap["workers"])
    return web.json_response(snap, status=200 if ok else 503)


async def ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.accepting and any(m.state in ("ready", "sleeping") for m in engine.models.values()):
        return web.json_response({"ready": True})
    reason = "draining" if engine.draining else "starting"
    return web.json_response({"ready": False, "reason": reason}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def admin_sleep(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    await request.app[ENGINE].sleep()
    return web.json_response({"sleeping": True, "took_ms": round((time.perf_counter() - t0) * 1000, 1)})


async def admin_wake(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    await request.app[ENGINE].wake()
    return web.json_response({"sleeping": False, "took_ms": round((time.perf_counter() - t0) * 1000, 1)})


async def admin_trace(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.config.trace:
        raise ApiError(409, "trace_off", "the daemon was started without --trace; restart it with --trace to record")
    return web.json_response({"workers": await engine.trace()})


def create_app(engine: Engine, *, token: str | None = None) -> web.Application:
    cfg = engine.config
    app = web.Application(
        client_max_size=cfg.limits.max_body_bytes,
        middlewares=[errors_middleware, make_access_middleware(cfg.allow_uid, token)],
    )
    app[ENGINE] = engine
    app.router.add_post("/v1/images/generations", images_generations)
    app.router.add_post("/v1/jobs", create_job)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_delete("/v1/jobs/{job_id}", delete_job)
    app.router.add_get("/v1/jobs/{job_id}/events", job_events)
    app.router.add_get("/v1/jobs/{job_id}/outputs/{k}", job_output)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/admin/sleep", admin_sleep)
    app.router.add_post("/v1/admin/wake", admin_wake)
    app.router.add_get("/v1/admin/trace", admin_trace)
    return app
