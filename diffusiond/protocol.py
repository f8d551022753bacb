"""The vocabulary that every side of diffusiond shares: client, CLI, engine and worker.

Each closed set the HTTP API speaks (output formats with their content types and file
extensions, output dtypes, scheduler names, job statuses and stages, SSE event names, error
codes, log levels), and where the socket is looked for, is written down here once. The module
imports nothing but the standard library, so the client and the CLI can use it without loading
torch, and the daemon's request checks can use it without loading the encoders (Pillow, PyAV).
"""

from __future__ import annotations

import enum
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal, get_args

# the socket -------------------------------------------------------------------------------------

SOCKET_ENV: Final = "DIFFUSIOND_SOCKET"
SOCKET_NAME: Final = "diffusiond.sock"
DEFAULT_WEB_ADDRESS: Final = "127.0.0.1:7860"
"""Where ``serve --web`` listens when no HOST:PORT is given (the port Gradio UIs use)."""


def default_socket_path(env: Mapping[str, str] | None = None, *, serving: bool = False) -> str:
    """The socket path when none is given, in the order docs/api.md fixes.

    Here, not in the daemon's config, because client and daemon must agree on it and the
    client must not load the daemon to find out. ``$RUNTIME_DIRECTORY`` is the daemon's alone
    (``serving``): systemd sets it for any unit with ``RuntimeDirectory=``, so a client run inside
    another service (a trainer's) looked for the daemon in that service's folder.
    """
    env = os.environ if env is None else env
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV]
    if serving and env.get("RUNTIME_DIRECTORY"):  # set by systemd's RuntimeDirectory=
        return str(Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME)
    if env.get("XDG_RUNTIME_DIR"):
        return str(Path(env["XDG_RUNTIME_DIR"]) / "diffusiond" / SOCKET_NAME)
    return f"/tmp/diffusiond-{os.getuid()}/{SOCKET_NAME}"


def output_socket_path(socket_path: str) -> str:
    """Where a daemon listening on ``socket_path`` hands outputs out by fd (``daemon/handoff.py``):
    beside it, so a client that knows one knows the other."""
    return socket_path + ".out"


# outputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputFormat:
    """One output format: how its bytes are served and named, and what it can hold."""

    name: str
    content_type: str
    extension: str
    image: bool  # takes an image (H, W, 3), and a one-frame video as its image
    video: bool  # takes a video (F, H, W, 3)
    max_side: int = 1 << 31  # the largest side it encodes (png's and mp4's are beyond any output)


FORMATS: Final[Mapping[str, OutputFormat]] = MappingProxyType({
    f.name: f
    for f in (
        OutputFormat("png", "image/png", "png", image=True, video=False),
        # its header holds 65535, but libjpeg refuses past 65500 ("broken data stream" from Pillow)
        OutputFormat("jpeg", "image/jpeg", "jpg", image=True, video=False, max_side=65500),
        OutputFormat("webp", "image/webp", "webp", image=True, video=True, max_side=16383),  # animated for videos
        OutputFormat("gif", "image/gif", "gif", image=False, video=True, max_side=65535),
        OutputFormat("mp4", "video/mp4", "mp4", image=False, video=True),
        OutputFormat("npy", "application/x-npy", "npy", image=True, video=True),  # raw, not encoded
    )
})
"""Every output format, by the name a request uses."""

IMAGE_FORMATS: Final[frozenset[str]] = frozenset(f.name for f in FORMATS.values() if f.image)
VIDEO_FORMATS: Final[frozenset[str]] = frozenset(f.name for f in FORMATS.values() if f.video)
FORMAT_OF_CONTENT_TYPE: Final[Mapping[str, str]] = MappingProxyType(
    {f.content_type: f.name for f in FORMATS.values()})
FORMAT_OF_SUFFIX: Final[Mapping[str, str]] = MappingProxyType(
    {f".{f.extension}": f.name for f in FORMATS.values()} | {".jpeg": "jpeg"})
"""File suffix (lower case, with the dot) -> format; ``.jpeg`` is read as well as ``.jpg``."""

OutputDtype = Literal["uint8", "float16", "float32"]
OUTPUT_DTYPES: Final[tuple[OutputDtype, ...]] = get_args(OutputDtype)
"""What a worker hands out: uint8 NHWC (converted on the device), or raw floats for ``npy``."""

ModelDtype = Literal["float32", "float16", "bfloat16"]
MODEL_DTYPES: Final[tuple[ModelDtype, ...]] = get_args(ModelDtype)
"""The dtypes a model can be loaded in (``serve --dtype``)."""

OutputMode = Literal["async", "sync"]
OUTPUT_MODES: Final[tuple[OutputMode, ...]] = get_args(OutputMode)
"""``async``: the copy thread overlaps the next forward; ``sync``: the baseline that does not."""

PREVIEW_FORMATS: Final[tuple[str, ...]] = ("jpeg", "webp", "png")
"""What a preview may be encoded as: jpeg and webp for pages, png for terminals (kitty shows only PNG)."""

# schedulers -------------------------------------------------------------------------------------

SCHEDULERS: Final[tuple[str, ...]] = ("euler", "euler-a", "dpm++", "ddim", "unipc", "flow-match", "flow-sde")
"""The scheduler short names a request may use; the pipelines map each to a diffusers class."""

FLOW_SCHEDULERS: Final[frozenset[str]] = frozenset({"flow-match", "flow-sde"})
"""The ones for flow-matching models (SD3, Flux, Wan); the rest are for noise-prediction models."""

NOISE_LEVEL_MAX: Final = 2.0
"""The largest ``noise_level`` of ``flow-sde`` (Flow-GRPO uses 0.7; far above 1 the SDE's noise swamps the
signal and its first step's std grows without bound, so larger values are a typo, not a setting)."""
ETA_MAX: Final = 1.0
"""The largest ``eta`` of ``ddim``: 1 is DDPM's variance; DDIM's direction term is undefined above it."""


TrajectoryDtype = Literal["float32", "bfloat16", "float16"]
TRAJECTORY_DTYPES: Final[tuple[TrajectoryDtype, ...]] = get_args(TrajectoryDtype)
"""What a trajectory's latents may be stored as (``trajectory.dtype``); its small arrays are float32."""
TRAJECTORY_ARRAYS: Final[tuple[str, ...]] = ("latents", "log_probs", "timesteps", "sigmas")
"""The arrays a trajectory may carry (issue 29), in the order they lie in its shared memory: the
latents before and after every step, each step's log-probability, timestep and sigma."""
AUDIO_ARRAY: Final = "audio"
"""The sound track's array beside an output (issue 30): float32 ``(channels, samples)`` in [-1, 1]."""
SIDE_ARRAYS: Final[tuple[str, ...]] = (*TRAJECTORY_ARRAYS, AUDIO_ARRAY)
"""Every array that may lie in an output's side region (``ipc/sidearrays.py``), in that order."""


def schedulers_for(flow: bool) -> tuple[str, ...]:
    """The scheduler names that fit a flow-matching (``flow``) or a noise-prediction model."""
    return tuple(s for s in SCHEDULERS if (s in FLOW_SCHEDULERS) == flow)


# video ------------------------------------------------------------------------------------------


def frame_count_neighbours(frames: int, step: int) -> tuple[int, int] | None:
    """None if ``frames`` has the form ``step*k + 1`` (LTX makes 8k+1 frames, Wan 4k+1); else
    the nearest valid counts below and above it, to put in the error message."""
    if step <= 1 or (frames - 1) % step == 0:
        return None
    lower = (frames - 1) // step * step + 1
    return lower, lower + step


def too_few_steps(field: str, steps: int, model: str, low: int) -> str:
    """Why ``steps`` below a model's ``min_steps`` is refused, in one wording for admission and the worker (which
    checks again: admission may judge by capabilities remembered from an older run)."""
    return (f"{field}={steps}: model {model!r} takes at least {low} steps (its scheduler stretches the last step to "
            f"its shift_terminal, which one step cannot: the output would be NaN); send {field} >= {low}")


# compilation ------------------------------------------------------------------------------------

COMPILE_MODES: Final[tuple[str, ...]] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``--compile`` values: torch.compile's modes. ``reduce-overhead`` and ``max-autotune`` replay
CUDA graphs for shapes that repeat; the others launch kernels one by one."""

BATCH_SIZES: Final[tuple[str, ...]] = ("auto", "pow2", "any")
"""``--batch-sizes``: powers of two for compiled models and any size for eager ones (auto), or one rule for
every model (daemon/core/scheduler.py says why)."""


# jobs -------------------------------------------------------------------------------------------


# The bearer-token rule of every listener reached over a network: the daemon's ``--tcp``
# (``daemon/edge/access.py``) and the Ray Serve gateway (``ray/gateway.py``) keep it here, once.
MIN_TOKEN_CHARS: Final = 16
BEARER_NEEDED: Final = "this listener needs 'Authorization: Bearer <token>'"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None for another scheme, or none). The scheme
    is read in any case, as HTTP defines it (RFC 9110 11.1: clients and proxies that send ``bearer`` were
    refused), and spaces around the token are not part of it. The one rule of the daemon's listeners and the
    Ray gateway."""
    scheme, _, rest = (authorization or "").strip().partition(" ")
    given = rest.strip()
    return given if scheme.lower() == "bearer" and given else None


def same_token(given: str | None, token: str) -> bool:
    """Constant-time, on bytes (``hmac.compare_digest`` refuses non-ASCII str). A header's bytes that are not
    UTF-8 arrive as lone surrogates (aiohttp decodes with surrogateescape), which ``str.encode`` refuses: they
    are encoded back to the bytes that were sent, so such a value is simply not the token."""
    return given is not None and hmac.compare_digest(given.encode(errors="surrogateescape"), token.encode())


def bearer_authorized(authorization: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>`` names ``token``."""
    return same_token(bearer_token(authorization), token)


class JobStatus(enum.StrEnum):
    """A job's status moves forward only: queued -> running -> one of the terminal three."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES: Final[frozenset[JobStatus]] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class Stage(enum.IntEnum):
    """Where a job's work is. Ordered: a job is in the least advanced stage of its outputs."""

    QUEUED = 0
    COMPILING = 1  # the worker compiles the model for a shape it has not run yet (``--compile``)
    COMPUTING = 2
    COPYING = 3
    ENCODING = 4
    DONE = 5

    @property
    def label(self) -> str:
        return self.name.lower()


class Event(enum.StrEnum):
    """Server-Sent Event names on ``/v1/jobs/{id}/events``."""

    STATUS = "status"
    PROGRESS = "progress"
    DONE = "done"  # the job succeeded; the stream ends
    ERROR = "error"  # the job failed or was cancelled; the stream ends
    PREVIEW = "preview"  # a cheap picture of one output while it denoises (requests with "preview")


TERMINAL_EVENTS: Final[frozenset[Event]] = frozenset({Event.DONE, Event.ERROR})
"""Events after which a job's stream has nothing more to say."""


class ErrorCode(enum.StrEnum):
    """The ``error.code`` of every error body, and of a failed job's ``error``."""

    # the request
    INVALID_REQUEST = "invalid_request"
    INVALID_JSON = "invalid_json"
    REQUEST_TOO_LARGE = "request_too_large"
    OUTPUT_TOO_LARGE = "output_too_large"
    INVALID_IMAGE = "invalid_image"  # an edit's input image or mask cannot be used (field says which)
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    WRONG_HOST = "wrong_host"  # the web listener: a Host header that does not name it (DNS rebinding)
    CROSS_ORIGIN = "cross_origin"  # the web listener: a request sent by another site's page
    WEB_OFF = "web_off"  # `diffusiond web-url` asked a daemon started without --web
    INTERNAL_ERROR = "internal_error"  # 500: a bug in the daemon; the message's id is in its log, with the traceback
    # the daemon's state
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_TOO_LARGE = "model_too_large"  # it cannot fit the device budget even alone (residency)
    LORA_NOT_FOUND = "lora_not_found"
    LORA_EXISTS = "lora_exists"
    # 409: a live update reached some workers of a model and not others, which now run different weights: send
    # it again
    UPDATE_SPLIT = "update_split"
    JOB_NOT_FOUND = "job_not_found"
    JOB_FINISHED = "job_finished"
    OUTPUT_NOT_FOUND = "output_not_found"
    OUTPUT_NOT_READY = "output_not_ready"
    OUTPUT_RELEASED = "output_released"
    QUEUE_FULL = "queue_full"
    UNAVAILABLE = "unavailable"
    NO_WORKER = "no_worker"
    WORKER_UNAVAILABLE = "worker_unavailable"
    SLEEP_FAILED = "sleep_failed"
    WAKE_FAILED = "wake_failed"
    TRACE_OFF = "trace_off"
    PREVIEW_NOT_FOUND = "preview_not_found"  # no preview of that output yet (or the job asked for none)
    NOT_SHARED = "not_shared"  # the output socket cannot hand this output out by fd: fetch it over HTTP
    INSUFFICIENT_STORAGE = "insufficient_storage"  # the state dir's disk is full (507)
    STATE_FAILED = "state_failed"  # the state database could not be written (not a full disk)
    INPUT_LOST = "input_lost"  # an edit interrupted by a crash: its input image was not kept to run it again
    # how a job ended, other than by succeeding
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    SHUTTING_DOWN = "shutting_down"
    WORKER_LOST = "worker_lost"
    GENERATION_FAILED = "generation_failed"
    OUT_OF_MEMORY = "out_of_memory"  # the forward ran out of memory, also when retried (in halves); the daemon goes on
    MODEL_LOAD_FAILED = "model_load_failed"  # its model could not be loaded (corrupt files): the worker's reason
    OUTPUT_FAILED = "output_failed"
    # diffusiond on Ray Serve (diffusiond.ray): the replica that holds a job
    REPLICA_GONE = "replica_gone"  # 410: the replica that held the job no longer exists
    REPLICA_UNAVAILABLE = "replica_unavailable"  # 503: the replica's daemon died or does not answer


# service ----------------------------------------------------------------------------------------

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: Final[tuple[LogLevel, ...]] = get_args(LogLevel)


class WorkerState(enum.StrEnum):
    """A worker as ``/health`` shows it."""

    STARTING = "starting"
    READY = "ready"
    SLEEPING = "sleeping"
    STOPPING = "stopping"
    DEAD = "dead"


class ModelState(enum.StrEnum):
    """A model as ``/v1/models`` shows it: the best state among its workers, else why it has none (docs/api.md)."""

    READY = "ready"
    SLEEPING = "sleeping"
    STARTING = "starting"
    # no worker because it is not loaded (on disk, or waiting its turn in the start's preload): its next job
    # loads it. Apart from ``unavailable``, which a user read as "cannot serve" for every idle model
    UNLOADED = "unloaded"
    UNAVAILABLE = "unavailable"  # its last load failed, or its workers died and are not back (yet)


class Task(enum.StrEnum):
    """What a model makes from a prompt."""

    TEXT_TO_IMAGE = "text-to-image"
    TEXT_TO_VIDEO = "text-to-video"
    # edits: made from an input image (and, for inpainting, a mask of the area to repaint)
    IMAGE_TO_IMAGE = "image-to-image"
    INPAINTING = "inpainting"
    # the image is the first frame (or the reference) of a video the prompt describes
    IMAGE_TO_VIDEO = "image-to-video"
    # the prompt says what to change in the image (FLUX Kontext, Qwen-Image-Edit): no mask, no strength
    INSTRUCTION_EDIT = "instruction-edit"


EDIT_TASKS: Final[frozenset[Task]] = frozenset(
    {Task.IMAGE_TO_IMAGE, Task.INPAINTING, Task.IMAGE_TO_VIDEO, Task.INSTRUCTION_EDIT})
"""The tasks a request asks for by sending an image (``/v1/images/edits``, ``image`` on ``/v1/jobs``)."""
VIDEO_TASKS: Final[frozenset[Task]] = frozenset({Task.TEXT_TO_VIDEO, Task.IMAGE_TO_VIDEO})
"""The tasks whose outputs are videos: frame counts apply, and outputs encode as video formats."""
STRENGTH_TASKS: Final[frozenset[Task]] = frozenset({Task.IMAGE_TO_IMAGE, Task.INPAINTING})
"""The edits that take a ``strength`` (how much of the image is repainted)."""
