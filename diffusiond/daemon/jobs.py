"""Jobs: the single source of truth for every request's state.

A ``Job`` is created at admission, before anything is sent to a worker, so whatever arrives for
it later (progress, an output, a failure), in whatever order, has a place to land. Its ``n``
outputs are ``Item``s: the unit of batching, copying and encoding (``RequestSpec`` on the wire).

Status moves forward only: queued -> running -> succeeded | failed | cancelled, and the terminal
transition happens exactly once (``Job.end``); listeners (SSE streams, waiting handlers) learn
about it through ``Job.events``/``Job.finished``.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diffusiond.ipc.messages import BatchParams
from diffusiond.ipc.tensors import TensorDesc

if TYPE_CHECKING:
    from diffusiond.daemon.worker_handle import WorkerHandle


class Status(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED})


class Stage(enum.IntEnum):
    """Ordered: a job is in the least advanced stage of its items."""

    QUEUED = 0
    COMPUTING = 1
    COPYING = 2
    ENCODING = 3
    DONE = 4

    @property
    def label(self) -> str:
        return self.name.lower()


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
    timeout_s: float | None = None
    output_dtype: str = "uint8"
    scheduler: str | None = None

    def batch_params(self) -> BatchParams:
        return BatchParams(
            width=self.width,
            height=self.height,
            steps=self.steps,
            guidance=self.guidance,
            num_frames=self.num_frames,
            scheduler=self.scheduler,
            output_dtype=self.output_dtype,  # type: ignore[arg-type]
        )


@dataclass(eq=False)
class Item:
    job: Job
    index: int
    seed: int
    stage: Stage = Stage.QUEUED
    worker: WorkerHandle | None = None
    batch_id: int | None = None
    desc: TensorDesc | None = None  # set while this item holds a slot in its worker's arena
    data: bytes | None = None  # encoded output (formats other than npy)
    content_type: str = ""
    nbytes: int = 0
    done: bool = False  # output available to clients
    pins: int = 0  # readers of the slot right now (encoder, a streaming response)
    release_pending: bool = False  # released while pinned: give the slot back at the last unpin
    spilling: bool = False  # being copied out of the arena into ``data`` (arena pressure)
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def request_id(self) -> str:
        return f"{self.job.id}/{self.index}"


@dataclass(eq=False)
class Job:
    request: JobRequest
    id: str = field(default_factory=lambda: "j_" + secrets.token_hex(8))
    created: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    status: Status = Status.QUEUED
    progress: tuple[int, int] = (0, 0)
    error: dict[str, Any] | None = None
    items: list[Item] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)
    ended_at: float | None = None
    sync: bool = False  # submitted through the synchronous endpoint
    listeners: set[asyncio.Queue[tuple[str, dict[str, Any]]]] = field(default_factory=set)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    deadline: asyncio.TimerHandle | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def stage(self) -> Stage:
        if self.status == Status.SUCCEEDED:
            return Stage.DONE
        live = [i.stage for i in self.items if not i.done]
        return min(live) if live else Stage.DONE

    def workers(self) -> list[str]:
        return sorted({i.worker.name for i in self.items if i.worker is not None and not i.done})

    def add_timing(self, stage: str, ms: float) -> None:
        """Per-stage time of the job: the slowest of its items (they run side by side)."""
        self.timings_ms[stage] = max(self.timings_ms.get(stage, 0.0), round(ms, 3))

    # events --------------------------------------------------------------------------------
    def emit(self, event: str, data: dict[str, Any]) -> None:
        for q in list(self.listeners):
            q.put_nowait((event, data))

    def end(self, status: Status, error: dict[str, Any] | None = None) -> bool:
        """The one terminal transition. Returns False if the job had already ended."""
        if self.terminal:
            return False
        self.status = status
        self.error = error
        self.ended_at = time.monotonic()
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.timings_ms["total"] = round((self.ended_at - self.t0) * 1000, 3)
        body = self.to_json()
        self.emit("done" if status == Status.SUCCEEDED else "error", body)
        self.finished.set()
        return True

    def to_json(self) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id,
            "object": "job",
            "model": r.model,
            "created": int(self.created),
            "status": self.status.value,
            "stage": self.stage.label,
            "progress": {"step": self.progress[0], "total": self.progress[1] or r.steps},
            "outputs": [
                {
                    "index": i.index,
                    "url": f"/v1/jobs/{self.id}/outputs/{i.index}",
                    "content_type": i.content_type,
                    "seed": i.seed,
                    "bytes": i.nbytes,
                    "batch": i.batch_id,
                }
                for i in self.items
                if i.done
            ],
            "error": self.error,
            "timings_ms": dict(self.timings_ms),
            "request": {
                "prompt": r.prompt,
                "n": r.n,
                "width": r.width,
                "height": r.height,
                "steps": r.steps,
                "guidance_scale": r.guidance,
                "output_format": r.output_format,
                "num_frames": r.num_frames,
                "seed": r.seed,
            },
        }
