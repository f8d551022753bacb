"""The HTTP edge (docs/api.md): OpenAI-shaped images endpoint, jobs with SSE, service endpoints.

Handlers are thin: parse and validate (``requests``), call the engine, render JSON (``views``).
The engine raises domain errors and knows nothing of HTTP; the status code of each is chosen
here, in one table (``STATUS_OF_ERROR``), next to the one for jobs that failed
(``STATUS_OF_FAILURE``). Every error leaves as ``{"error": {...}}`` through one middleware,
including aiohttp's own (413 for a body over the limit, 404/405 for unknown routes), so clients
only ever parse one error shape.
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
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from diffusiond.daemon import bodies, errors, requests, views
from diffusiond.daemon.engine import Engine
from diffusiond.daemon.errors import EngineError
from diffusiond.daemon.inputs import EditInput
from diffusiond.daemon.jobs import Job, Preview
from diffusiond.daemon.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from diffusiond.daemon.requests import AddLoraBody, decode, parse_images
from diffusiond.protocol import FORMATS, TERMINAL_EVENTS, ErrorCode, Event, JobStatus, ModelState

log = logging.getLogger(__name__)

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SSE_HEARTBEAT_S = 15.0
# The kernel's send buffer of an event stream (Linux doubles it). Unix sockets default to about
# 208 KiB, which holds seconds of previews: a reader that lags would see old pictures, and none
# would be dropped. Events are small; this holds a few previews, so a lagging reader's stream
# backs up here, where the newest preview replaces the older one.
SSE_SNDBUF = 16 << 10
STREAM_CHUNK = 4 << 20

# The status code of every domain error, by class (the most specific class listed wins).
STATUS_OF_ERROR: dict[type[EngineError], int] = {
    errors.InvalidRequest: 400,
    errors.OutputTooLarge: 413,
    errors.UploadTooLarge: 413,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.OutputReleased: 410,
    errors.QueueFull: 429,
    errors.Unavailable: 503,
    errors.PowerFailed: 500,
    errors.InsufficientStorage: 507,
    errors.StateWriteFailed: 500,
}
# The status code of a synchronous request whose job ended without succeeding, by failure code.
STATUS_OF_FAILURE: dict[str, int] = {
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.CANCELLED: 409,
    ErrorCode.INSUFFICIENT_STORAGE: 507,
}
STATUS_OF_HTTP_ERROR_CODE = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


class HttpError(EngineError):
    """An error that only the HTTP edge can have (access control, aiohttp's own refusals)."""

    def __init__(self, status: int, code: ErrorCode, message: str, *, headers: dict[str, str] | None = None,
                 stage: str | None = None) -> None:
        super().__init__(message, code=code, stage=stage)
        self.status = status
        self.headers = headers or {}


def status_of(err: EngineError) -> int:
    if isinstance(err, HttpError):
        return err.status
    for cls in type(err).__mro__:
        if cls in STATUS_OF_ERROR:
            return STATUS_OF_ERROR[cls]
    return 500


def error_response(err: EngineError) -> web.Response:
    headers = dict(err.headers) if isinstance(err, HttpError) else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = f"{err.retry_after_s:g}"
    return web.json_response(err.body(), status=status_of(err), headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except EngineError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(HttpError(413, ErrorCode.REQUEST_TOO_LARGE, f"request body is too large: {exc.text}"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = STATUS_OF_HTTP_ERROR_CODE.get(exc.status, ErrorCode.HTTP_ERROR)
        return error_response(HttpError(exc.status, code, f"{exc.reason}: {request.method} {request.path}"))


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
    must send ``Authorization: Bearer <token>`` (constant-time compare)."""
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
            given = request.headers.get("Authorization", "")
            if token is None or not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise HttpError(401, ErrorCode.UNAUTHORIZED, "this listener needs 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return access


# jobs -----------------------------------------------------------------------------------------
async def create_job(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    limits = engine.config.limits
    # a job may carry base64 images: its body may then be as large as an upload, and only then
    body = await bodies.read_body(request, max(limits.max_body_bytes, limits.max_upload_bytes))
    b = requests.decode(body, requests.JobBody)
    if len(body) > limits.max_body_bytes and b.image is None and b.mask is None:
        raise bodies.too_large(len(body), limits.max_body_bytes)
    await engine.described()  # a request that comes while models load is completed with their own defaults
    model = engine.model(b.model)
    fields = msgspec.structs.asdict(b)
    edit = await bodies.decode_edit(engine, fields, model)
    try:
        req = requests.check(fields, limits, model, edit=edit, loras=engine.check_loras)
    except BaseException:
        if edit is not None:
            edit.close()
        raise
    job = await engine.accept(req)
    return web.json_response(views.job(job), status=202, headers={"Location": views.job_url(job.id)})


HISTORY_LIMIT = 100
HISTORY_MAX_LIMIT = 1000


async def list_jobs(request: web.Request) -> web.Response:
    """History, newest first: ``?status=&model=&before=<job id>&limit=``."""
    q = request.query
    status = None
    if q.get("status"):
        try:
            status = JobStatus(q["status"])
        except ValueError:
            raise errors.invalid(f"status {q['status']!r} is not one of {', '.join(s.value for s in JobStatus)}",
                                 "status") from None
    raw = q.get("limit", str(HISTORY_LIMIT))
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= HISTORY_MAX_LIMIT):
        raise errors.invalid(f"limit {raw!r} is not a whole number from 1 to {HISTORY_MAX_LIMIT}", "limit")
    page = await request.app[ENGINE].history.page(status, q.get("model") or None, q.get("before") or None, int(raw))
    return web.json_response(views.history(page.jobs, page.next_before))


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(views.job(await request.app[ENGINE].history.find(request.match_info["job_id"])))


async def delete_job(request: web.Request) -> web.Response:
    """Cancel a job that has not finished; delete a finished one (record and output files).
    ``?finished=keep`` only cancels: 409 for a finished job (what a client's cancel sends)."""
    engine = request.app[ENGINE]
    job_id = request.match_info["job_id"]
    if request.query.get("finished") == "keep":
        return web.json_response({**views.job(engine.cancel(job_id)), "deleted": False})
    job, deleted = await engine.history.remove(job_id)
    return web.json_response({**views.job(job), "deleted": deleted})


async def job_events(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    job = await engine.history.find(request.match_info["job_id"])
    metrics = engine.metrics
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    sock: socket.socket | None = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and job.request.preview is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SSE_SNDBUF)
    await resp.prepare(request)
    # Rendered as it happens (a later render would show a later state), written as the client reads.
    # Previews are the exception: a reader that lags must not pile them up, so only the newest one
    # of each output waits here (an int in the queue says which), and it is rendered when written.
    queue: asyncio.Queue[tuple[Event, bytes | int]] = asyncio.Queue()
    pending: dict[int, Preview] = {}

    def listener(e: Event, j: Job) -> None:
        if e == Event.PREVIEW:
            p = j.last_preview
            if p is None:
                return
            if p.index in pending:
                metrics.previews_dropped.inc()  # replaced before this reader got to it
            else:
                queue.put_nowait((e, p.index))
            pending[p.index] = p
            return
        queue.put_nowait((e, _sse(e, views.event(e, j))))

    job.listeners.add(listener)
    try:
        await resp.write(_sse(Event.STATUS, views.job(job)))  # a late subscriber gets the current state first
        if job.terminal:
            final = Event.DONE if job.status == JobStatus.SUCCEEDED else Event.ERROR
            await resp.write(_sse(final, views.job(job)))
            return resp
        for item in job.items:  # ... and the latest previews
            if item.preview is not None and item.index not in pending:
                pending[item.index] = item.preview
                queue.put_nowait((Event.PREVIEW, item.index))
        while True:
            try:
                e, chunk = await asyncio.wait_for(queue.get(), SSE_HEARTBEAT_S)
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            if isinstance(chunk, int):
                preview = pending.pop(chunk)
                await resp.write(_sse(e, views.preview(job, preview)))
                metrics.previews_sent.inc()
                continue
            await resp.write(chunk)
            if e in TERMINAL_EVENTS:
                return resp
    finally:
        job.listeners.discard(listener)


async def job_preview(request: web.Request) -> web.Response:
    """The latest preview of one output, as a file (what a page's <img> or a terminal shows)."""
    engine = request.app[ENGINE]
    preview = engine.preview(request.match_info["job_id"], _index(request.match_info["k"]))
    return web.Response(body=preview.data, headers={
        "Content-Type": FORMATS[preview.format].content_type, "Cache-Control": "no-store",
        "X-Preview-Step": str(preview.step), "X-Preview-Total": str(preview.total)})


def _index(raw: str) -> int:
    """An output index from the path: ASCII digits only (int() would also take "-1", Python's last
    item, " 1", "1_0" and non-ASCII digits); anything else is -1, which no output has."""
    return int(raw) if raw.isascii() and raw.isdigit() else -1


def _sse(e: Event, data: dict[str, Any]) -> bytes:
    return f"event: {e.value}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def job_output(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    job = await engine.history.find(request.match_info["job_id"])
    k = _index(request.match_info["k"])
    headers = {"Content-Disposition": f'inline; filename="{views.output_filename(job, k)}"',
               "Content-Type": FORMATS[job.request.output_format].content_type}
    async with engine.open_output(job, k) as read:
        headers["X-Seed"] = str(job.items[k].seed)
        if not read.header:
            return web.Response(body=read.payload, headers=headers)
        resp = web.StreamResponse(headers=headers)
        resp.content_length = len(read)
        await resp.prepare(request)
        stall = engine.config.stream_stall_s
        try:
            await asyncio.wait_for(resp.write(read.header), stall)
            for off in range(0, len(read.payload), STREAM_CHUNK):
                await asyncio.wait_for(resp.write(read.payload[off : off + STREAM_CHUNK]), stall)
        except TimeoutError:
            # A reader that stopped reading must not pin shared memory for ever: drop it.
            log.warning("client stopped reading output %d of job %s for %gs; closing", k, job.id, stall)
            if request.transport is not None:
                request.transport.close()
            return resp
        await resp.write_eof()
        read.complete = True
        return resp


# OpenAI-shaped --------------------------------------------------------------------------------
async def images_generations(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await request.read()
    await engine.described()
    req, response_format = parse_images(body, engine.config.limits, engine.model, loras=engine.check_loras)
    job = await engine.accept(req, sync=True)
    data = await _finish_sync([job], engine, response_format)
    return web.json_response({"created": int(job.created), "data": data, "job_id": job.id})


async def _finish_sync(jobs: list[Job], engine: Engine, response_format: str) -> list[dict[str, Any]]:
    """Wait for synchronous jobs and draw OpenAI's ``data`` list, in order; a client that goes
    away cancels them (nobody will read the result), a failure of any is the answer."""
    try:
        for job in jobs:
            await job.finished.wait()
    except asyncio.CancelledError:
        for job in jobs:
            if not job.terminal:
                engine.cancel(job.id)
        raise
    failed = next((j for j in jobs if j.status != JobStatus.SUCCEEDED), None)
    if failed is not None:
        for job in jobs:  # the answer is the failure: the others' outputs will not be fetched
            if job.status == JobStatus.SUCCEEDED:
                engine.outputs.expire(job)
        err = failed.error or {}
        code = ErrorCode(err.get("code", ErrorCode.GENERATION_FAILED))
        raise HttpError(STATUS_OF_FAILURE.get(code, 500), code, err.get("message", "the job failed"),
                        stage=err.get("stage"))
    data: list[dict[str, Any]] = []
    for job in jobs:
        if response_format == "url":
            data += [{"revised_prompt": None, "seed": i.seed, "url": views.output_url(job.id, i.index)}
                     for i in job.items]
        else:  # delivered whole: the synchronous caller will not come back, so nothing is kept
            data += [{"revised_prompt": None, "seed": i.seed, "b64_json": base64.b64encode(b).decode()}
                     for i, b in zip(job.items, await engine.output_bytes(job), strict=True)]
    return data


async def images_edits(request: web.Request) -> web.Response:
    """OpenAI's edits endpoint: a multipart form with ``image`` (or several ``image[]``), an
    optional ``mask`` (for the first image, as OpenAI's) and text fields. Each image is one job
    (``n`` outputs each), run side by side; the answer lists their outputs in the order of the images."""
    engine = request.app[ENGINE]
    text, images, mask = await bodies.read_edit_form(request, engine.config.limits.max_upload_bytes)
    await engine.described()
    fields = requests.edits_form(text)
    model = engine.model(fields.get("model"))
    if not images:
        raise errors.invalid("send the image to edit as the multipart file field 'image'", field="image")
    edits: list[EditInput] = []
    jobs: list[Job] = []
    try:
        for k, (name, data) in enumerate(images):  # as OpenAI's: the mask applies to the first image
            one = {**fields, "image_bytes": data, "mask_bytes": mask if k == 0 else None}
            edit = await bodies.decode_edit(engine, one, model, image_field=name, size_field="size")
            assert edit is not None
            edits.append(edit)
        for edit in edits:
            jobs.append(await engine.accept(requests.check(fields, engine.config.limits, model, size_field="size",
                                                           edit=edit, loras=engine.check_loras), sync=True))
    except BaseException:
        for edit in edits:
            edit.close()  # those already submitted are closed by their jobs too; closing twice is harmless
        for job in jobs:
            if not job.terminal:
                engine.cancel(job.id)
        raise
    out = await _finish_sync(jobs, engine, fields["response_format"])
    return web.json_response({"created": int(jobs[0].created), "data": out, "job_id": jobs[0].id,
                              "job_ids": [j.id for j in jobs]})


# service --------------------------------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    return web.json_response(views.models(request.app[ENGINE].models()))


async def health(request: web.Request) -> web.Response:
    snap = views.health(request.app[ENGINE])
    ok = bool(snap["workers"]) and all(w["state"] in ("ready", "sleeping") and w["answering"]
                                       for w in snap["workers"])
    return web.json_response(snap, status=200 if ok else 503)


async def ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.started and engine.accepting and any(m.state in (ModelState.READY, ModelState.SLEEPING)
                                                   for m in engine.models()):
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


async def list_loras(request: web.Request) -> web.Response:
    return web.json_response(views.loras(request.app[ENGINE]))


async def admin_add_lora(request: web.Request) -> web.Response:
    """Register a LoRA at run time: ``{"name": ..., "path": ...}``; 201 with its entry, or a 4xx
    naming the field (the daemon goes on either way)."""
    engine = request.app[ENGINE]
    body = decode(await request.read(), AddLoraBody)
    info = await engine.add_lora(body.name, body.path)
    return web.json_response(views.lora(engine, info), status=201)


async def admin_trace(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.config.trace:
        raise errors.TraceOff("the daemon was started without --trace; restart it with --trace to record")
    return web.json_response(views.trace(await engine.trace()))


@dataclass
class WebAddress:
    """The web listener's sign-in URL, filled in once it listens (``diffusiond web-url`` reads it)."""

    url: str | None = None


WEB: web.AppKey[WebAddress] = web.AppKey("web", WebAddress)


async def admin_web(request: web.Request) -> web.Response:
    if peer_uid(request) is None:  # the URL carries the token: only for this machine's socket users
        raise HttpError(403, ErrorCode.FORBIDDEN,
                        "the web page's URL is only given over the Unix socket: run `diffusiond web-url` there")
    url = request.app[WEB].url
    if url is None:
        raise errors.WebOff("this daemon has no web listener; start it with `diffusiond serve --web [HOST:PORT]`")
    return web.json_response({"url": url})


def add_api_routes(app: web.Application) -> None:
    """The API's routes, the same on every listener (the Unix socket, --tcp, the web page's /v1)."""
    app.router.add_post("/v1/images/generations", images_generations)
    app.router.add_post("/v1/images/edits", images_edits)
    app.router.add_post("/v1/jobs", create_job)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_delete("/v1/jobs/{job_id}", delete_job)
    app.router.add_get("/v1/jobs/{job_id}/events", job_events)
    app.router.add_get("/v1/jobs/{job_id}/outputs/{k}", job_output)
    app.router.add_get("/v1/jobs/{job_id}/preview/{k}", job_preview)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/admin/sleep", admin_sleep)
    app.router.add_post("/v1/admin/wake", admin_wake)
    app.router.add_get("/v1/admin/trace", admin_trace)
    app.router.add_get("/v1/loras", list_loras)
    app.router.add_post("/v1/loras", admin_add_lora)


def create_app(engine: Engine, *, token: str | None = None, web_address: WebAddress | None = None) -> web.Application:
    cfg = engine.config
    app = web.Application(
        client_max_size=cfg.limits.max_body_bytes,
        middlewares=[errors_middleware, make_access_middleware(cfg.allow_uid, token)],
    )
    app[ENGINE] = engine
    app[WEB] = web_address or WebAddress()
    engine.metrics.bind(lambda: views.health(engine))
    add_api_routes(app)
    app.router.add_get("/v1/admin/web", admin_web)
    return app
