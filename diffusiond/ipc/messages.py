"""The worker protocol: one msgspec struct per frame kind.

Engine -> worker: INIT, EXECUTE (edits' input memfds attached), CANCEL, RELEASE, SLEEP, WAKE, SHUTDOWN,
TRACE, PING, ADD_LORA, UPDATE_LORA and UPDATE_WEIGHTS (the weights' memfd attached).
Worker -> engine: HELLO (arena fd attached), LOAD_PROGRESS, PARAM_TABLE (``params``), READY, COMPUTE_DONE,
PROGRESS, OUTPUT_READY (a dedicated memfd may be attached), REQUEST_ENDED, ACK, FATAL, SLOT_WAIT, PREVIEW_READY.
Local client <-> engine, on the output socket: FETCH and UNPIN in, LEASE (fd attached) and REFUSED out;
UPDATE_LORA and UPDATE_WEIGHTS in (the weights' memfd attached), UPDATED or UPDATE_REFUSED out.

Bodies carry descriptors and parameters, never bulk data: outputs live in the shared arena and
frames only point at them. Structs are msgpack-encoded by ``frames``; nothing is pickled.
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

from diffusiond.ipc.input_refs import InputRef

# re-exported: every frame kind is named here
from diffusiond.ipc.outsocket import Fetch as Fetch
from diffusiond.ipc.outsocket import Lease as Lease
from diffusiond.ipc.outsocket import Refused as Refused
from diffusiond.ipc.outsocket import Unpin as Unpin
from diffusiond.ipc.params import ParamTableFrame as ParamTableFrame
from diffusiond.ipc.sidearrays import TrajectoryDesc, TrajectorySpec
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.ipc.updates import LIVE_PATH as LIVE_PATH
from diffusiond.ipc.updates import Updated as Updated
from diffusiond.ipc.updates import UpdateLora as UpdateLora
from diffusiond.ipc.updates import UpdateRefused as UpdateRefused
from diffusiond.ipc.updates import UpdateWeights as UpdateWeights
from diffusiond.ipc.updates import WeightTensor as WeightTensor
from diffusiond.ipc.upscale import HiresSpec, UpscalerSetting, UpscaleSpec
from diffusiond.protocol import OutputDtype, OutputMode


class Kind(enum.IntEnum):
    # engine -> worker
    INIT = 1
    EXECUTE = 2
    CANCEL = 3
    RELEASE = 4
    SLEEP = 5
    WAKE = 6
    SHUTDOWN = 7
    TRACE = 8
    PING = 9
    ADD_LORA = 10
    UPDATE_LORA = 11
    UPDATE_WEIGHTS = 12
    # worker -> engine
    HELLO = 32
    READY = 33
    COMPUTE_DONE = 34
    PROGRESS = 35
    OUTPUT_READY = 36
    REQUEST_ENDED = 37
    ACK = 38
    FATAL = 39
    SLOT_WAIT = 40
    PREVIEW_READY = 41
    LOAD_PROGRESS = 42
    PARAM_TABLE = 43
    # local client -> engine, on the output socket
    FETCH = 64  # (UPDATE_LORA travels on the output socket too, client -> engine)
    UNPIN = 65
    # engine -> local client, on the output socket
    LEASE = 96
    REFUSED = 97
    UPDATED = 98
    UPDATE_REFUSED = 99


class WarmupShape(msgspec.Struct, frozen=True):
    """A shape run once before READY (``--warmup 512x512:8``): compiling it is paid at start, not by a client."""

    width: int
    height: int
    batch: int = 1


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker needs to start; sent in INIT so no argument parsing or pickling."""

    worker_id: int
    model_name: str
    model_spec: str
    device: str = "cpu"
    dtype: str = "float32"
    output_mode: OutputMode = "async"
    arena_bytes: int = 256 << 20
    slot_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    progress_interval_s: float = 0.1
    options: dict[str, str] = {}
    # torch.compile mode (protocol.COMPILE_MODES), "" for the eager model; the shapes to run
    # before READY; where inductor keeps what it compiled, so a restart is warm.
    compile: str = ""
    warmup: list[WarmupShape] = []
    compile_cache_dir: str = ""
    trace_gpu: bool = False  # CUDA events around forwards and copies (GPU-side ordering proofs; small overhead)
    fault: str = ""  # test-only fault injection ("" in normal runs): e.g. "drop_frame:OUTPUT_READY"
    # LoRA adapters the worker may be asked for (name -> file or folder), checked against the model
    # at start-up; and how many it keeps loaded at once (least recently used ones are unloaded).
    loras: dict[str, str] = {}
    max_loras: int = 8
    # A compiled model's LoRA hot-swap slots are this rank: the largest rank of the adapters
    # registered at start (0: none, so a compiled model takes no LoRA).
    lora_target_rank: int = 0
    # ControlNets and upscalers by name (name -> folder or file), loaded once at start and kept
    controlnets: dict[str, str] = {}
    ip_adapters: dict[str, tuple[str, str]] = {}  # IP-Adapters: name -> (weights file, image encoder folder)
    upscalers: dict[str, UpscalerSetting] = {}  # name -> file, tile side and overlap


class ControlRef(msgspec.Struct, frozen=True, array_like=True):
    """One ControlNet of a batch: its conditioning scale, the fraction of the steps it acts in, and a
    digest of its (preprocessed) control image. Part of the batch key, so requests with different
    controls, images included, never share a forward."""

    name: str
    scale: float
    start: float
    end: float
    digest: str
    mode: int | None = None  # a union ControlNet's control mode (its index); None: a single-mode one


class IpAdapterRef(msgspec.Struct, frozen=True, array_like=True):
    """An IP-Adapter of a batch, its scale and its reference image's digest (in the batch key, as ControlRef)."""

    name: str
    scale: float
    digest: str


class LoraRef(msgspec.Struct, frozen=True, array_like=True):
    """One adapter of a batch and its weight. Part of the batch key: requests batch together only
    with the same adapters at the same weights."""

    name: str
    weight: float


class BatchParams(msgspec.Struct, frozen=True, kw_only=True):
    """Parameters shared by every request of a batch. Frozen and hashable: it is the batch key."""

    width: int
    height: int
    steps: int
    guidance: float
    num_frames: int | None = None
    fps: int | None = None  # a video's frame rate; a model that conditions on it (LTX-2's frame_rate) gets it
    scheduler: str | None = None
    # the stochastic samplers' noise (issue 29): flow-sde's noise_level, ddim's eta; None: their defaults
    noise_level: float | None = None
    eta: float | None = None
    output_dtype: OutputDtype = "uint8"
    loras: tuple[LoraRef, ...] = ()  # sorted by name; weight-0 adapters left out (they change nothing)
    # edits (image-to-image, inpainting): requests differing here never share a batch
    edit: str | None = None  # protocol.Task of an edit; None: from the prompt alone
    strength: float | None = None
    controls: tuple[ControlRef, ...] = ()  # in the request's order; their images ride in InputRef.controls
    ip_adapters: tuple[IpAdapterRef, ...] = ()  # their reference images ride in InputRef.references
    # In the key because it changes what the batch computes (latents kept on the device each step).
    trajectory: TrajectorySpec | None = None
    hires: HiresSpec | None = None  # a second pass at a larger size, then an upscaler (ipc/upscale.py)
    upscale: UpscaleSpec | None = None


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One output to produce: the unit of batching, cancellation and delivery."""

    request_id: str
    prompt: str
    seed: int
    negative_prompt: str | None = None
    # Previews (per request, not in the batch key: they never change the output, so a request
    # that wants them still batches with one that does not). 0 = none.
    preview_every: int = 0
    preview_max_side: int = 0
    input: InputRef | None = None  # edits only
    audio: bool = False  # bring its sound track back (issue 30); decoded only in a batch where one asks


class Init(msgspec.Struct, frozen=True):
    config: WorkerConfig


class Execute(msgspec.Struct, frozen=True):
    batch_id: int
    params: BatchParams
    requests: list[RequestSpec]


class Cancel(msgspec.Struct, frozen=True):
    request_ids: list[str]


class Release(msgspec.Struct, frozen=True):
    slot_ids: list[int]
    host_copy: bool = False  # and the host copy of its weights it keeps (hostcopy.py; issue 27): answered by ACK
    ack_id: int = 0  # see Ack.ack_id


# A command answered by ACK carries ``ack_id``, which its ACK echoes; the engine numbers them (0: none waits).


class Sleep(msgspec.Struct, frozen=True):
    ack_id: int = 0


class Wake(msgspec.Struct, frozen=True):
    ack_id: int = 0


class Shutdown(msgspec.Struct, frozen=True):
    ack_id: int = 0


class Trace(msgspec.Struct, frozen=True):
    """Ask the worker for its recorded event trace (diagnostics and ordering proofs in tests)."""

    ack_id: int = 0


class AddLora(msgspec.Struct, frozen=True):
    """Register an adapter at run time (``POST /v1/loras``): the worker loads it to check that it fits
    the model and answers ACK, ok or with the reason. Runs between batches, on the compute thread."""

    name: str
    path: str
    ack_id: int = 0


class Ping(msgspec.Struct, frozen=True):
    """Heartbeat. The answer proves the worker's loop is alive, and, being the next frame on the
    channel, exposes a lost frame at once instead of when the next real frame happens to come."""


class Hello(msgspec.Struct, frozen=True):
    """First frame of a worker; the arena's memfd travels with it (SCM_RIGHTS)."""

    worker_id: int
    pid: int
    arena_bytes: int


class LoadProgress(msgspec.Struct, frozen=True):
    """Between HELLO and READY, after each component of the model is read: the weight bytes loaded so
    far (parameters and buffers), so a job waiting in the stage ``loading`` shows how far its load is.
    One frame per component, not per tensor; the figure only grows within a worker's load."""

    bytes_loaded: int


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a loaded model makes, what it suggests for fields a request leaves out, and which
    request values fit it. The pipeline declares it; admission checks requests against it, so a
    value that cannot run is a 400 naming the field, not a job failing in the worker."""

    task: str = "text-to-image"  # protocol.Task
    width: int = 512
    height: int = 512
    steps: int = 25
    guidance: float = 7.5
    num_frames: int = 9  # video models only
    fps: int = 16  # video models only
    sample_rate: int = 0  # its sound track's (LTX-2's vocoder's, issue 30); 0: it makes none
    fps_conditions: bool = False  # its pipeline is conditioned on fps (LTX-2's frame_rate): fps is in the batch key
    num_frames_step: int = 1  # frame counts must be step*k + 1 (Wan 4, LTX 8)
    # width and height must be multiples of this: the VAE's spatial factor times the denoiser's
    # patch (SD 8, SD3 and Wan 16, LTX 32); other sizes fail inside the pipeline, or are rounded
    size_step: int = 8
    # width and height must be at least this (a multiple of size_step): one step, or more where its VAE's
    # decoder needs more latent pixels a side than one (LTX-2 64, issue 30); admission refuses smaller sides
    min_size: int = 8
    # fewest steps it takes: 2 where its scheduler stretches the last sigma to ``shift_terminal`` (Qwen-Image,
    # Qwen-Image-Edit, LTX-Video, LTX-2), which divides by zero over a one-step schedule and makes every pixel NaN
    min_steps: int = 1
    flow_scheduler: bool | None = None  # True/False: which scheduler names fit; None: it takes none
    synthetic_weights: bool = False  # random weights (benchmark presets): outputs are noise
    previews: bool = False  # can show the picture while it denoises (requests may ask for "preview")
    # a negative prompt acts on it: False where diffusers' pipeline takes none, or reads it only at a true CFG scale
    # the daemon does not drive (FLUX is guidance-distilled); admission refuses one rather than drop it silently
    negative_prompt: bool = True
    edits: tuple[str, ...] = ()  # the edit tasks (protocol.EDIT_TASKS) it can also do from an input image
    max_input_images: int = 1  # input pictures one edit takes (a request's ``images``: Qwen-Image-Edit Plus's)
    # Opt-in approximate speed-ups in force (``cache=fbc:0.1``, ``fp8=1``): every output names them.
    approximations: tuple[str, ...] = ()
    compiled: str = ""  # the torch.compile mode, "" when eager
    # The denoiser's attention backend (model option ``attention=``), "" on the default path: exact kernels
    # differ from it by float rounding only, as compiled outputs do, and are named like ``compiled``.
    attention: str = ""
    offload: str = "none"  # what stays on the device: none, model, group or sequential (pipelines/offload.py)
    # Its modules' parameters and buffers as loaded: what residency counts it at on its device (the
    # worker fills it in at READY; remembered in the state dir with the rest, so a model that ran
    # before is placed within the budget without loading it first).
    weight_bytes: int = 0
    # What an offloaded model keeps in host memory while on its device (pinned for group and stream), which
    # residency counts against --host-memory beside weight_bytes; 0 for a resident model.
    host_bytes: int = 0


class Ready(msgspec.Struct, frozen=True):
    model_name: str
    device: str
    load_ms: float
    capabilities: Capabilities
    lora_errors: dict[str, str] = {}  # WorkerConfig.loras that do not fit the model: name -> why
    controlnet_errors: dict[str, str] = {}  # WorkerConfig.controlnets that do not fit the model: name -> why
    ip_adapter_errors: dict[str, str] = {}  # likewise WorkerConfig.ip_adapters


class ComputeDone(msgspec.Struct, frozen=True):
    batch_id: int
    compute_ms: float
    # The forward's peak working memory above what was there before it (worker/memory.py says how it is
    # measured on each device), for ``working_batch`` requests: residency plans the shape with it and
    # remembers it in the state dir. None: not measured (a retry after running out of memory, a batch
    # that compiled, a device or system without a cheap honest figure).
    working_bytes: int | None = None
    working_batch: int = 0
    lora_versions: dict[str, int] = {}  # each adapter's version the batch ran with (0: from its file)
    weight_versions: dict[str, int] = {}  # each component's that UPDATE_WEIGHTS changed in this worker


class Progress(msgspec.Struct, frozen=True):
    batch_id: int
    step: int
    total: int
    # The batch's shape is new to a compiled model: the worker is compiling it (stage ``compiling``).
    compiling: bool = False
    # The forward ran out of memory and runs again (in halves, for a batch): the engine may send idle
    # models on this device away meanwhile (residency's on_oom).
    oom_retry: bool = False


class OutputReady(msgspec.Struct, frozen=True):
    """One request's output is in shared memory. ``tensor`` says where; a dedicated fd may follow,
    then one for a dedicated trajectory region (in that order)."""

    request_id: str
    batch_id: int
    tensor: TensorDesc
    trajectory: TrajectoryDesc | None = None


EndStatus = Literal["failed", "cancelled"]


class RequestEnded(msgspec.Struct, frozen=True):
    """A request ended without an output: failed (with the reason) or cancelled."""

    request_id: str
    batch_id: int
    status: EndStatus
    message: str
    stage: str
    code: str = ""  # a protocol.ErrorCode for the job's error (out_of_memory); empty: generation_failed


class TraceEvent(msgspec.Struct, frozen=True, array_like=True):
    name: str
    batch_id: int
    t_ns: int


class Ack(msgspec.Struct, frozen=True):
    """Answer to SLEEP, WAKE, SHUTDOWN, TRACE, PING, ADD_LORA, UPDATE_LORA, UPDATE_WEIGHTS and a RELEASE
    with ``host_copy``."""

    command: int
    ok: bool
    message: str = ""
    trace: list[TraceEvent] = []
    # with trace_gpu: the same kind of events, timed by the GPU (ns since the first one)
    gpu_trace: list[TraceEvent] = []
    # the worker's own view of its shared memory, for metrics and leak checks
    arena_in_use: int = 0
    arena_high_water: int = 0
    slots_in_use: int = 0
    dedicated_bytes: int = 0
    loras_loaded: list[str] = []  # adapters loaded in the worker now (PING answers), for GET /v1/loras
    host_kept: int = 0  # SLEEP, WAKE: bytes of page-locked host copy of its weights it keeps now (issue 27)
    # the command's ``ack_id``: what it answers. Matched by kind alone, the late answer to a command that timed
    # out (an update waits for the batch in progress) answered the next command of its kind.
    # 0: the heartbeat's PING, which nothing waits for.
    ack_id: int = 0
    # UPDATE_LORA, UPDATE_WEIGHTS: not ok because the copy failed once writing began (``HalfApplied``), not a
    # refusal: the worker exits and its replacement starts over from the files and the accepted updates, so the
    # engine keeps the update and says "send it again" rather than "refused"
    restarts: bool = False


class Fatal(msgspec.Struct, frozen=True):
    """The worker is about to exit because of an unrecoverable error."""

    message: str
    # it exits between two batches (a live update failed half-way): none of the batches it has not delivered
    # started, or what of them ran is not delivered, so they can run again from the start elsewhere
    between_batches: bool = False


class SlotWait(msgspec.Struct, frozen=True):
    """The copy thread is waiting for ``nbytes`` of arena: the engine should give slots back
    (it spills outputs nobody has fetched). Back-pressure made visible, not a failure. ``in_use`` is the
    arena this request cannot use (all but its largest free range), so ``nbytes - (capacity - in_use)`` is the
    room still missing even when the free bytes are in pieces."""

    request_id: str
    nbytes: int
    in_use: int
    capacity: int


class PreviewReady(msgspec.Struct, frozen=True):
    """A small uint8 (H, W, 3) picture of one request after ``step`` of ``total`` steps, in an
    arena slot the engine gives back (RELEASE) as soon as it has encoded it. Previews are best
    effort: the worker sends none when its few preview slots are taken."""

    request_id: str
    batch_id: int
    step: int
    total: int
    tensor: TensorDesc


KIND_OF: dict[type[msgspec.Struct], Kind] = {
    Init: Kind.INIT,
    Execute: Kind.EXECUTE,
    Cancel: Kind.CANCEL,
    Release: Kind.RELEASE,
    Sleep: Kind.SLEEP,
    Wake: Kind.WAKE,
    Shutdown: Kind.SHUTDOWN,
    Trace: Kind.TRACE,
    Ping: Kind.PING,
    AddLora: Kind.ADD_LORA,
    UpdateLora: Kind.UPDATE_LORA,
    UpdateWeights: Kind.UPDATE_WEIGHTS,
    Hello: Kind.HELLO,
    Ready: Kind.READY,
    ComputeDone: Kind.COMPUTE_DONE,
    Progress: Kind.PROGRESS,
    OutputReady: Kind.OUTPUT_READY,
    RequestEnded: Kind.REQUEST_ENDED,
    Ack: Kind.ACK,
    Fatal: Kind.FATAL,
    SlotWait: Kind.SLOT_WAIT,
    PreviewReady: Kind.PREVIEW_READY,
    LoadProgress: Kind.LOAD_PROGRESS,
    ParamTableFrame: Kind.PARAM_TABLE,
    Fetch: Kind.FETCH,
    Unpin: Kind.UNPIN,
    Lease: Kind.LEASE,
    Refused: Kind.REFUSED,
    Updated: Kind.UPDATED,
    UpdateRefused: Kind.UPDATE_REFUSED,
}
TYPE_OF: dict[Kind, type[msgspec.Struct]] = {kind: cls for cls, kind in KIND_OF.items()}
