"""What clients see of the engine's objects: the JSON of jobs, events, models, health and traces.

Drawn here, at the HTTP edge, and only here, so a field or a URL is written once and the engine
never formats anything for a client. docs/api.md describes these documents.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import msgspec

from diffusiond import __version__
from diffusiond.daemon.core.jobs import Item, Job, Preview
from diffusiond.daemon.core.loras import LoraInfo
from diffusiond.daemon.edge.sizes import side_floor
from diffusiond.daemon.residency.decisions import ModelStatus
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.daemon.workers.pool import PING_INTERVAL_S, Model
from diffusiond.ipc.messages import Ack, Capabilities
from diffusiond.pipelines.spec import is_synthetic
from diffusiond.protocol import AUDIO_ARRAY, FORMATS, VIDEO_TASKS, Event, ModelState, WorkerState

if TYPE_CHECKING:
    from diffusiond.daemon.core.engine import Engine


def job_url(job_id: str) -> str:
    return f"/v1/jobs/{job_id}"


def output_url(job_id: str, k: int) -> str:
    return f"/v1/jobs/{job_id}/outputs/{k}"


def preview_url(job_id: str, k: int) -> str:
    return f"/v1/jobs/{job_id}/preview/{k}"


def trajectory_url(job_id: str, k: int, name: str) -> str:
    return f"/v1/jobs/{job_id}/outputs/{k}/trajectory/{name}"


def _side_arrays(i: Item) -> dict[str, tuple[list[int], str]]:
    """The shapes and dtypes of an output's side arrays (trajectory, sound track), in memory or in files."""
    t = i.trajectory
    return {n: (list(d.shape), d.dtype) for n, d in t.arrays.items()} if t is not None else \
        {n: (list(f["shape"]), str(f["dtype"])) for n, f in (i.trajectory_files or {}).items()}


def trajectory(j: Job, i: Item) -> dict[str, Any] | None:
    """An output's trajectory arrays: each one's URL, shape and dtype (null: the job asked for none)."""
    arrays = {n: v for n, v in _side_arrays(i).items() if n != AUDIO_ARRAY}
    if j.request.trajectory is None or not arrays:
        return None
    return {name: {"url": trajectory_url(j.id, i.index, name), "shape": shape, "dtype": dtype}
            for name, (shape, dtype) in arrays.items()}


def audio(j: Job, i: Item) -> dict[str, Any] | None:
    """An output's sound track (issue 30): its WAV's URL, rate, channels and length (null: it has none)."""
    shape = _side_arrays(i).get(AUDIO_ARRAY, ([], ""))[0] if j.request.audio_rate else []
    if len(shape) != 2:
        return None
    return {"url": f"{output_url(j.id, i.index)}/audio", "content_type": "audio/wav",
            "sample_rate": j.request.audio_rate, "channels": shape[0], "samples": shape[1]}


def output_filename(job: Job, k: int) -> str:
    return f"{job.id}-{k}.{FORMATS[job.request.output_format].extension}"


def stage(j: Job) -> str:
    """The stage a client reads: an ended job's is the one its error names, the stage it ended in. A job cancelled
    while residency held it back said ``waiting_for_memory`` on top and ``queued`` in its error."""
    ended = j.error.get("stage") if j.terminal and j.error else None
    return ended if isinstance(ended, str) else j.stage_label


def job(j: Job) -> dict[str, Any]:
    r = j.request
    content_type = FORMATS[r.output_format].content_type
    label = stage(j)
    return {
        "id": j.id,
        "object": "job",
        "model": r.model,
        "created": int(j.created),
        "status": j.status.value,
        "stage": label,
        "progress": {"step": j.progress[0], "total": j.progress[1] or r.total_steps},
        # what a job in stage "loading" waits for, and how far its load is (Keeper.load_bytes)
        "loading": {"model": r.model, "bytes_loaded": j.bytes_loaded, "bytes_total": j.load_bytes}
        if label == "loading" else None,
        "outputs": [
            {"index": i.index, "url": output_url(j.id, i.index), "content_type": content_type, "seed": i.seed,
             "bytes": i.nbytes, "batch": i.batch_id, "trajectory": trajectory(j, i), "audio": audio(j, i),
             # the versions this output's own batch ran with (the job's may have run in several)
             "lora_versions": i.lora_versions or None, "weight_versions": i.weight_versions or None}
            for i in j.items
            if i.done
        ],
        "error": j.error,
        "attempts": j.attempts,
        "timings_ms": dict(j.timings_ms),
        "approximations": list(j.approximations),
        "compiled": j.compiled or None,
        "attention": j.attention or None,
        # kept from before outputs had their own: the versions all its outputs ran with, null when they differ
        "lora_versions": j.lora_versions or None,
        "weight_versions": j.weight_versions or None,
        "request": {
            "prompt": r.prompt,
            "negative_prompt": r.negative_prompt,
            "n": r.n,
            "width": r.width,
            "height": r.height,
            "steps": r.steps,
            "guidance_scale": r.guidance,
            "output_format": r.output_format,
            "num_frames": r.num_frames,
            # the frame rate the video is encoded at (and an fps-conditioned model runs at), the model's default when
            # left out; null for pictures, which have none (JobRequest's fps is set for every job)
            "fps": r.fps if r.num_frames is not None else None,
            "audio": r.audio_rate > 0,
            "seed": r.seed,
            "scheduler": r.scheduler,
            "noise_level": r.noise_level,
            "eta": r.eta,
            "loras": lora_list(r.loras),
            "control": [{"name": n, "scale": s, "start": a, "end": b, "preprocess": p, "mode": m}
                        for n, s, a, b, p, m in r.controls],  # the control images are not echoed back
            "ip_adapter": [{"name": n, "scale": s, "image_digest": d} for n, s, d in r.ip_adapters],
            # edits: which, and how strongly (the input image itself is not echoed back)
            "task": r.edit.task.value if r.edit else None,
            # issue 30: the sizes the daemon settled are shown, beside what was asked
            "hires": None if r.hires is None else msgspec.structs.asdict(r.hires),
            "upscale": None if r.upscale is None else msgspec.structs.asdict(r.upscale),
            "strength": r.edit.strength if r.edit else None,
            "preview": None if r.preview is None else {"every": r.preview.every, "format": r.preview.format,
                                                       "max_side": r.preview.max_side},
            "trajectory": None if r.trajectory is None else {"latents": r.trajectory.latents,
                                                             "log_probs": r.trajectory.log_probs,
                                                             "dtype": r.trajectory.dtype},
        },
    }


def history(jobs: list[Job], next_before: str | None) -> dict[str, Any]:
    """A page of ``GET /v1/jobs``: ``next_before`` is the ``before=`` of the next page (null: the last)."""
    return {"object": "list", "data": [job(j) for j in jobs], "has_more": next_before is not None,
            "next_before": next_before}


def lora_list(pairs: tuple[tuple[str, float], ...]) -> list[dict[str, Any]]:
    return [{"name": n, "weight": w} for n, w in pairs]


def lora(engine: Engine, info: LoraInfo) -> dict[str, Any]:
    """One entry of ``GET /v1/loras``: what the file is, which served models it fits (and why not
    the others), and whether a worker has it loaded right now (as of the last heartbeat)."""
    models = engine.models()
    return {
        "name": info.name, "object": "lora", "path": info.path, "layout": info.layout, "rank": info.rank,
        "version": engine.live_loras.version(info.name),
        "refused": engine.live_loras.refused.get(info.name),  # a kept update a model's start refused (issue 29)
        "targets": list(info.targets),
        "models": [m.name for m in models if info.name not in m.lora_errors],
        "unfit": {m.name: m.lora_errors[info.name] for m in models if info.name in m.lora_errors},
        "loaded": any(info.name in w.loras_loaded for m in models for w in m.workers),
    }


def controlnets(engine: Engine) -> dict[str, Any]:
    """``GET /v1/controlnets``: each served ControlNet, the models it fits (as their workers found), and why not;
    a union one's number of modes and, where serve named them, their names in mode order (a request's ``mode``)."""
    models = engine.models()
    reg = engine.controls
    return {"object": "list", "data": [
        {"name": name, "object": "controlnet", "path": path, "num_modes": reg.modes.get(name, 0),
         "modes": list(reg.mode_names[name]) if name in reg.mode_names else None,
         "models": [m.name for m in models if m.known and name not in m.controlnet_errors],
         "unfit": {m.name: m.controlnet_errors[name] for m in models if name in m.controlnet_errors}}
        for name, path in sorted(engine.controls.paths.items())]}


def ip_adapters(engine: Engine) -> dict[str, Any]:
    """``GET /v1/ip-adapters``: each served IP-Adapter, its files, the models it fits, and why not."""
    models = engine.models()
    return {"object": "list", "data": [
        {"name": name, "object": "ip_adapter", "path": weights, "image_encoder": encoder,
         "models": [m.name for m in models if m.known and name not in m.ip_adapter_errors],
         "unfit": {m.name: m.ip_adapter_errors[name] for m in models if name in m.ip_adapter_errors}}
        for name, (weights, encoder) in sorted(engine.ip_adapters.paths.items())]}


def upscalers(engine: Engine) -> dict[str, Any]:
    """``GET /v1/upscalers``: each served upscaler, as spandrel read it at start, with the tiles serve set."""
    return {"object": "list", "data": [
        {"name": i.name, "object": "upscaler", "path": i.path, "scale": i.scale, "architecture": i.architecture,
         "purpose": i.purpose, "tags": list(i.tags), "tile": i.tile, "overlap": i.overlap}
        for _, i in sorted(engine.upscalers.infos.items())]}


def loras(engine: Engine) -> dict[str, Any]:
    return {"object": "list", "data": [lora(engine, i) for i in engine.loras.loras.values()]}


def event(e: Event, j: Job) -> dict[str, Any]:
    """The data of one Server-Sent Event: the step for ``progress``, else the whole job."""
    if e == Event.PROGRESS:
        return {"step": j.progress[0], "total": j.progress[1]}
    return job(j)


def preview(j: Job, p: Preview) -> dict[str, Any]:
    """The data of a ``preview`` event: the picture inline (base64), and where the latest one is."""
    return {"job_id": j.id, "index": p.index, "step": p.step, "total": p.total, "format": p.format,
            "image": base64.b64encode(p.data).decode(), "url": preview_url(j.id, p.index)}


def models(engine: Engine) -> dict[str, Any]:
    places = engine.keeper.snapshot()  # once for the list, not once per model
    return {"object": "list", "data": [model(engine, m, places.get(m.name)) for m in engine.models()]}


def model(engine: Engine, m: Model, where: ModelStatus | None = None) -> dict[str, Any]:
    """One model: what it makes, and where it is (residency: device, host, disk or loading, the bytes
    in each, its keep-alive as a Unix time, pinned, its outputs queued and running), and the working
    memory its runs were measured at, per shape, which residency plans with (remembered across restarts)."""
    where = where or engine.keeper.snapshot().get(m.name)
    now_wall, now = time.time(), time.monotonic()
    until = where.keep_alive_until if where is not None else None
    return {"id": m.name, "object": "model", "owned_by": "diffusiond", "task": m.task, "spec": m.config.spec,
            "device": ",".join(m.config.devices), "dtype": m.config.dtype,
            "state": model_state(engine, m).value,
            "synthetic": m.capabilities.synthetic_weights or is_synthetic(m.config.spec),
            "edits": list(m.capabilities.edits), "size_step": m.capabilities.size_step,
            "max_input_images": m.capabilities.max_input_images,  # pictures one edit takes (``images``, issue 30)
            "min_size": side_floor(m, engine.config.limits), "min_steps": m.capabilities.min_steps,
            "defaults": defaults(m.capabilities) if m.known else None,  # a placeholder's would be generic
            "previews": m.capabilities.previews, "negative_prompt": m.capabilities.negative_prompt,
            "compile": m.config.compile or None, "approximations": list(m.capabilities.approximations),
            "attention": m.capabilities.attention or None, "sample_rate": m.capabilities.sample_rate or None,
            "offload": m.capabilities.offload, "batch_sizes": list(engine.config.batch_sizes_of(m.config)),
            "residency": where.residency if where is not None else ("disk" if m.retired else "loading"),
            "device_bytes": where.device_bytes if where is not None else 0,
            "device_bytes_by_device": dict(where.per_device) if where is not None else {},
            "host_bytes": where.host_bytes if where is not None else 0,
            "kept_host_bytes": where.kept_bytes if where is not None else 0,
            "keep_alive_until": None if until is None else round(now_wall + (until - now), 3),
            "keep_alive_forever": bool(where and where.forever),
            "pinned": m.config.pinned, "queued": where.queued if where is not None else 0,
            "running": where.running if where is not None else 0,
            "residency_reason": where.reason if where is not None else "",
            "unload": "pending" if where is not None and where.unload_pending else None,
            "working_memory": engine.keeper.policy.measurements.keyed(m.name, m.capabilities.weight_bytes),
            # component -> why a live update kept for its start was refused there (core/weights.py)
            "weight_errors": engine.live_components.weight_errors(m.name)}


def model_state(engine: Engine, m: Model) -> ModelState:
    """``m.state``, with what only the keeper knows: a model whose last load failed is retired like one merely
    unloaded, but its next job may fail the same way (``unavailable``, the reason in ``residency_reason``); one
    waiting its turn in the start's preload has no worker yet and is loaded all the same (``unloaded``)."""
    state = m.state
    if state == ModelState.UNLOADED and m.name in engine.keeper.failed:
        return ModelState.UNAVAILABLE
    if state == ModelState.UNAVAILABLE and not m.workers and m.name in engine.keeper.preloading.models:
        return ModelState.UNLOADED
    return state


def defaults(c: Capabilities) -> dict[str, Any]:
    """What a request that leaves them out gets: the preset's, else the pipeline class's own ``__call__`` defaults,
    else the generic ones (pipelines/call_defaults.py); frames and fps only for a video model."""
    made = {"width": c.width, "height": c.height, "steps": c.steps, "guidance_scale": c.guidance}
    return {**made, "num_frames": c.num_frames, "fps": c.fps} if c.task in VIDEO_TASKS else made


def health(engine: Engine) -> dict[str, Any]:
    """``/health``'s body, which ``/metrics`` reads its gauges from, so they never disagree."""
    pool = engine.pool
    workers = list(pool.workers())
    keeper = engine.keeper
    # a model residency left on disk (never loaded, or sent away) has no worker to be sick, and one being
    # loaded (by the start's preload, which /ready no longer waits for, or for a job) is not sick either;
    # one rule for the body's status and the HTTP code (``api.health``), so a probe reads what the body says
    loading = keeper.moving.union(keeper.preloading.models)
    ok = all(m.state in (ModelState.READY, ModelState.SLEEPING) or m.retired or pool.paused or m.name in loading
             for m in pool.models.values()) and all(
        (w.state in (WorkerState.READY, WorkerState.SLEEPING) and w.answering(3 * PING_INTERVAL_S + 1))
        or (w.state == WorkerState.STARTING and m.name in loading) for m, w in workers)
    return {
        "version": __version__,
        "status": "ok" if ok else "degraded",
        "accepting": engine.accepting,
        "preload": engine.keeper.preloading.view(),
        "sleeping": pool.paused,
        "sleep_level": pool.sleep_level,
        "queue_depth": engine.scheduler.depth,
        "jobs": engine.jobs_by_status(),
        "workers": [
            {"id": w.id, "model": m.name, "device": w.config.device, "state": w.state.value, "pid": w.pid,
             "answering": w.answering(3 * PING_INTERVAL_S + 1),
             "restarts": m.restarts, "batches_in_flight": engine.batches_in_flight(w),
             "arena_bytes": w.arena_capacity, "arena_bytes_in_use": w.held_bytes}
            for m, w in workers
        ],
        "arena_bytes_in_use": sum(w.held_bytes for _, w in workers),
        # arenas of workers gone (a level-2 sleep, residency, a crash) that outputs still held keep mapped
        "departed_arena_bytes": sum(w.arena_capacity for w in pool.departed_arenas()),
        # outputs in the engine's own memory: encoded ones without a state dir, and spills
        "output_memory_bytes": engine.outputs.memory_bytes(engine.jobs.values()),
    }


def trace(acks: list[tuple[WorkerLink, Ack]]) -> dict[str, Any]:
    return {"workers": [
        {"id": w.id, "pid": w.pid, "model": w.config.model_name, "device": w.config.device,
         "events": [[e.name, e.batch_id, e.t_ns] for e in ack.trace],
         "gpu_events": [[e.name, e.batch_id, e.t_ns] for e in ack.gpu_trace]}
        for w, ack in acks
    ]}
