"""Jobs: the single source of truth for every request's state.

A ``Job`` is created at admission, before anything is sent to a worker, so whatever arrives for
it later (progress, an output, a failure), in whatever order, has a place to land. Its ``n``
outputs are ``Item``s: the unit of batching, copying and encoding (``RequestSpec`` on the wire).

Status moves forward only: queued -> running -> succeeded | failed | cancelled, and the terminal
transition happens exactly once (``Job.end``); listeners (SSE streams, waiting handlers) learn
about it through ``Job.listeners`` (called on the loop, in order) and ``Job.finished``, once the
ending is on disk (``Job.announce``). What a
client sees of a job (its JSON, its URLs) is drawn by the HTTP layer (``views.py``), not here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from diffusiond.daemon.core.controls import ControlInput
from diffusiond.daemon.core.inputs import EditInput
from diffusiond.daemon.core.ip_adapters import IpAdapterInput
from diffusiond.daemon.errors import OutputNotReady
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.ipc.inputs import InputBuffer
from diffusiond.ipc.messages import BatchParams, LoraRef
from diffusiond.ipc.sidearrays import TrajectoryDesc, TrajectorySpec
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.ipc.upscale import HiresSpec, UpscaleSpec, img2img_steps
from diffusiond.protocol import STRENGTH_TASKS, Event, JobStatus, OutputDtype, Stage

Listener = Callable[[Event, "Job"], None]
"""Told of every event of a job, on the loop, as it happens (an SSE stream renders it at once)."""


@dataclass(frozen=True)
class PreviewSpec:
    """What a request asked of previews: a picture every ``every`` steps, ``format``, at most
    ``max_side`` pixels on its longer side."""

    every: int
    format: str = "jpeg"
    max_side: int = 256


@dataclass(frozen=True)
class Preview:
    """The latest preview of one output, encoded."""

    index: int
    step: int
    total: int
    format: str
    data: bytes


@dataclass(frozen=True)
class JobRequest:
    """A validated request; what ``requests.parse_*`` produce and the engine consumes."""

    model: str
    prompt: str
    n: int
    width: int
    height: int
    steps: int
    guidance: float
    output_format: str
    seed: int | None = None
    negative_prompt: str | None = None
    num_frames: int | None = None
    fps: int = 16
    fps_conditions: bool = False  # its model is conditioned on fps (LTX-2): then fps is in the batch key
    timeout_s: float | None = None
    output_dtype: OutputDtype = "uint8"
    scheduler: str | None = None
    noise_level: float | None = None  # flow-sde only
    eta: float | None = None  # ddim only
    preview: PreviewSpec | None = None  # None: no previews (the default)
    trajectory: TrajectorySpec | None = None  # each output's latents and log-probs (issue 29); None: none
    audio_rate: int = 0  # each output's sound track comes back, at this rate (the model's; issue 30); 0: none
    loras: tuple[tuple[str, float], ...] = ()  # (name, weight), sorted by name
    keep_alive_s: float | None = None  # how long its model stays on the device after it (None: the model's)
    # an edit's decoded input; the job owns it and the engine closes it when the job ends
    edit: EditInput | None = field(default=None, compare=False)
    # ControlNets as asked, (name, scale, start, end, preprocess, mode): what history and output metadata show
    controls: tuple[tuple[str, float, float, float, str, int | None], ...] = ()
    # the decoded control images and their ControlNets (daemon/core/controls.py); owned like ``edit``
    control: ControlInput | None = field(default=None, compare=False)
    # IP-Adapters as asked, (name, scale, reference image digest); their decoded images, owned like ``edit``
    ip_adapters: tuple[tuple[str, float, str], ...] = ()
    ip_adapter: IpAdapterInput | None = field(default=None, compare=False)
    hires: HiresSpec | None = None  # a second pass at a larger size (daemon/edge/upscale.py)
    upscale: UpscaleSpec | None = None  # every output through an upscaler, last
    # the steps an image-to-image or inpainting edit really runs, its strength's share of ``steps`` as
    # diffusers rounds it (``admitted``); kept, since the edit's input is not: None, all of ``steps``
    edit_steps: int | None = None

    def batch_params(self) -> BatchParams:
        return BatchParams(
            width=self.width,
            height=self.height,
            steps=self.steps,
            guidance=self.guidance,
            num_frames=self.num_frames,
            fps=self.fps if self.num_frames is not None and self.fps_conditions else None,
            scheduler=self.scheduler,
            noise_level=self.noise_level,
            eta=self.eta,
            output_dtype=self.output_dtype,
            loras=self.lora_refs(),
            edit=self.edit.task.value if self.edit else None,
            strength=self.edit.strength if self.edit else None,
            controls=self.control.refs if self.control else (),
            ip_adapters=self.ip_adapter.refs if self.ip_adapter else (),
            trajectory=self.trajectory,
            hires=self.hires,
            upscale=self.upscale,
        )

    def admitted(self, flow: bool | None) -> JobRequest:
        """The request as its model runs it: an edit with a strength runs fewer steps than ``steps``, by
        its model's rule (``flow``: a flow-matching scheduler's), and its progress counts those from the
        start, before any event says so."""
        if self.edit is None or self.edit.task not in STRENGTH_TASKS:
            return self
        return dataclasses.replace(self, edit_steps=img2img_steps(self.steps, self.edit.strength, bool(flow)))

    @property
    def total_steps(self) -> int:
        """The steps the job's progress counts: those its first pass runs, and a hires pass's own."""
        first = self.steps if self.edit_steps is None else self.edit_steps
        return first + (self.hires.steps if self.hires else 0)

    @property
    def work_size(self) -> tuple[int, int]:
        """The largest size a denoiser runs at for this job (what its working memory depends on)."""
        return (self.hires.width, self.hires.height) if self.hires else (self.width, self.height)

    @property
    def output_size(self) -> tuple[int, int]:
        """Each output's width and height, after a hires pass and an upscaler."""
        return (self.upscale.width, self.upscale.height) if self.upscale else self.work_size

    @property
    def buffer(self) -> InputBuffer | None:
        """The sealed input that travels with each batch of this job (an edit's, the control images' or
        the reference images'): one per job, each later one holding the earlier ones' arrays too (the
        control images' an edit's, edge/controls.py; a reference's both, edge/ip_adapters.py), and the
        last made is the one sent."""
        owner = self.ip_adapter or self.control or self.edit
        return owner.buffer if owner is not None else None

    def close_inputs(self) -> None:
        for owned in (self.edit, self.control, self.ip_adapter):
            if owned is not None:
                owned.close()

    def lora_refs(self) -> tuple[LoraRef, ...]:
        """The adapters that act: a weight of 0 changes nothing, so it neither loads an adapter nor
        keeps the request from batching with base-model requests."""
        return tuple(LoraRef(name, weight) for name, weight in self.loras if weight != 0)


@dataclass(eq=False)
class Item:
    job: Job
    index: int
    seed: int
    stage: Stage = Stage.QUEUED
    worker: WorkerLink | None = None
    batch_id: int | None = None
    desc: TensorDesc | None = None  # set while this item holds a slot in its worker's arena
    data: bytes | None = None  # encoded output (formats other than npy), or a spilled npy
    nbytes: int = 0
    pins: int = 0  # readers of the slot right now (encoder, a streaming response)
    release_pending: bool = False  # released while pinned: give the slot back at the last unpin
    spilling: bool = False  # being copied out of the arena into ``data`` (arena pressure)
    enqueued_at: float = field(default_factory=time.monotonic)
    preview: Preview | None = None  # the latest one (kept with the job, for GET .../preview/{k})
    file: str | None = None  # the output's file in the state dir, once written (durable jobs)
    # its trajectory (issue 29) in the worker's shared memory, when the job asked for one; held, pinned
    # and given back apart from the output's slot (an encoded output's slot goes back long before it)
    trajectory: TrajectoryDesc | None = None
    trajectory_data: bytes | None = None  # the region's bytes, once spilled out of the arena
    trajectory_pins: int = 0
    trajectory_release_pending: bool = False
    trajectory_files: dict[str, dict[str, Any]] | None = None  # its arrays' files in the state dir (durable jobs)
    # The versions of the live adapters and components its own batch ran with (COMPUTE_DONE's); None until
    # that batch's forward ends. Kept per output, not per job: a job of several outputs may run as several
    # batches, and an update applied between two of them gives its outputs different versions.
    lora_versions: dict[str, int] | None = None
    weight_versions: dict[str, int] | None = None

    @property
    def request_id(self) -> str:
        return f"{self.job.id}/{self.index}"

    @property
    def delivered(self) -> bool:
        """Its output has left the worker: from ENCODING on (an encoded output's slot goes back before its file
        is written, so ``desc`` does not tell it)."""
        return self.stage >= Stage.ENCODING

    @property
    def done(self) -> bool:
        """Its output can be served to clients."""
        return self.stage == Stage.DONE

    def check_ready(self) -> None:
        """Refuse a read (of its output, trajectory or sound track) before it can be served."""
        if not self.done:
            raise OutputNotReady(f"output {self.index} of job {self.job.id} is not ready (job "
                                 f"{self.job.status.value})", stage=self.job.stage.label)


@dataclass(eq=False)
class Job:
    request: JobRequest
    id: str = field(default_factory=lambda: "j_" + secrets.token_hex(8))
    created: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    status: JobStatus = JobStatus.QUEUED
    progress: tuple[int, int] = (0, 0)
    error: dict[str, Any] | None = None
    items: list[Item] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)
    ended_at: float | None = None
    # What the model ran with that the default path does not: approximate speed-ups (named in
    # every output), the torch.compile mode and the attention backend; from the model's capabilities
    # at admission.
    approximations: tuple[str, ...] = ()
    compiled: str = ""
    attention: str = ""  # the attention backend, "" on the default path (pipelines/attention.py)
    sync: bool = False  # submitted through the synchronous endpoint
    attempts: int = 1  # runs started: a job that was running when the daemon died runs again from the start
    listeners: set[Listener] = field(default_factory=set)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # set by ``announce``, not by ``end``
    recorded: asyncio.Future[None] | None = None  # the write of its ending to the state dir (None: nothing to wait)
    deadline: asyncio.TimerHandle | None = None
    last_preview: Preview | None = None  # what a PREVIEW event is about, while it is emitted
    held: str | None = None  # queued, and why: "loading", "waiting_for_memory" or "waiting_for_turn"
    load_bytes: int | None = None  # while "loading": the model's weights as last counted (None: never loaded)
    bytes_loaded: int | None = None  # while "loading": how many of them its load has read (None: no report yet)

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    @property
    def stage(self) -> Stage:
        if self.status == JobStatus.SUCCEEDED:
            return Stage.DONE
        live = [i.stage for i in self.items if not i.done]
        return min(live) if live else Stage.DONE

    @property
    def stage_label(self) -> str:
        """The stage as clients read it: a queued job held back by residency says why."""
        stage = self.stage
        return self.held if self.held and stage == Stage.QUEUED else stage.label

    @property
    def lora_versions(self) -> dict[str, int] | None:
        """Each adapter's version, when every output that has run agrees (see ``agreed``)."""
        return agreed(i.lora_versions for i in self.items)

    @property
    def weight_versions(self) -> dict[str, int] | None:
        """Each updated component's version, likewise."""
        return agreed(i.weight_versions for i in self.items)

    def workers(self) -> list[str]:
        return sorted({i.worker.name for i in self.items if i.worker is not None and not i.done})

    def add_timing(self, stage: str, ms: float) -> None:
        """Per-stage time of the job: the slowest of its items (they run side by side)."""
        self.timings_ms[stage] = max(self.timings_ms.get(stage, 0.0), round(ms, 3))

    # events --------------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        for listener in list(self.listeners):
            listener(event, self)

    def end(self, status: JobStatus, error: dict[str, Any] | None = None) -> bool:
        """The one terminal transition, in memory. Returns False if the job had already ended.
        Nobody is told yet: the engine calls ``announce`` once the ending is on disk, so a client
        told "cancelled" or "done" never meets the job running again after a restart."""
        if self.terminal:
            return False
        self.status = status
        self.error = error
        self.ended_at = time.monotonic()
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.timings_ms["total"] = round((self.ended_at - self.t0) * 1000, 3)
        return True

    def announce(self) -> None:
        """Tell listeners and waiters how the job ended (after ``end``, once it is recorded)."""
        if self.finished.is_set():
            return
        self.emit(Event.DONE if self.status == JobStatus.SUCCEEDED else Event.ERROR)
        self.finished.set()


def agreed(each: Iterable[dict[str, int] | None]) -> dict[str, int] | None:
    """The versions a job as a whole ran with: those of its outputs that have run, when they all agree.
    None when none has run yet, and when they differ: no one mapping would be true of every output, and
    a made-up one (the last batch's, the oldest) would be silently wrong for some; each output has its own."""
    known = [v for v in each if v is not None]
    if not known or any(v != known[0] for v in known[1:]):
        return None
    return dict(known[0])
