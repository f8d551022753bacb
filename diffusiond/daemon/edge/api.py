"""The HTTP API's application (docs/api.md): the route table, the service and admin endpoints, and
the app every listener serves (the Unix socket, ``--tcp``, and the web page's ``/v1``).

The rest of the edge, by job: ``jobs.py`` (the jobs API and SSE), ``openai.py`` (OpenAI's Images
endpoints), ``status.py`` (status codes for domain errors), ``access.py`` (who may connect),
``bodies.py``, ``forms.py`` (OpenAI's bodies) and ``requests.py`` (reading and checking what comes
in), with a module per request field that has rules of its own (``controls.py``, ``ip_adapters.py``,
``upscale.py``, ``trajectory.py``), ``views.py`` (every JSON document that goes out), ``web.py`` and
``webauth.py`` (the page's listener), ``handoff.py`` (the output socket for zero-copy clients).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from diffusiond.daemon import errors
from diffusiond.daemon.core.engine import Engine
from diffusiond.daemon.edge import bodies, views
from diffusiond.daemon.edge.access import make_access_middleware, peer_uid
from diffusiond.daemon.edge.jobs import (
    create_job,
    delete_job,
    get_job,
    job_audio,
    job_events,
    job_output,
    job_preview,
    job_trajectory,
    list_jobs,
)
from diffusiond.daemon.edge.openai import images_edits, images_generations
from diffusiond.daemon.edge.requests import AddLoraBody, decode
from diffusiond.daemon.edge.status import ENGINE, HttpError, errors_middleware
from diffusiond.daemon.errors import invalid
from diffusiond.daemon.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from diffusiond.protocol import ErrorCode


async def models(request: web.Request) -> web.Response:
    return web.json_response(views.models(request.app[ENGINE]))


async def health(request: web.Request) -> web.Response:
    snap = views.health(request.app[ENGINE])
    return web.json_response(snap, status=200 if snap["status"] == "ok" else 503)


async def ready(request: web.Request) -> web.Response:
    """200 once jobs are admitted, while the start's preload may still be loading (issue 27: "admitting", not
    "everything loaded"); ``preload`` says what it still loads, for a client that needs the models warm."""
    engine = request.app[ENGINE]
    preload = engine.keeper.preloading.view()
    if engine.accepting:
        return web.json_response({"ready": True, "preload": preload})
    reason = "draining" if engine.draining else "starting"
    return web.json_response({"ready": False, "reason": reason, "preload": preload}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


class SleepBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/admin/sleep``: 1 moves the weights to host memory, 2 stops the workers (frees all)."""

    level: int = 1


SLEEP_LEVELS = {1: "weights to host memory, a fast wake", 2: "workers stopped, everything freed; wake reloads"}


def sleep_level(query: str | None, body: bytes) -> int:
    """The level from ``?level=`` or the JSON body (the query wins; neither is level 1), or a 400."""
    if query is not None:
        level = int(query) if query in ("1", "2") else 0
        shown: object = query
    else:
        level = decode(body, SleepBody).level if body.strip() else 1
        shown = level
    if level not in SLEEP_LEVELS:
        levels = "; ".join(f"{k} ({v})" for k, v in SLEEP_LEVELS.items())
        raise invalid(f"sleep level must be 1 or 2, not {shown!r}: {levels}", field="level")
    return level



async def admin_sleep(request: web.Request) -> web.Response:
    """Drain, then free the devices at the level asked (``?level=`` or ``{"level": N}``; 1 by default)."""
    engine = request.app[ENGINE]
    body = await bodies.read_body(request, engine.config.limits.max_body_bytes)
    level = sleep_level(request.query.get("level"), body)
    t0 = time.perf_counter()
    answer = await engine.sleep(level)  # the level in force (a deeper one stays) and where each model is
    return web.json_response({"sleeping": True, **answer, "took_ms": round((time.perf_counter() - t0) * 1000, 1)})


async def admin_wake(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    await request.app[ENGINE].wake()
    return web.json_response({"sleeping": False, "took_ms": round((time.perf_counter() - t0) * 1000, 1)})


async def model_load(request: web.Request) -> web.Response:
    """``POST /v1/models/{name}/load``: onto its device now, making room as residency allows."""
    return await _moved(request, request.app[ENGINE].load_model)


async def model_unload(request: web.Request) -> web.Response:
    """``POST /v1/models/{name}/unload``: off its device once its work is done."""
    return await _moved(request, request.app[ENGINE].unload_model)


async def _moved(request: web.Request, move: Callable[[str], Awaitable[None]]) -> web.Response:
    """The model's entry after a move by hand, with how long the move took."""
    engine, name = request.app[ENGINE], request.match_info["name"]
    t0 = time.perf_counter()
    await move(name)
    return web.json_response({**views.model(engine, engine.model(name)),
                              "took_ms": round((time.perf_counter() - t0) * 1000, 1)})


async def list_loras(request: web.Request) -> web.Response:
    return web.json_response(views.loras(request.app[ENGINE]))


async def list_controlnets(request: web.Request) -> web.Response:
    return web.json_response(views.controlnets(request.app[ENGINE]))


async def list_ip_adapters(request: web.Request) -> web.Response:
    return web.json_response(views.ip_adapters(request.app[ENGINE]))
async def list_upscalers(request: web.Request) -> web.Response:
    return web.json_response(views.upscalers(request.app[ENGINE]))


async def admin_add_lora(request: web.Request) -> web.Response:
    """Register a LoRA at run time: ``{"name": ..., "path": ...}``; 201 with its entry, or a 4xx
    naming the field (the daemon goes on either way)."""
    engine = request.app[ENGINE]
    body = decode(await bodies.read_body(request, engine.config.limits.max_body_bytes), AddLoraBody)
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
    app.router.add_get("/v1/jobs/{job_id}/outputs/{k}/trajectory/{name}", job_trajectory)
    app.router.add_get("/v1/jobs/{job_id}/outputs/{k}/audio", job_audio)
    app.router.add_get("/v1/jobs/{job_id}/preview/{k}", job_preview)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/models/{name}/load", model_load)
    app.router.add_post("/v1/models/{name}/unload", model_unload)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/admin/sleep", admin_sleep)
    app.router.add_post("/v1/admin/wake", admin_wake)
    app.router.add_get("/v1/admin/trace", admin_trace)
    app.router.add_get("/v1/loras", list_loras)
    app.router.add_get("/v1/controlnets", list_controlnets)
    app.router.add_get("/v1/ip-adapters", list_ip_adapters)
    app.router.add_get("/v1/upscalers", list_upscalers)
    app.router.add_post("/v1/loras", admin_add_lora)


def create_app(engine: Engine, *, token: str | None = None, web_address: WebAddress | None = None) -> web.Application:
    cfg = engine.config
    app = web.Application(
        client_max_size=cfg.limits.max_body_bytes,
        middlewares=[errors_middleware, make_access_middleware(cfg.allow_uid, token)],
    )
    app[ENGINE] = engine
    app[WEB] = web_address or WebAddress()
    engine.metrics.bind(lambda: views.health(engine), residency=lambda: engine.keeper.snapshot().values())
    add_api_routes(app)
    app.router.add_get("/v1/admin/web", admin_web)
    return app
