"""The compute thread: forward passes back to back, never waiting for an output copy.

After each batch it records a CUDA event on the default stream, announces COMPUTE_DONE and hands
the device outputs to the copy thread, then takes the next batch at once: the engine keeps one
queued, so the GPU goes from one forward straight into the next. Control items (SLEEP, WAKE,
SHUTDOWN) travel through the same queue, so they run after the batches sent before them.

Warm-up (``--warmup``, ``warmup.py``) runs on this thread too, before READY; what each forward runs
with (its LoRA adapters, live updates between batches) is ``adapters.py``'s; the control items are
``control_items.py``'s, a forward that runs out of memory ``retry.py``'s, and each request's one ending
``request_endings.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from diffusiond.ipc.channel import close_all
from diffusiond.ipc.errors import ArenaError
from diffusiond.ipc.inputs import read_controls, read_inputs, read_pictures, read_references
from diffusiond.ipc.messages import (
    AddLora,
    ComputeDone,
    Execute,
    Fatal,
    Progress,
    RequestSpec,
    UpdateLora,
    UpdateWeights,
    WarmupShape,
)
from diffusiond.pipelines.base import EditArrays, EditingPipeline, Interrupted, Pipeline, PipelineError
from diffusiond.pipelines.controlnet import ControlNets
from diffusiond.pipelines.errors import HalfApplied
from diffusiond.pipelines.ip_adapter import IpAdapters
from diffusiond.pipelines.loras import Adapters
from diffusiond.worker import profile
from diffusiond.worker.adapters import LiveAdapters
from diffusiond.worker.control_items import Control, Power
from diffusiond.worker.copier import Copier, CopyJob
from diffusiond.worker.failures import is_fatal
from diffusiond.worker.finish import Finisher, first_pass, first_pass_previews
from diffusiond.worker.memory import PeakMeter
from diffusiond.worker.request_endings import Endings
from diffusiond.worker.retry import run_or_retry
from diffusiond.worker.startup import bind_thread
from diffusiond.worker.state import SharedState
from diffusiond.worker.warmup import warm_up

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Edit:
    """A batch of edits and the fds of its input buffers (``ipc.inputs``), read and closed by
    the compute thread: the loop thread only passes them on."""

    batch: Execute
    fds: list[int]


@dataclass(frozen=True)
class LiveUpdate:
    """New LoRA weights and the memfd they lie in (worker/weights.py), applied between batches."""

    msg: UpdateLora | UpdateWeights
    fds: list[int]


class ComputeThread:
    def __init__(
        self,
        pipeline: Pipeline,
        copier: Copier,
        state: SharedState,
        post: Callable[..., None],
        *,
        sync_output: bool,
        progress_interval_s: float,
        drain_timeout_s: float,
        on_exit: Callable[[int], None],
        adapters: Adapters | None = None,
        controlnets: ControlNets | None = None,
        ip_adapters: IpAdapters | None = None,
        finisher: Finisher | None = None,
        warmup: Sequence[WarmupShape] = (),
        on_ready: Callable[[], None] | None = None,
        before_forward: Callable[[], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.adapters = LiveAdapters(pipeline, adapters, post)  # what each forward runs with (adapters.py)
        self.controlnets = controlnets
        self.ip_adapters = ip_adapters
        self.finish = finisher or Finisher(pipeline, None)  # hires and upscale (worker/finish.py)
        self.copier = copier
        self.state = state
        self.post = post
        self.sync_output = sync_output
        self.progress_interval_s = progress_interval_s
        self.on_exit = on_exit
        self.warmup = list(warmup)
        self.on_ready = on_ready
        self.before_forward = before_forward  # tests only (worker/faults.py): e.g. an injected out-of-memory
        # SLEEP, WAKE, RELEASE, SHUTDOWN (worker/control_items.py)
        self.power = Power(pipeline, self.finish, state, post, controlnets=controlnets, ip_adapters=ip_adapters,
                           drain_timeout_s=drain_timeout_s, on_exit=on_exit, die=self._die)
        # each batch's working memory, for residency (worker/memory.py)
        self.meter = PeakMeter(pipeline.device, offloaded=pipeline.capabilities.offload != "none")
        self.cuda = pipeline.device.type == "cuda"
        self.profiler = profile.from_env()
        self.queue: queue.Queue[Execute | Edit | Control | AddLora | LiveUpdate] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="compute", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.cuda:  # torch's current device is per thread: the main thread's set_device does not reach here,
                # and events, streams and pinned buffers made here would be cuda:0's
                bind_thread(self.pipeline.device)
        except BaseException as exc:  # a thread dying alone would leave the worker never ready
            self._die(f"the compute thread could not use {self.pipeline.device}: {type(exc).__name__}: {exc}", 1)
            return
        try:
            warm_up(self.pipeline, self.warmup, self.cuda)
        except BaseException as exc:
            log.exception("warm-up failed")
            self._die(f"warm-up failed: {type(exc).__name__}: {exc}", 1)
            return
        if self.on_ready is not None:
            self.on_ready()
        while True:
            item = self.queue.get()
            if isinstance(item, Control):
                if self.power(item):
                    return
                continue
            if isinstance(item, AddLora):
                self.adapters.add(item)
                continue
            if isinstance(item, LiveUpdate):
                try:
                    self.adapters.update(item.msg, item.fds)
                except HalfApplied as exc:  # answered; the weights are neither version: a replacement starts over
                    log.error("a live update failed half-way, the worker exits: %s", exc)
                    self._die(f"a live update failed half-way: {exc}", 70, between_batches=True)
                    return
                continue
            batch, fds = (item.batch, item.fds) if isinstance(item, Edit) else (item, [])
            try:
                self._execute(batch, fds)
            except BaseException as exc:  # a device error: this process is done
                log.exception("unrecoverable error in batch %d", batch.batch_id)
                self._die(f"unrecoverable device error in batch {batch.batch_id}: {exc}", 70)
                return

    def _die(self, why: str, code: int, *, between_batches: bool = False) -> None:
        """This process is done: the engine hears why (FATAL), and the worker exits with ``code``;
        ``between_batches``: the batches behind never started, and go back to the engine's queue."""
        self.post(Fatal(message=why, between_batches=between_batches))
        self.on_exit(code)

    def _execute(self, batch: Execute, fds: list[int]) -> None:
        endings = Endings(batch.batch_id, self.state, self.post, self._empty_cache)  # each request ends once
        live = [r for r in batch.requests if not self.state.is_cancelled(r.request_id)]
        for r in batch.requests:
            if r not in live:
                endings.end(r.request_id, "cancelled", "cancelled while queued on the worker")
        if not live:
            close_all(fds)
            return
        live_ids = [r.request_id for r in live]
        inputs: list[EditArrays] = []
        controls: dict[str, list[np.ndarray]] = {}  # request id -> its ControlNet images
        references: dict[str, list[np.ndarray]] = {}  # request id -> its IP-Adapter reference images
        pictures: dict[str, list[np.ndarray]] = {}  # request id -> its input pictures before its image (issue 30)
        try:
            if batch.params.edit is not None:
                inputs = self._inputs(live, fds)
                pictures = {r.request_id: read_pictures(fds, r.input) for r in live if r.input and r.input.pictures}
            if batch.params.controls:
                controls = {r.request_id: read_controls(fds, r.input) for r in live if r.input is not None}
            if batch.params.ip_adapters:  # IP-Adapter reference images, in the same kind of buffer
                references = {r.request_id: read_references(fds, r.input) for r in live if r.input is not None}
        except (ArenaError, OSError, ValueError) as exc:
            endings.fail_all(live_ids, f"could not read the input image: {exc}")
            return
        finally:
            close_all(fds)
        last_post = 0.0

        previews = self.copier.previews

        running = live_ids  # what the forward under way runs: a retried half's own requests (forward sets it)

        def on_step(step: int, total: int) -> bool:
            nonlocal last_post
            previews.flush()
            now = time.monotonic()
            if step == total or now - last_post >= self.progress_interval_s:
                last_post = now
                self.post(Progress(batch_id=batch.batch_id, step=step, total=total))
            # asked of the running half, not the whole batch: a half whose requests were all cancelled must stop,
            # though the other half's requests keep the batch as a whole from ever being all cancelled
            return not self.state.all_cancelled(running)

        def sink_for(requests: list[RequestSpec]) -> Callable[[int, int, list[tuple[int, torch.Tensor]]], None]:
            def on_preview(step: int, total: int, pictures: list[tuple[int, torch.Tensor]]) -> None:
                """Inside the denoising loop: launches only (worker/previews.py says why on this thread)."""
                for k, picture in pictures:
                    if k < len(requests):  # beyond: a pipeline's padding, not a request
                        previews.offer(batch.batch_id, requests[k].request_id, step, total, picture)
            return on_preview

        trajectories: list[dict[str, torch.Tensor]] = []  # per request with an output, when asked for
        # for the whole batch: a silent half still adds its {}s, so the next half's tracks stay on their outputs
        sides = batch.params.trajectory is not None or any(r.audio for r in live)

        def forward(requests: list[RequestSpec], arrays: list[EditArrays]) -> list[torch.Tensor]:
            nonlocal running
            running = [r.request_id for r in requests]
            outputs = run(requests, arrays)
            if batch.params.hires is not None or batch.params.upscale is not None:
                every = any(r.preview_every for r in requests)
                redraw = None  # a hires pass redraws with the batch's reference image too
                if batch.params.ip_adapters and self.ip_adapters is not None:
                    redraw = self.ip_adapters.redraw([references.get(r.request_id, []) for r in requests])
                outputs = self.finish(batch.params, requests, outputs, on_step, sink_for(requests) if every else None,
                                      redraw)
            if sides:  # a retried half: its share
                got = getattr(self.pipeline, "last_trajectories", None) or []
                if not got and batch.params.trajectory is None and not any(r.audio for r in requests):
                    got = [{} for _ in outputs]
                if len(got) != len(outputs):
                    raise PipelineError(f"model {self.pipeline.name} gave {len(got)} trajectories for "
                                        f"{len(outputs)} outputs")
                trajectories.extend(got)
            return outputs

        def run(requests: list[RequestSpec], arrays: list[EditArrays]) -> list[torch.Tensor]:
            if self.before_forward is not None:
                self.before_forward()
            step = first_pass(on_step, batch.params)  # its totals count a hires pass still to come
            every = min((r.preview_every for r in requests if r.preview_every), default=0)
            profiled = self.profiler.forward(batch.batch_id, every) if self.profiler else contextlib.nullcontext()
            # inference_mode: no autograd bookkeeping, so less host time per kernel launch
            with torch.inference_mode(), profiled:
                sink = first_pass_previews(sink_for(requests), batch.params) if every else None
                images = [controls.get(r.request_id, []) for r in requests]
                if batch.params.ip_adapters:  # on the ControlNet or edit pipeline too, when the batch has those
                    if self.ip_adapters is None:
                        raise PipelineError(f"model {self.pipeline.name} takes no IP-Adapter here")
                    refs = [references.get(r.request_id, []) for r in requests]
                    return self.ip_adapters.run(batch.params, requests, refs, step, sink, edits=arrays,
                                                controls=images, controlnets=self.controlnets)
                if self.ip_adapters is not None:  # a UNet with an IP-Adapter in it wants its images
                    self.ip_adapters.release()
                if batch.params.controls:
                    if self.controlnets is None:
                        raise PipelineError(f"model {self.pipeline.name} takes no ControlNet here")
                    return self.controlnets.run(batch.params, requests, images, step, sink, edits=arrays)
                if batch.params.edit is None:
                    return self.pipeline.run(batch.params, requests, step, sink)
                if isinstance(self.pipeline, EditingPipeline):
                    if pictures:  # only then: a pipeline that takes one picture an edit has no such argument
                        return self.pipeline.edit(batch.params, requests, arrays, step, sink,
                                                  pictures=[pictures.get(r.request_id, []) for r in requests])
                    return self.pipeline.edit(batch.params, requests, arrays, step, sink)
                raise PipelineError(f"model {self.pipeline.name} cannot do {batch.params.edit}")

        will_compile = getattr(self.pipeline, "will_compile", None)
        compiling = will_compile is not None and will_compile(batch.params, len(live))
        if compiling:
            self.post(Progress(batch_id=batch.batch_id, step=0, total=batch.params.steps, compiling=True))
        self.state.record("compute_start", batch.batch_id)
        self.state.record_gpu("compute_start", batch.batch_id)
        t0 = time.perf_counter()
        ran = len(live)
        upscaler_retries = self.finish.oom_retries
        try:
            self.adapters.activate(batch.params.loras)  # before the meter: an adapter's weights are not working memory
            self.meter.start()
            # out of memory: retried, in halves (worker/retry.py); retried, its peak is not its need
            live, outputs, retried = run_or_retry(batch, live, inputs, forward, pipeline=self.pipeline, endings=endings)
        except Interrupted as exc:
            endings.cancelled(live_ids, exc)
            return
        except Exception as exc:
            if is_fatal(exc):
                raise
            endings.failed(live_ids, exc)
            return
        finally:
            self.copier.submit_previews()  # ahead of the outputs' CopyJob
        if not live:  # every part ran out of memory; each request has ended with out_of_memory
            return
        self.state.record_gpu("compute_end", batch.batch_id)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        compute_ms = (time.perf_counter() - t0) * 1000
        # a peak after running out of memory, or while compiling, is not what the shape needs: not reported
        working = self.meter.stop(outputs)
        retried = retried or self.finish.oom_retries != upscaler_retries  # the upscaler's own retry too
        measured = working is not None and not retried and not compiling
        self.state.record("compute_end", batch.batch_id)
        self.post(ComputeDone(batch_id=batch.batch_id, compute_ms=compute_ms,
                              working_bytes=working if measured else None, working_batch=ran if measured else 0,
                              lora_versions=self.adapters.versions(batch.params.loras),
                              weight_versions=dict(self.adapters.weight_versions)))
        job = CopyJob(batch.batch_id, batch.params, live, outputs, event, trajectories or None)
        if self.sync_output:
            self.copier.process(job)
        else:
            self.copier.submit(job)

    def _empty_cache(self) -> None:
        """Give the allocator's cached blocks back, so the retry starts from what is really in use."""
        if self.cuda:
            torch.cuda.empty_cache()

    def loaded_loras(self) -> list[str]:
        return self.adapters.loaded()

    @staticmethod
    def _inputs(requests: list[RequestSpec], fds: list[int]) -> list[EditArrays]:
        """Each request's input image and mask, copied out of the buffers that came with the batch."""
        result: list[EditArrays] = []
        for r in requests:
            if r.input is None:
                raise ValueError(f"request {r.request_id} of an edit batch has no input image")
            result.append(read_inputs(fds, r.input))
        return result
