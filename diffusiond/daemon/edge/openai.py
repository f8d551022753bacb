"""OpenAI's Images endpoints (``/v1/images/generations``, ``/v1/images/edits``): synchronous, so a
client that goes away cancels its jobs, and what they made is handed over whole and released."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
from aiohttp import web

from diffusiond.daemon import errors
from diffusiond.daemon.core.engine import Engine
from diffusiond.daemon.core.jobs import Job, JobRequest
from diffusiond.daemon.edge import bodies, controls, ip_adapters, pictures, requests, upscale, views
from diffusiond.daemon.edge.forms import edits_form, images_body, openai_fields
from diffusiond.daemon.edge.status import ENGINE, STATUS_OF_FAILURE, HttpError
from diffusiond.protocol import ErrorCode, JobStatus


async def images_generations(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    limits = engine.config.limits
    # control and ip_adapter carry base64 pictures: the body may then be as large as an upload, and only then
    body = await bodies.read_body(request, max(limits.max_body_bytes, limits.max_upload_bytes))
    b = images_body(body)
    if len(body) > limits.max_body_bytes and not b.control and not b.ip_adapter:
        raise bodies.too_large(len(body), limits.max_body_bytes)
    await engine.described(b.model)
    model = engine.model(b.model)
    fields = openai_fields(msgspec.structs.asdict(b))
    req = requests.check(fields, limits, model, size_field="size", loras=engine.check_loras)
    job = await engine.accept(await _attach(engine, fields, model, req), sync=True)
    data = await _finish_sync([job], engine, fields["response_format"])
    return web.json_response({"created": int(job.created), "data": data, "job_id": job.id})


async def _attach(engine: Engine, fields: dict[str, Any], model: Any, req: JobRequest) -> JobRequest:
    """``req`` with what ``/v1/jobs`` attaches to a request (its hires and upscale, control images,
    reference images), in that order and by the same calls; a refusal closes what was decoded."""
    try:
        req = upscale.attach(engine, fields, model, req)  # before the control images: it holds nothing
        req = await controls.attach(engine, fields, model, req)
        return await ip_adapters.attach(engine, fields, model, req)
    except BaseException:
        req.close_inputs()
        raise


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
                engine.release_outputs(job)
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
    """OpenAI's edits endpoint: a multipart form with ``image`` (or several ``image[]``), an optional ``mask`` and
    text fields; one job, as OpenAI's answers one edit. Several pictures are that edit's pictures, as OpenAI reads
    them, on a model that takes several (``pictures.form_pictures``); a model that takes one refuses them, where it
    used to run one unrelated job per picture and, when a later one was refused, end those already admitted as
    "cancelled by the client"."""
    engine = request.app[ENGINE]
    text, images, mask = await bodies.read_edit_form(request, engine.config.limits.max_upload_bytes)
    fields = edits_form(text)
    await engine.described(fields.get("model"))
    model = engine.model(fields.get("model"))
    if not images:
        raise errors.invalid("send the image to edit as the multipart file field 'image'", field="image")
    fields = {**fields, **pictures.form_pictures(images, mask, model)}
    edit = await bodies.decode_edit(engine, fields, model, image_field=images[0][0], size_field="size")
    assert edit is not None
    try:
        req = requests.check(fields, engine.config.limits, model, size_field="size", edit=edit,
                             loras=engine.check_loras)
        job = await engine.accept(await _attach(engine, fields, model, req), sync=True)
    except BaseException:
        edit.close()  # an admitted job closes it too; closing twice is harmless
        raise
    data = await _finish_sync([job], engine, fields["response_format"])
    return web.json_response({"created": int(job.created), "data": data, "job_id": job.id})
