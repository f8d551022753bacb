"""The worker's event loop thread: owns the channel, dispatches commands, starts the threads.

Start-up: wait for INIT, create the arena (registered with CUDA when the device is a GPU), send
HELLO with the arena fd, load the model off the loop, send READY. Any failure on the way is sent
as FATAL, with the reason, and the worker exits 1.
If the engine goes away (channel EOF) the worker exits at once: it has nobody to deliver to.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

import diffusiond.worker.startup as startup
from diffusiond.ipc import cuda_host
from diffusiond.ipc.arena import Arena
from diffusiond.ipc.channel import Channel
from diffusiond.ipc.errors import ArenaError, ChannelClosed
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import (
    Ack,
    AddLora,
    Cancel,
    Execute,
    Fatal,
    Hello,
    Init,
    Kind,
    LoadProgress,
    ParamTableFrame,
    Ping,
    Ready,
    Release,
    Shutdown,
    Sleep,
    Trace,
    UpdateLora,
    UpdateWeights,
    Wake,
    WorkerConfig,
)
from diffusiond.pipelines.base import host_weight_bytes, weight_bytes
from diffusiond.pipelines.phases import Phases
from diffusiond.pipelines.spec import loads_libraries
from diffusiond.worker.compute import ComputeThread, Edit, LiveUpdate
from diffusiond.worker.control_items import Control
from diffusiond.worker.copier import Copier
from diffusiond.worker.finish import Finisher
from diffusiond.worker.state import SharedState

if TYPE_CHECKING:
    from diffusiond.pipelines.base import Pipeline
    from diffusiond.pipelines.controlnet import ControlNets
    from diffusiond.pipelines.ip_adapter import IpAdapters
    from diffusiond.pipelines.loras import Adapters

log = logging.getLogger("diffusiond.worker")


class Worker:
    def __init__(self, sock: socket.socket) -> None:
        self.channel = Channel(sock, name=f"worker[{os.getpid()}]")
        self.state = SharedState()
        self.config: WorkerConfig | None = None
        self.arena: Arena | None = None
        self.copier: Copier | None = None
        self.compute: ComputeThread | None = None
        # commands that arrive while the model loads
        self.pending: list[Execute | Edit | Control | AddLora | LiveUpdate] = []
        self.exit_code: asyncio.Future[int] | None = None
        self._init_task: asyncio.Future[None] | None = None
        self.shutting_down = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.exit_code = loop.create_future()
        self.channel.start(self._on_frame, self._on_close)
        code = await self.exit_code
        with contextlib.suppress(Exception):  # all of it: the last outputs' frames, a FATAL
            await asyncio.wait_for(self.channel.drain(below=0), 5)
        return code

    def exit(self, code: int) -> None:
        """Thread-safe: ask the loop to finish with ``code``."""
        assert self.exit_code is not None
        fut = self.exit_code

        def finish() -> None:
            if not fut.done():
                fut.set_result(code)

        fut.get_loop().call_soon_threadsafe(finish)

    # channel callbacks (loop thread) --------------------------------------------------------
    def _on_close(self, reason: BaseException | None) -> None:
        log.info("channel closed (%s); exiting", reason)
        # The compute thread may be deep in a forward; there is no one left to deliver to.
        os._exit(0 if reason is None or self.shutting_down else 1)

    def _on_frame(self, frame: Frame) -> None:
        msg = frame.msg
        if isinstance(msg, Init):
            self._init_task = asyncio.ensure_future(self._init(msg.config))
        elif isinstance(msg, Execute):
            self.state.admit([r.request_id for r in msg.requests])
            self._enqueue(Edit(msg, frame.fds) if frame.fds else msg)
        elif isinstance(msg, Cancel):
            self.state.cancel(msg.request_ids)
        elif isinstance(msg, Release):
            self._release(msg.slot_ids)
            if msg.host_copy:  # on the compute thread, between batches, as a sleep is
                self._enqueue(Control("release", msg.ack_id))
        elif isinstance(msg, Sleep):
            self._enqueue(Control("sleep", msg.ack_id))
        elif isinstance(msg, Wake):
            self._enqueue(Control("wake", msg.ack_id))
        elif isinstance(msg, Shutdown):
            self.shutting_down = True
            self._enqueue(Control("shutdown", msg.ack_id))
        elif isinstance(msg, Trace):
            self.channel.post(self._trace_ack(msg.ack_id))
        elif isinstance(msg, AddLora):
            self._enqueue(msg)  # on the compute thread, between batches: never under a forward
        elif isinstance(msg, UpdateLora | UpdateWeights):
            self._enqueue(LiveUpdate(msg, frame.fds))  # likewise; the compute thread closes the fd
        elif isinstance(msg, Ping):
            loaded = self.compute.loaded_loras() if self.compute is not None else []
            self.channel.post(Ack(command=Kind.PING, ok=True, loras_loaded=loaded))
        else:
            log.error("unexpected %s frame from the engine", frame.kind.name)

    def _trace_ack(self, ack_id: int) -> Ack:
        with self.state.lock:
            events = list(self.state.trace)
        arena, copier = self.arena, self.copier
        return Ack(
            command=Kind.TRACE,
            ok=True,
            trace=events,
            gpu_trace=self.state.gpu_trace(),
            arena_in_use=arena.in_use if arena else 0,
            arena_high_water=arena.high_water if arena else 0,
            slots_in_use=arena.slots_in_use if arena else 0,
            dedicated_bytes=copier.dedicated_bytes if copier else 0,
            ack_id=ack_id,
        )

    def _enqueue(self, item: Execute | Edit | Control | AddLora | LiveUpdate) -> None:
        if self.compute is None:
            self.pending.append(item)
        else:
            self.compute.queue.put(item)

    def _release(self, slot_ids: list[int]) -> None:
        for sid in slot_ids:
            try:
                assert self.copier is not None
                self.copier.release(sid)
            except (ArenaError, AssertionError) as exc:
                log.warning("release of slot %d: %s", sid, exc)

    # start-up -------------------------------------------------------------------------------
    async def _init(self, config: WorkerConfig) -> None:
        """Start up; any failure is posted as FATAL, with the reason, and the process exits 1.

        The engine waits for READY; a start-up that fails silently would leave it waiting until
        its start timeout, with no reason to give.
        """
        try:
            await self._start(config)
        except Exception as exc:
            # a refusal with its reason (a model's folder or options) is logged once, by the engine, as that
            # reason; its traceback helps only whoever debugs the loader. Anything else is a fault: traceback.
            log.log(logging.DEBUG if isinstance(exc, _StartError) else logging.ERROR, "start-up failed", exc_info=True)
            message = str(exc) if isinstance(exc, _StartError) else f"start-up failed: {type(exc).__name__}: {exc}"
            with contextlib.suppress(ChannelClosed):
                self.channel.post(Fatal(message=message))
            self.exit(1)

    async def _start(self, config: WorkerConfig) -> None:
        self.config = config
        faults = None
        if config.fault:  # test-only; see worker/faults.py
            from diffusiond.worker.faults import Faults, tamper

            faults = Faults.parse(config.fault)
            if faults.frame is not None:
                self.channel.encoder = tamper(self.channel.encoder, *faults.frame)
        phases = startup.StartPhases()
        is_cuda = config.device.startswith("cuda")
        self.state.trace_gpu = config.trace_gpu and is_cuda
        if is_cuda:
            import torch

            torch.cuda.set_device(torch.device(config.device))
            asyncio.get_running_loop().set_default_executor(startup.device_executor(torch.device(config.device)))
            if faults is not None and faults.memory_fraction:  # tests only: a real out-of-memory, on a big GPU
                torch.cuda.set_per_process_memory_fraction(faults.memory_fraction)
            phases.mark("cuda init")
        self.arena = Arena(
            config.arena_bytes, name=f"diffusiond-arena-w{config.worker_id}",
            on_map=cuda_host.register if is_cuda else None, on_unmap=cuda_host.unregister if is_cuda else None,
        )
        phases.mark(f"arena ({config.arena_bytes >> 20} MiB{', registered' if is_cuda else ''})")
        self.channel.post(Hello(config.worker_id, os.getpid(), self.arena.capacity), [self.arena.fd])
        t0 = time.perf_counter()
        progress = _Progress(self.channel.post_threadsafe, faults.load_delay_ms if faults is not None else 0)
        if loads_libraries(config.model_spec):
            await asyncio.to_thread(startup.import_libraries)
            phases.mark("imports (diffusers, transformers)")
        if config.compile:
            await asyncio.to_thread(startup.import_compiler)
            phases.mark("imports (torch's compiler)")
        try:
            pipeline = await asyncio.to_thread(self._load, config, progress)
        except Exception as exc:
            raise _StartError(f"loading model {config.model_name!r} ({config.model_spec}) failed: {exc}") from exc
        step, smallest = pipeline.capabilities.size_step, pipeline.capabilities.min_size
        for shape in config.warmup:  # the engine knows only 8; the model's own multiple is known once loaded
            if shape.width % step or shape.height % step or min(shape.width, shape.height) < smallest:
                raise _StartError(f"--warmup {shape.width}x{shape.height}:{shape.batch}: model "
                                  f"{config.model_name!r} makes sizes in multiples of {step}, at least {smallest} "
                                  "a side; warm such a size")
        load = getattr(getattr(pipeline, "inner", pipeline), "load_phases", None)  # a compiled one wraps it
        phases.model(load if isinstance(load, Phases) else None)
        adapters, lora_errors = await asyncio.to_thread(self._load_loras, pipeline, config)
        controlnets = await asyncio.to_thread(self._load_controlnets, pipeline, config)
        ip_adapters = await asyncio.to_thread(self._load_ip_adapters, pipeline, config)
        if faults is None or not faults.no_param_table:  # the model as it will run: adapters' layers in place
            table = await asyncio.to_thread(self._param_table, pipeline, adapters)
            if table:
                self.channel.post(ParamTableFrame(config.model_name, table))
        try:
            finisher = await asyncio.to_thread(self._finisher, pipeline, config)
        except Exception as exc:
            raise _StartError(f"loading the upscalers failed: {exc}") from exc
        finisher.cancelled = self.state.all_cancelled  # a cancelled batch stops its upscale
        beside = [*(controlnets.modules() if controlnets else ()), *(ip_adapters.modules() if ip_adapters else ()),
                  *(finisher.upscalers.modules() if finisher.upscalers else ())]  # on its device, counted with it
        phases.mark("adapters, controlnets, upscalers")
        progress.send(weight_bytes(pipeline, beside))  # all of it, as READY counts it
        post = self.channel.post_threadsafe

        def ready() -> None:  # on the compute thread, once the warm-up shapes have run
            phases.report(config.model_name)
            if config.compile and config.warmup:
                from diffusiond.pipelines.compile import cache_report

                log.info("%s after its warm-up: %s", config.model_name, cache_report())
            post(Ready(config.model_name, str(pipeline.device), (time.perf_counter() - t0) * 1000,
                       msgspec.structs.replace(pipeline.capabilities, weight_bytes=weight_bytes(pipeline, beside),
                                               host_bytes=host_weight_bytes(pipeline)),
                       lora_errors=lora_errors, controlnet_errors=controlnets.errors if controlnets else {},
                       ip_adapter_errors=ip_adapters.errors if ip_adapters else {}))

        before_forward = None
        if faults is None:
            self.copier = Copier(self.arena, self.state, post, device=pipeline.device,
                                 slot_timeout_s=config.slot_timeout_s)
        else:
            from diffusiond.worker.faults import FaultyCopier, forward_fault, upscale_fault

            before_forward = forward_fault(faults, is_cuda)
            if finisher.upscalers is not None:
                upscale_fault(faults, finisher.upscalers.models, is_cuda)

            self.copier = FaultyCopier(self.arena, self.state, post, device=pipeline.device,
                                       slot_timeout_s=config.slot_timeout_s, faults=faults)
        self.compute = ComputeThread(
            pipeline,
            self.copier,
            self.state,
            post,
            sync_output=config.output_mode == "sync",
            progress_interval_s=config.progress_interval_s,
            drain_timeout_s=config.drain_timeout_s,
            on_exit=self.exit,
            adapters=adapters,
            controlnets=controlnets,
            ip_adapters=ip_adapters,
            finisher=finisher,
            warmup=config.warmup,
            before_forward=before_forward,
            on_ready=ready,
        )
        if faults is not None and faults.no_working_measure:
            self.compute.meter.available = False
        if faults is not None and faults.working_bytes:
            self.compute.meter.forced = faults.working_bytes
        for item in self.pending:
            self.compute.queue.put(item)
        self.pending.clear()
        self.copier.start()
        self.compute.start()  # it sends READY once the warm-up shapes have run

    @staticmethod
    def _load(config: WorkerConfig, progress: _Progress) -> Pipeline:
        from diffusiond.pipelines import load_pipeline
        from diffusiond.pipelines.load_progress import reporting
        from diffusiond.pipelines.spec import model_options

        # One set of options for the load and the compile: a spec's own (tiny,fuse_qkv=1) count as the table's.
        options = model_options(config.model_spec, config.options)
        try:
            with reporting(progress):
                pipeline = load_pipeline(
                    config.model_spec, name=config.model_name, device=config.device, dtype=config.dtype,
                    options=options,
                )
        finally:
            progress.slow_down()  # a load that reported no component (or failed) takes load_delay_ms longer too
        if not config.compile:
            return pipeline
        from diffusiond.pipelines.compile import CompiledPipeline, set_cache_dir

        set_cache_dir(config.compile_cache_dir)
        compiled = CompiledPipeline(pipeline, config.compile, options)
        load = getattr(pipeline, "load_phases", None)
        if isinstance(load, Phases):
            load.mark("compile set-up")
        return compiled


    @staticmethod
    def _param_table(pipeline: Pipeline, adapters: Adapters | None) -> bytes:
        """PARAM_TABLE's table (ipc/params.py), or b'' when it cannot be read: the engine then checks updates
        for this model against its files, as for one that never ran, instead of the start failing."""
        from diffusiond.ipc.params import pack
        from diffusiond.worker.weights import param_table

        try:
            return pack(param_table(pipeline, adapters))
        except Exception:
            log.warning("the model's parameter table could not be read; updates for it with no worker are "
                        "checked against its files", exc_info=True)
            return b""

    @staticmethod
    def _load_loras(pipeline: Pipeline, config: WorkerConfig) -> tuple[Adapters | None, dict[str, str]]:
        """Check every configured adapter against the model by loading it; name -> why for those
        that do not fit (the engine decides whether that stops the daemon)."""
        from diffusiond.pipelines.hotswap import adapters_for
        from diffusiond.pipelines.loras import unsupported

        adapters = adapters_for(pipeline, {}, config.max_loras, config.lora_target_rank)
        if adapters is None:
            return None, dict.fromkeys(config.loras, unsupported(pipeline))
        errors = {name: why for name, path in config.loras.items() if (why := adapters.register(name, path))}
        return adapters, errors

    @staticmethod
    def _finisher(pipeline: Pipeline, config: WorkerConfig) -> Finisher:
        """Hires passes and upscalers (worker/finish.py); each configured upscaler loaded once and kept."""
        if not config.upscalers:
            return Finisher(pipeline, None)
        from diffusiond.pipelines.upscalers import Upscalers

        return Finisher(pipeline, Upscalers(config.upscalers, pipeline.device))

    @staticmethod
    def _load_controlnets(pipeline: Pipeline, config: WorkerConfig) -> ControlNets | None:
        """Every configured ControlNet, loaded once and kept; those that do not fit are named with why."""
        if not config.controlnets:
            return None
        from diffusiond.pipelines.controlnet import ControlNets

        return ControlNets(pipeline, config.controlnets)

    @staticmethod
    def _load_ip_adapters(pipeline: Pipeline, config: WorkerConfig) -> IpAdapters | None:
        """Every configured IP-Adapter read once and tried on the model; those that do not fit say why."""
        if not config.ip_adapters:
            return None
        from diffusiond.pipelines.ip_adapter import IpAdapters

        return IpAdapters(pipeline, config.ip_adapters)


class _Progress:
    """LOAD_PROGRESS frames from the loading thread: the bytes loaded so far, after each component, never
    less than the last sent (``pipelines/load_progress.py``). With the test fault ``load_delay_ms`` the load
    stops that long after its first component, so a job is seen waiting on a load that is part done."""

    def __init__(self, post: Callable[[LoadProgress], None], delay_ms: int) -> None:
        self.post = post
        self.sent = 0
        self.delay_s = delay_ms / 1000

    def __call__(self, nbytes: int) -> None:
        self.send(nbytes)
        self.slow_down()

    def send(self, nbytes: int) -> None:
        if nbytes > self.sent:
            self.sent = nbytes
            self.post(LoadProgress(nbytes))

    def slow_down(self) -> None:
        if self.delay_s:
            delay, self.delay_s = self.delay_s, 0.0
            time.sleep(delay)


class _StartError(Exception):
    """A start-up failure whose message already says what failed."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffusiond-worker", description="diffusiond worker (spawned by the engine)")
    parser.add_argument("--fd", type=int, required=True, help="inherited channel socket fd")
    parser.add_argument("--log-level", default=os.environ.get("DIFFUSIOND_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    startup.at_main()
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        startup.quiet_libraries()
    # The engine handles SIGINT/SIGTERM for the process group and tells us to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    import uvloop

    code = uvloop.run(Worker(sock).run())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # daemon threads may sit in native code; do not wait for interpreter teardown
