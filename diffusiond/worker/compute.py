"""The compute thread: forward passes back to back, never waiting for an output copy.

After each batch it records a CUDA event on the default stream, announces COMPUTE_DONE and hands
the device outputs to the copy thread, then takes the next batch at once: the engine keeps one
queued, so the GPU goes from one forward straight into the next. Control items (SLEEP, WAKE,
SHUTDOWN) travel through the same queue, so they run after the batches sent before them.

Warm-up (``--warmup``, ``warmup.py``) runs on this thread too, before READY; what each forward runs
with (its LoRA adapters, live updates between batches) is ``adapters.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import diffusiond.pipelines.hostcopy as hostcopy
from diffusiond.ipc.errors import ArenaError
from diffusiond.ipc.inputs import read_controls, read_inputs, read_pictures, read_references
from diffusiond.ipc.messages import (
    Ack,
    AddLora,
    ComputeDone,
    EndStatus,
    Execute,
    Fatal,
    Kind,
    Progress,
    RequestEnded,
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
from diffusiond.protocol import ErrorCode
from diffusiond.worker import profile
from diffusiond.worker.adapters import AdapterOutOfMemory, LiveAdapters
from diffusiond.worker.copier import Copier, CopyJob
from diffusiond.worker.failures import first_line, is_fatal, is_oom, oom_message, oom_shape
from diffusiond.worker.finish import Finisher, first_pass, first_pass_previews
from diffusiond.worker.memory import PeakMeter
from diffusiond.worker.startup import bind_thread
from diffusiond.worker.state import SharedState
from diffusiond.worker.warmup import warm_up

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Control:
    command: Literal["sleep", "wake", "shutdown", "release"]
    ack_id: int = 0  # the command's, echoed in its ACK


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


_KIND = {"sleep": Kind.SLEEP, "wake": Kind.WAKE, "shutdown": Kind.SHUTDOWN, "release": Kind.RELEASE}


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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
        self.drain_timeout_s = drain_timeout_s
        self.on_exit = on_exit
        self.warmup = list(warmup)
        self.on_ready = on_ready
        self.before_forward = before_forward  # tests only (worker/faults.py): e.g. an injected out-of-memory
        self._ended: set[str] = set()  # the current batch's requests already ended: each ends exactly once
        self._retried = False  # the current batch ran out of memory once: its peak is not its need
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
                if self._control(item):
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
        self._ended.clear()
        live = [r for r in batch.requests if not self.state.is_cancelled(r.request_id)]
        for r in batch.requests:
            if r not in live:
                self._end(batch.batch_id, r.request_id, "cancelled", "cancelled while queued on the worker")
        if not live:
            close_fds(fds)
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
            self._fail_all(batch.batch_id, live_ids, f"could not read the input image: {exc}")
            return
        finally:
            close_fds(fds)
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
            # of the whole batch, a cancelled half never stopped: the other half's requests never all are
            return not self.state.all_cancelled(running)  #

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
        self._retried = False
        upscaler_retries = self.finish.oom_retries
        try:
            self.adapters.activate(batch.params.loras)  # before the meter: an adapter's weights are not working memory
            self.meter.start()
            live, outputs = self._run_or_retry(batch, live, inputs, forward)
        except Interrupted as exc:
            self._cancelled(batch.batch_id, live_ids, exc)
            return
        except Exception as exc:
            if is_fatal(exc):
                raise
            self._failed(batch.batch_id, live_ids, exc)
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
        retried = self._retried or self.finish.oom_retries != upscaler_retries  # the upscaler's own retry too
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

    def _run_or_retry(
        self, batch: Execute, live: list[RequestSpec], inputs: list[EditArrays],
        forward: Callable[[list[RequestSpec], list[EditArrays]], list[torch.Tensor]],
    ) -> tuple[list[RequestSpec], list[torch.Tensor]]:
        """The batch's forward; out of memory, once more after emptying the allocator's cache, as two
        halves when it holds more than one request (seeds are per request, so a half gives what it
        would alone). What still runs out fails with ``out_of_memory``; the rest goes on. A half whose
        requests are all cancelled (the finisher asks about the requests it was handed) ends those
        ``cancelled``, one that fails another way ends them with its error, and the other half keeps its
        outputs either way. Returns the requests that have outputs, and those outputs. The engine hears of
        the retry (``oom_retry``) and sends idle models on this device away; the retry does not wait for that
        (the other models' workers are other processes): it helps the halves and the jobs after."""
        try:
            return live, forward(live, inputs)
        except Exception as exc:
            if not is_oom(exc):
                raise
            first = exc
        self._retried = True
        self._empty_cache()
        split = len(live) > 1
        log.warning("batch %d (%s) ran out of memory; retrying%s: %s", batch.batch_id, oom_shape(batch, len(live)),
                    " as two halves" if split else "", first_line(first))
        self.post(Progress(batch_id=batch.batch_id, step=0, total=batch.params.steps, oom_retry=True))
        mid = (len(live) + 1) // 2
        parts = [(live[:mid], inputs[:mid]), (live[mid:], inputs[mid:])] if split else [(live, inputs)]
        done: list[RequestSpec] = []
        outputs: list[torch.Tensor] = []
        for requests, arrays in parts:
            try:
                outputs.extend(forward(requests, arrays))
            except Interrupted as exc:
                self._cancelled(batch.batch_id, [r.request_id for r in requests], exc)
                continue
            except Exception as exc:
                if is_fatal(exc):
                    raise
                if not is_oom(exc):  # this half's own failure: the other half's outputs stand
                    self._failed(batch.batch_id, [r.request_id for r in requests], exc)
                    continue
                self._empty_cache()
                message = oom_message(self.pipeline, batch, len(live), len(requests) if split else 0, exc)
                log.warning("batch %d: %s", batch.batch_id, message)
                for r in requests:
                    self._end(batch.batch_id, r.request_id, "failed", message, code=ErrorCode.OUT_OF_MEMORY)
                continue
            done.extend(requests)
        return done, outputs

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

    def _control(self, item: Control) -> bool:
        """Drain copies (bounded), then act. Returns True when the thread should end."""
        if item.command == "release":  # the host copy is no copy's source or target: nothing to drain
            try:
                hostcopy.release_all()
                self.post(Ack(command=Kind.RELEASE, ok=True, host_kept=hostcopy.kept(), ack_id=item.ack_id))
            except Exception as exc:  # answered: an exception here ended the thread, and every batch after waited
                self.post(Ack(command=Kind.RELEASE, ok=False, message=f"release failed: {type(exc).__name__}: "
                              f"{exc}", host_kept=hostcopy.kept(), ack_id=item.ack_id))
            return False
        self.state.record(f"drain_start_{item.command}", 0)
        drained = self.state.drain(self.drain_timeout_s)
        self.state.record(f"drain_end_{item.command}", 0)
        message = "" if drained else f"copy thread did not drain within {self.drain_timeout_s}s"
        ok = drained
        if not drained and item.command in ("sleep", "wake"):
            # nothing moves: an answer "not ok" over a model that had moved anyway left the engine sending batches
            # to a sleeping model, each failing, and its wakes to no one; the engine may ask again
            self.post(Ack(command=_KIND[item.command], ok=False, message=message, host_kept=hostcopy.kept(),
                          ack_id=item.ack_id))
            return False
        try:
            if item.command == "sleep":
                if self.ip_adapters is not None:  # out of the UNet before its weights move
                    self.ip_adapters.place(asleep=True)
                self.pipeline.sleep()
                if self.controlnets is not None:
                    self.controlnets.place(asleep=True)
                self.finish.place(asleep=True)
            elif item.command == "wake":
                self.pipeline.wake()
                if self.controlnets is not None:
                    self.controlnets.place(asleep=False)
                if self.ip_adapters is not None:
                    self.ip_adapters.place(asleep=False)
                self.finish.place(asleep=False)
        except Exception as exc:
            ok, message = False, f"{item.command} failed: {type(exc).__name__}: {exc}"
            if item.command == "sleep" and not self._undo_sleep():  # half moved: neither asleep nor awake
                self._die(f"sleep failed half-way and its weights could not be put back: {message}", 70,
                          between_batches=True)
                return True
        self.state.record(item.command, 0)
        self.post(Ack(command=_KIND[item.command], ok=ok, message=message, host_kept=hostcopy.kept(),
                     ack_id=item.ack_id))
        if item.command == "shutdown":
            self.on_exit(0 if drained else 1)
            return True
        return False

    def _undo_sleep(self) -> bool:
        """After a sleep that raised part-way, everything back on the device as before (the engine keeps the
        worker READY and sends it batches); False where that fails too."""
        try:
            self.pipeline.wake()
            for part in (self.controlnets, self.ip_adapters):
                if part is not None:
                    part.place(asleep=False)
            self.finish.place(asleep=False)
        except Exception:
            log.exception("putting the weights back after a failed sleep failed")
            return False
        return True

    def _fail_all(self, batch_id: int, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            self._end(batch_id, rid, "failed", message)

    def _failed(self, batch_id: int, request_ids: list[str], exc: Exception) -> None:
        """A failure of these requests' forward that leaves the device sound: each ends with it, in its own words;
        a LoRA that did not fit in the device's memory ends them ``out_of_memory``, saying what would help."""
        log.error("batch %d: %s failed", batch_id, ", ".join(request_ids), exc_info=exc)
        oom = isinstance(exc, AdapterOutOfMemory)
        if oom:
            self._empty_cache()  # the half-loaded adapter's blocks: back before the next batch
        for rid in request_ids:
            self._end(batch_id, rid, "failed", str(exc) if oom else f"{type(exc).__name__}: {exc}",
                      code=ErrorCode.OUT_OF_MEMORY if oom else "")

    def _cancelled(self, batch_id: int, request_ids: list[str], exc: Interrupted) -> None:
        for rid in request_ids:
            self._end(batch_id, rid, "cancelled", f"cancelled during compute ({exc})")

    def _end(self, batch_id: int, request_id: str, status: EndStatus, message: str, code: str = "") -> None:
        if request_id in self._ended:  # ended by the out-of-memory path already: once only
            return
        self._ended.add(request_id)
        self.state.finish(request_id)
        self.post(RequestEnded(request_id, batch_id, status, message, "computing", code=code))
