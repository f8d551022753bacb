"""The jobs API (docs/api.md, "Jobs"): submit, look up, page through history, delete, follow by
Server-Sent Events, read outputs and previews. Handlers are thin: parse and validate
(``requests``), call the engine, render JSON (``views``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

import msgspec
from aiohttp import web

from diffusiond.daemon import errors
from diffusiond.daemon.core import endings
from diffusiond.daemon.core.jobs import Job, Preview
from diffusiond.daemon.edge import bodies, controls, ip_adapters, requests, sizes, streaming, upscale, views
from diffusiond.daemon.edge.status import ENGINE
from diffusiond.daemon.errors import JobNotFound
from diffusiond.daemon.outputs import sound
from diffusiond.protocol import AUDIO_ARRAY, FORMATS, TERMINAL_EVENTS, Event, JobStatus

log = logging.getLogger(__name__)

SSE_HEARTBEAT_S = 15.0
# The kernel's send buffer of an event stream (Linux doubles it). Unix sockets default to about
# 208 KiB, which holds seconds of previews: a reader that lags would see old pictures, and none
# would be dropped. Events are small; this holds a few previews, so a lagging reader's stream
# backs up here, where the newest preview replaces the older one.
SSE_SNDBUF = 16 << 10

async def create_job(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    limits = engine.config.limits
    # a job may carry base64 images: its body may then be as large as an upload, and only then
    body = await bodies.read_body(request, max(limits.max_body_bytes, limits.max_upload_bytes))
    b = requests.decode(body, requests.JobBody)
    if len(body) > limits.max_body_bytes and b.image is None and b.mask is None and not b.control \
            and not b.ip_adapter and not b.images:
        raise bodies.too_large(len(body), limits.max_body_bytes)
    await engine.described(b.model)  # completed with its model's own defaults, even while it loads
    model = engine.model(b.model)
    fields = sizes.sized(msgspec.structs.asdict(b))  # "size": "512x512" -> width, height
    edit = await bodies.decode_edit(engine, fields, model)
    req = None
    try:
        req = requests.check(fields, limits, model, edit=edit, loras=engine.check_loras)
        req = upscale.attach(engine, fields, model, req)  # before the control images: it holds nothing
        req = await controls.attach(engine, fields, model, req)
        req = await ip_adapters.attach(engine, fields, model, req)
    except BaseException:
        if req is not None:  # the control images decoded before a later refusal
            req.close_inputs()
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
    # the length first: int() of over 4,300 digits raises ValueError (CPython's guard against slow conversion)
    if not (len(raw) <= 8 and raw.isascii() and raw.isdigit() and 1 <= int(raw) <= HISTORY_MAX_LIMIT):
        raise errors.invalid(f"limit {raw[:40]!r}{'...' if len(raw) > 40 else ''} is not a whole number "
                             f"from 1 to {HISTORY_MAX_LIMIT}", "limit")
    history = request.app[ENGINE].history
    before = q.get("before") or None
    if before is not None:  # an unknown cursor read as the end of history: "no jobs", exit 0
        try:
            await history.find(before)
        except JobNotFound:
            raise errors.invalid(f"before {before[:40]!r}{'...' if len(before) > 40 else ''} names no job (unknown, "
                                 "deleted, or its retention ended); it takes the next_before of the page before, "
                                 "or leave it out for the newest jobs", "before") from None
    page = await history.page(status, q.get("model") or None, before, int(raw))
    return web.json_response(views.history(page.jobs, page.next_before))


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(views.job(await request.app[ENGINE].history.find(request.match_info["job_id"])))


async def delete_job(request: web.Request) -> web.Response:
    """Cancel a job that has not finished; delete a finished one (record and output files).
    ``?finished=keep`` only cancels: 409 for a finished job (what a client's cancel sends), one that
    is no longer in memory too. A cancel is answered once it is on disk."""
    engine = request.app[ENGINE]
    job_id = request.match_info["job_id"]
    finished = request.query.get("finished")
    if finished not in (None, "keep"):  # a mistyped keep (KEEP, kep, true) deleted a finished job for good
        raise errors.invalid(f"finished {finished[:40]!r} is not a value DELETE takes: send finished=keep to only "
                             "cancel (a finished job is then a 409 and stays), or leave finished out to cancel a "
                             "job that has not finished and delete one that has", "finished")
    if finished == "keep":
        job = await engine.history.find(job_id)  # memory, else the state dir: a finished job is a 409, not a 404
        if job.terminal:
            raise errors.JobFinished(f"job {job_id} already finished ({job.status.value})")
        job, deleted = engine.cancel(job_id), False
    else:
        job, deleted = await engine.history.remove(job_id)
    if not deleted:  # cancelled: "cancelled" must outlive a crash before the client is told
        await endings.recorded(job)
    return web.json_response({**views.job(job), "deleted": deleted})


async def job_events(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    job = await engine.history.find(request.match_info["job_id"])
    metrics = engine.metrics
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if request.method == "HEAD":  # the headers only: no stream, no previews
        return web.Response(headers=headers)
    resp = web.StreamResponse(headers=headers)
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
        if job.finished.is_set():  # a job that ended but is not yet on disk is told when it is
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
    except ConnectionError:  # the client left (a reset, or aiohttp's "Connection lost"): nothing to log
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


MAX_INDEX_DIGITS = 9  # no job has a billion outputs; int() of over 4,300 digits would raise ValueError


def _index(raw: str) -> int:
    """An output index from the path: ASCII digits only (int() would also take "-1", Python's last
    item, " 1", "1_0" and non-ASCII digits); anything else is -1, which no output has (a 404, as
    any index past the job's outputs). More than ``MAX_INDEX_DIGITS`` digits is a 400 naming
    ``k``, before int() sees them."""
    if not (raw.isascii() and raw.isdigit()):
        return -1
    if len(raw) > MAX_INDEX_DIGITS:
        raise errors.invalid(f"output index k has {len(raw)} digits; a job's outputs are numbered from 0 "
                             "(see the job's outputs list)", "k")
    return int(raw)


def _sse(e: Event, data: dict[str, Any]) -> bytes:
    return f"event: {e.value}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def job_output(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    job = await engine.history.find(request.match_info["job_id"])
    k = _index(request.match_info["k"])
    headers = {"Content-Disposition": f'inline; filename="{views.output_filename(job, k)}"',
               "Content-Type": FORMATS[job.request.output_format].content_type}
    if request.method == "HEAD":  # from the job's record alone: nothing opened, pinned or read
        item = engine.readable_output(job, k)
        return web.Response(headers={**headers, "X-Seed": str(item.seed), "Content-Length": str(item.nbytes)})
    async with engine.open_output(job, k) as read:
        headers["X-Seed"] = str(job.items[k].seed)
        resp = web.StreamResponse(headers=headers)
        resp.content_length = len(read)
        await resp.prepare(request)
        # the slot stays pinned, or the file open and its job counted as read, until every byte left the
        # transport (or it was aborted). A file goes a piece at a time, read as it is sent.
        # The body is no local: one would hold a view of the slot while the block's exit gives it back, and a
        # stopped worker's arena cannot be unmapped under a view (it then stayed mapped for good).
        read.complete = await streaming.send(
            request, resp, (read.header, read.payload) if read.file is None else read.file.pieces(streaming.PIECE),
            engine.config.stream_stall_s, f"output {k} of job {job.id}")
        return resp


async def job_audio(request: web.Request) -> web.Response:
    """Output ``k``'s sound track (issue 30) as a 16-bit PCM WAV, whatever the output's format: a few MB at most,
    so written whole rather than streamed."""
    engine = request.app[ENGINE]
    job = await engine.history.find(request.match_info["job_id"])
    k = _index(request.match_info["k"])
    async with engine.open_trajectory(job, k, AUDIO_ARRAY) as (header, payload):
        waveform = sound.from_npy(header, payload)  # a copy: the shared memory is unpinned at once
    return web.Response(body=sound.wav_bytes(waveform, job.request.audio_rate), content_type="audio/wav",
                        headers={"Content-Disposition": f'inline; filename="{job.id}-{k}.wav"'})


async def job_trajectory(request: web.Request) -> web.StreamResponse:
    """One array of an output's trajectory (issue 29) as an npy file, straight from shared memory."""
    engine = request.app[ENGINE]
    job = await engine.history.find(request.match_info["job_id"])
    k, name = _index(request.match_info["k"]), request.match_info["name"]
    async with engine.open_trajectory(job, k, name) as (header, payload):
        headers = {"Content-Type": FORMATS["npy"].content_type,
                   "Content-Disposition": f'inline; filename="{job.id}-{k}-{name}.npy"'}
        if request.method == "HEAD":  # a trajectory is not used up by a read: its length, and no body
            return web.Response(headers={**headers, "Content-Length": str(len(header) + len(payload))})
        resp = web.StreamResponse(headers=headers)
        resp.content_length = len(header) + len(payload)
        await resp.prepare(request)
        # pinned until every byte left the transport, or it was aborted
        await streaming.send(request, resp, (header, payload), engine.config.stream_stall_s,
                             f"the trajectory of output {k} of job {job.id}")
        return resp
