"""Daemon configuration as data: defaults, TOML file, command-line overrides, validation.

Precedence: built-in defaults < ``--config FILE`` (TOML) < command-line flags. Every field has
the same name in all three (dashes on the command line, underscores in TOML). Validation errors
name the field and the accepted values, because a daemon that dies at start with a bare
traceback is a bad first experience.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from diffusiond.daemon.core.loras import LoraFileError, read_lora
from diffusiond.daemon.core.scheduler import batch_sizes
from diffusiond.daemon.devices import auto_device, parse_devices
from diffusiond.daemon.model_config import ModelConfig as ModelConfig  # re-exported: what --model and [[models]] make
from diffusiond.daemon.model_config import auto_budget, check_table, kept_beside, pinned_beside, resolve_offload
from diffusiond.daemon.residency.budget import ACCELERATOR_RESERVE, Budget
from diffusiond.daemon.residency.budget import NO_BUDGET as NO_BUDGET  # re-exported: tests and units name it
from diffusiond.daemon.residency.budget import resolve as resolve_budget
from diffusiond.daemon.residency.preload import check_preload
from diffusiond.daemon.residency.sizes import default_dtype
from diffusiond.daemon.residency.units import FOREVER, parse_duration, parse_size
from diffusiond.daemon.values import ConfigError as ConfigError  # re-exported: the configuration's one error
from diffusiond.daemon.values import (
    ControlNetSetting,
    check_batching,
    check_controlnet,
    check_fields,
    check_ip_adapter,
    check_mode_names,
    check_upscaler,
    duration,
    own_preload,
    parse_compile_mode,
    parse_controlnets,
    parse_host_port,
    parse_ip_adapters,
    parse_loras,
    parse_upscalers,
    preload_value,
    unknown_keys,
    whole,
)
from diffusiond.daemon.warmup import resolve_warmup, warmup_value
from diffusiond.ipc.upscale import UpscalerSetting
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import check_spec, model_name_for, model_options, parse_model_arg
from diffusiond.protocol import COMPILE_MODES, LOG_LEVELS, MODEL_DTYPES, OUTPUT_MODES, OutputMode
from diffusiond.protocol import default_socket_path as default_socket_path  # re-exported: the daemon's own home

STATE_SYNC = ("normal", "full")
PREIMPORT = ("auto", "on", "off")


def default_state_dir(env: Mapping[str, str] | None = None) -> str:
    """Where the daemon keeps what must outlive it (jobs, outputs; later caches):
    ``$XDG_STATE_HOME/diffusiond``, else ``~/.local/state/diffusiond``. The system unit's
    ``StateDirectory=`` sets ``$STATE_DIRECTORY``, which wins over both."""
    env = os.environ if env is None else env
    if env.get("STATE_DIRECTORY"):
        return env["STATE_DIRECTORY"].split(":")[0]
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "diffusiond")


def compile_cache_dir(state_dir: str) -> Path:
    """Where workers keep compiled kernels (inductor, Triton), so a restarted daemon is warm:
    ``compile-cache`` in the daemon's state dir (``--state-dir``; kept with ``--no-persist`` too,
    since it is a cache, not state)."""
    return Path(state_dir) / "compile-cache"


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int = 10_000
    max_n: int = 16
    min_size: int = 64
    max_size: int = 4096
    max_steps: int = 500
    max_frames: int = 1024
    max_body_bytes: int = 1 << 20
    max_timeout_s: float = 24 * 3600.0
    max_lora_weight: float = 4.0  # a request's LoRA weights lie in [-max, max]
    # Bytes one job may ask to produce (n x frames x width x height x 3 x dtype size): beyond it,
    # 413 at admission rather than a failure in the worker's allocator.
    max_output_bytes: int = 16 << 30
    # Edits: the bytes of one request that carries images (a multipart upload, or a JSON body with
    # base64 images), and the pixels of one decoded input image (a small file can decode huge).
    max_upload_bytes: int = 32 << 20
    max_input_pixels: int = 4096 * 4096


@dataclass(frozen=True)
class DaemonConfig:
    models: tuple[ModelConfig, ...] = (ModelConfig(name="tiny", spec="tiny"),)
    socket: str | None = None
    socket_mode: int = 0o600
    socket_group: str | None = None
    allow_uid: tuple[int, ...] = ()
    tcp: str | None = None
    token_file: str | None = None
    # The web page and the API under /v1 on TCP, behind a token (daemon/web.py): HOST:PORT.
    web: str | None = None
    max_batch: int = 4
    batch_wait_ms: float = 0.0
    # which batch sizes form (core/scheduler.py says why): auto (powers of two when compiled), pow2 or any
    batch_sizes: str = "auto"
    queue_size: int = 256
    job_timeout_s: float = 600.0
    output_mode: OutputMode = "async"
    arena_mb: int = 512
    slot_timeout_s: float = 30.0  # how long a copy waits for a free arena slot before failing
    stream_stall_s: float = 120.0  # an output download that makes no progress this long is closed
    retention_s: float = 600.0
    drain_grace_s: float = 30.0
    # a worker still computing a batch whose jobs have all ended (cancelled, past their deadline) this long is
    # killed and replaced, so its model serves again: one step of a large forward is not interrupted (0: never)
    orphan_grace_s: float = 60.0
    encode_threads: int = max(1, min(4, os.cpu_count() or 1))
    png_compress_level: int = 4
    worker_start_timeout_s: float = 900.0
    restart_backoff_s: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0)
    log_level: str = "info"
    limits: Limits = Limits()
    # Diagnostics: each worker keeps a timeline of its forwards and copies, with CUDA events on a
    # GPU, served at GET /v1/admin/trace (what `diffusiond bench --trace` reads).
    trace: bool = False
    # A diffusers AutoencoderTiny folder that decodes previews for every model (a model's own
    # ``preview_decoder`` option wins); without it, each model family's linear factors.
    preview_decoder: str | None = None
    fault: str = ""  # test-only worker fault injection; empty in normal runs
    # LoRA adapters by name (--lora NAME=PATH, TOML [loras]); each worker keeps at most max_loras
    # of them loaded (least recently used ones are unloaded), and a request names at most that many.
    loras: dict[str, str] = field(default_factory=dict)
    max_loras: int = 8
    # ControlNets by name (--controlnet NAME=PATH[,modes=A:B], TOML [controlnets]): each worker loads them all once
    controlnets: dict[str, ControlNetSetting] = field(default_factory=dict)
    # IP-Adapters by name (--ip-adapter NAME=PATH[,image_encoder=DIR], TOML [ip_adapters]): (weights, encoder)
    ip_adapters: dict[str, tuple[str, str]] = field(default_factory=dict)
    # super-resolution models by name (--upscaler NAME=PATH[,tile=N][,overlap=N], TOML [upscalers]):
    # spandrel reads them; each runs in overlapping tiles of its own (issue 30)
    upscalers: dict[str, UpscalerSetting] = field(default_factory=dict)
    # Durable jobs (store.py): the state dir holds the job database and the output files.
    state_dir: str | None = None
    persist: bool = True  # False (--no-persist): jobs and outputs live in memory only, as before
    reset_state: bool = False  # a corrupt or foreign database is moved aside instead of stopping the start
    keep_days: float = 0.0  # finished jobs older than this are deleted with their outputs (0: no age limit)
    keep_gb: float = 0.0  # the oldest finished jobs go while their outputs take more than this (0: no limit)
    retention_check_s: float = 60.0  # how often the retention task looks
    state_fault: str = ""  # test-only fault injection in the state dir (see state/faults.py)
    # "normal": an accepted job survives any crash of the daemon; "full": a power cut too (an fsync per job)
    state_sync: str = "normal"
    # Workers forked from a template that did their imports once (issue 27's cold start; workers/template.py):
    # on, off, or auto (CPU and CUDA workers: the device kinds a forked worker has run on).
    preimport: str = "auto"

    # Edits on /v1/jobs may name an input image by path only inside this folder (None: no paths).
    input_dir: str | None = None
    # Residency (daemon/residency/): how long an unused model stays on its device, the most a request
    # may ask for (math.inf: forever), and the bytes models may take on each device and off it.
    keep_alive_s: float = 300.0
    max_keep_alive_s: float = FOREVER
    # sizes as parse_size reads them: a flag's text (8GiB, 0.8) or a TOML number (an int is bytes, a float a share)
    device_memory: str | int | float | None = None  # a size or a share of the device; None: its free memory at start
    host_memory: str | int | float | None = None  # weights kept in host memory off their devices; None: no bound
    pin: tuple[str, ...] = ()
    # Which models the start loads (residency/preload.py): names, ("all",) or ("none",); None: the default
    # (those that fit, in order; none in a socket-activated daemon). The others load when a job needs them.
    preload: tuple[str, ...] | None = None
    # Free memory kept for other programs on each GPU (residency/pressure.py); None: 1 GiB.
    reserve_memory: str | int | float | None = None
    # How long a job may wait behind another model's jobs for their device before that model yields it
    # (residency/turns.py): a duration as keep_alive is written (30s, 2m); -1: no bound.
    max_model_wait: str | float = "30s"
    # Each device's budget as the start resolved it (build_config; residency/budget.py): (device, bytes, how).
    # Not a setting: a config built in code without it has the explicit --device-memory only, else no bound.
    budgets: tuple[tuple[str, int, str], ...] = ()
    device_auto: str = ""  # not a setting: what --device auto (the default) chose and why, for the start's log

    def max_batch_of(self, m: ModelConfig) -> int:
        """The most outputs one of ``m``'s forwards runs: its own ``max_batch``, else the daemon's (a small
        model batches 16 where a large one on the same card fits 1)."""
        return self.max_batch if m.max_batch is None else m.max_batch

    def batch_sizes_of(self, m: ModelConfig) -> tuple[int, ...]:
        """The sizes ``m``'s batches form in, up to its ``max_batch_of``: powers of two (and that max) for a
        compiled model unless its ``batch_sizes`` (else the daemon's) says otherwise, every size for an eager one."""
        rule = m.batch_sizes or self.batch_sizes
        return batch_sizes(self.max_batch_of(m), rule == "pow2" or (rule == "auto" and bool(m.compile)))

    def budget_of(self, device: str) -> Budget:
        """``device``'s budget: as the start resolved it, else ``--device-memory`` as given (a share read
        against the device now), else no bound (a configuration built in code, not started)."""
        for name, nbytes, source in self.budgets:
            if name == device:
                return Budget(nbytes, source)
        if self.device_memory is None:
            return Budget(NO_BUDGET, "no bound: no --device-memory")
        return resolve_budget(self.device_memory, self.reserve_memory, device)

    @property
    def reserve_memory_bytes(self) -> int:
        """What the pressure watch keeps free on each GPU: other programs come first (1 GiB by default)."""
        return ACCELERATOR_RESERVE if self.reserve_memory is None else parse_size(self.reserve_memory).resolve(None)

    @property
    def max_model_wait_s(self) -> float:
        return parse_duration(self.max_model_wait)

    @property
    def host_memory_bytes(self) -> int:
        return _bytes(self.host_memory)

    @property
    def state_path(self) -> str:
        return self.state_dir or default_state_dir()

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path(serving=True)

    def validate(self) -> DaemonConfig:
        if not self.models:
            raise ConfigError("no model configured; give --model tiny (or a folder, hub id or .safetensors file)")
        if (why := check_batching(None, self.max_batch, self.batch_sizes)) is not None:  # its own words, as a model's
            raise ConfigError(why)
        check_fields(self)  # each setting's type, before anything below compares or computes with it
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"model names must be unique, got {names}; use --model NAME=SPEC")
        for m in self.models:
            try:
                check_spec(m.spec, m.options)
            except PipelineError as exc:
                raise ConfigError(f"model {m.name!r}: {exc}") from None
            if m.dtype not in MODEL_DTYPES:
                raise ConfigError(f"model {m.name!r}: dtype {m.dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
            if not m.devices:
                raise ConfigError(f"model {m.name!r} has no device")
            if m.compile and m.compile not in COMPILE_MODES:
                raise ConfigError(f"model {m.name!r}: compile {m.compile!r} is not one of {', '.join(COMPILE_MODES)}")
            if (why := check_batching(m.name, m.max_batch, m.batch_sizes)) is not None:
                raise ConfigError(why)
            for w, h, batch in m.warmup:
                if batch > self.max_batch_of(m):
                    raise ConfigError(f"model {m.name!r}: warmup {w}x{h}:{batch} is a batch larger than its "
                                      f"max_batch {self.max_batch_of(m)}; no request would run that shape")
        if self.output_mode not in OUTPUT_MODES:
            raise ConfigError(f"output_mode {self.output_mode!r} is not one of {', '.join(OUTPUT_MODES)}")
        for name in ("queue_size", "arena_mb", "encode_threads", "max_loras"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("batch_wait_ms", "retention_s", "drain_grace_s", "orphan_grace_s", "slot_timeout_s",
                     "stream_stall_s", "keep_days", "keep_gb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("job_timeout_s", "worker_start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.restart_backoff_s or min(self.restart_backoff_s) < 0:
            raise ConfigError(f"restart_backoff_s must list one or more waits in seconds, none negative (the wait "
                              f"before each replacement of a crashed worker; the last repeats), like [0.5, 1, 5]; "
                              f"got {list(self.restart_backoff_s)}")
        if not 0 <= self.png_compress_level <= 9:
            raise ConfigError(f"png_compress_level must be 0-9, got {self.png_compress_level}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if not 0 <= self.socket_mode <= 0o777:  # a TOML socket_mode = 600 is decimal: octal 1130
            raise ConfigError(f"socket_mode {self.socket_mode} (octal {self.socket_mode:o}) is not a permission mode "
                              "(0000-0777); in the config file write it as a string, \"0600\", or as 0o600")
        if self.preview_decoder and not Path(self.preview_decoder).expanduser().is_dir():
            raise ConfigError(f"preview_decoder {self.preview_decoder!r} is not a folder; give a diffusers "
                              "AutoencoderTiny folder (with its config.json), or leave it out for built-in previews")
        if self.state_sync not in STATE_SYNC:
            raise ConfigError(f"state_sync {self.state_sync!r} is not one of {', '.join(STATE_SYNC)}")
        if self.preimport not in PREIMPORT:
            raise ConfigError(f"preimport {self.preimport!r} is not one of {', '.join(PREIMPORT)}")
        if self.retention_check_s <= 0:
            raise ConfigError(f"retention_check_s must be positive, got {self.retention_check_s}")
        if self.limits.max_upload_bytes < 1 or self.limits.max_input_pixels < 1:
            raise ConfigError("limits.max_upload_bytes and limits.max_input_pixels must be at least 1")
        if self.input_dir is not None and not Path(self.input_dir).is_dir():
            raise ConfigError(f"input_dir {self.input_dir!r} is not a folder")
        if self.tcp and not self.token_file:
            raise ConfigError("--tcp needs --token-file: a TCP listener without a bearer token is refused")
        for name, path in self.loras.items():
            try:
                read_lora(name, path)
            except LoraFileError as exc:
                raise ConfigError(str(exc)) from None
        for name, control in self.controlnets.items():
            if (why := check_controlnet(name, control.path) or check_mode_names(name, control)) is not None:
                raise ConfigError(why)
        for name, (weights, encoder) in self.ip_adapters.items():
            if (why := check_ip_adapter(name, weights, encoder)) is not None:
                raise ConfigError(why)
        for name, setting in self.upscalers.items():
            if (why := check_upscaler(name, setting.path)) is not None:
                raise ConfigError(why)
        if self.tcp is not None:
            parse_host_port(self.tcp, "--tcp")
        if self.web is not None:
            parse_host_port(self.web, "--web")
        for name in ("device_memory", "host_memory", "reserve_memory"):
            value = getattr(self, name)
            if value is not None:
                try:
                    size = parse_size(value)
                except ValueError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
                if size.share is not None and name != "device_memory":
                    raise ConfigError(f"{name} {value!r}: a share is for --device-memory only (of the device's "
                                      "total); give a size such as 20GiB")
        if self.max_keep_alive_s < 0:
            raise ConfigError(f"max_keep_alive must not be negative, got {self.max_keep_alive_s}")
        try:
            parse_duration(self.max_model_wait)  # here, so that a bad value stops the start and not a dispatch
        except ValueError:
            raise ConfigError(f"max_model_wait {self.max_model_wait!r} is not a duration: give seconds (30), a "
                              "duration such as 30s, 2m or 500ms, 0 to let another model in as soon as its job "
                              "waits, or -1 for no bound") from None
        unknown_pins = sorted(set(self.pin) - {m.name for m in self.models})
        if unknown_pins:
            raise ConfigError(f"--pin {', '.join(unknown_pins)}: no such model (models: "
                              f"{', '.join(m.name for m in self.models)})")
        try:
            check_preload(self.preload, [m.name for m in self.models])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return self


def _limits(table: Any) -> Limits:
    """The ``[limits]`` table: a name not among the limits is refused naming the ones there are."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"limits must be a table ([limits] in the config file), got {table!r}")
    unknown_keys(table, [f.name for f in fields(Limits)], "[limits] setting(s)")
    return replace(Limits(), **dict(table))


def _bytes(value: str | int | float | None) -> int:
    return NO_BUDGET if value is None else parse_size(value).resolve(None)


def start_budgets(config: DaemonConfig) -> tuple[tuple[str, int, str], ...]:
    """Every device's budget, read once at start (``residency/budget.py``), so ``offload=auto`` and residency
    count against the same bytes."""
    out = []
    for device in dict.fromkeys(d for m in config.models for d in m.devices):
        try:
            budget = resolve_budget(config.device_memory, config.reserve_memory, device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        out.append((device, budget.nbytes, budget.source))
    return tuple(out)


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text, which TOML is: {exc}") from None
    except OSError as exc:  # a directory, a file this user may not read
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc}): give --config a "
                          "readable TOML file") from None


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> DaemonConfig:
    """Merge TOML values and flag overrides into a validated config.

    Models: ``[[models]]`` tables (name, spec, device, workers, dtype, options) in the file; the
    flags ``--model``/``--device``/``--workers``/``--dtype`` replace the file's list when given.
    """
    values = {**file_values, **{k: v for k, v in overrides.items() if v is not None}}
    known = {f.name for f in fields(DaemonConfig)} - {"budgets", "device_auto"} | {
        "model", "device", "workers", "dtype", "compile", "warmup", "lora", "keep_alive", "max_keep_alive", "offload",
        "controlnet", "ip_adapter", "upscaler"}
    unknown_keys(sorted(values), sorted(known), "setting(s)")
    device = str(values.pop("device", "auto"))
    device_auto = ""
    if device == "auto":  # once: every model without a device of its own uses what it found
        gpus, why = auto_device()
        device = ",".join(f"cuda:{i}" for i in range(gpus)) or "cpu"
        device_auto = f"{device} ({why})"
    workers = whole(values.pop("workers", 1), "workers")
    given = values.pop("dtype", None)  # None: each model's by its devices (devices.default_dtype)
    dtype = str(given) if given is not None else None
    compile_mode = parse_compile_mode(values.pop("compile", ""))
    warmup = warmup_value(values.pop("warmup", ""))
    model_args = values.pop("model", None)
    offload = values.pop("offload", None)  # --offload MODE (or TOML's top-level offload): every model's
    forced = overrides.get("offload") is not None  # the flag wins over a [[models]] table's own
    tables = values.pop("models", None)
    models: list[ModelConfig] = []
    if model_args:
        for arg in model_args if isinstance(model_args, list) else [model_args]:
            name, spec = parse_model_arg(str(arg))
            devices = parse_devices(device, workers)
            models.append(ModelConfig(name=name, spec=spec, devices=devices, dtype=dtype or default_dtype(devices),
                                      compile=compile_mode, warmup=warmup))
    elif tables:
        if not isinstance(tables, list | tuple):  # models = {spec = "tiny"}: a dict would iterate its keys
            raise ConfigError(f"models must be an array of tables, got {tables!r}: write each model as its own "
                              '[[models]] table, with spec = "..." (and name, device, options ...)')
        for index, t in enumerate(tables):
            check_table(t, index)
            if "spec" not in t:
                raise ConfigError(f"[[models]] entry {t} has no spec")
            name = str(t.get("name") or model_name_for(t["spec"]))
            models.append(
                ModelConfig(
                    name=name,
                    spec=str(t["spec"]),
                    devices=(own := parse_devices(str(t.get("device", device)),
                                                  whole(t.get("workers", workers), f"model {name!r}: workers"))),
                    dtype=str(t.get("dtype", dtype or default_dtype(own))),
                    options={str(k): str(v) for k, v in dict(t.get("options", {})).items()}
                    | ({"offload": str(t["offload"])} if "offload" in t else {}),
                    compile=parse_compile_mode(t.get("compile", compile_mode)),
                    warmup=warmup_value(t["warmup"]) if "warmup" in t else warmup,
                    keep_alive_s=duration(t["keep_alive"], f"model {t.get('name', t['spec'])!r}: keep_alive")
                    if "keep_alive" in t else None,
                    pinned=bool(t.get("pin", False)),
                    preload=own_preload(t),
                    max_batch=t.get("max_batch"),  # checked in validate, with the top level's
                    batch_sizes=t.get("batch_sizes"),
                )
            )
    else:
        devices = parse_devices(device, workers)
        models.append(ModelConfig(name="tiny", spec="tiny", devices=devices, dtype=dtype or default_dtype(devices),
                                  compile=compile_mode, warmup=warmup))
    if offload is not None:
        models = [replace(m, options={**m.options, "offload": str(offload)}) if forced or "offload" not in m.options
                  else m for m in models]
    lora_args = values.pop("lora", None)  # --lora NAME=PATH flags replace the file's [loras] table
    if lora_args is not None:
        values["loras"] = parse_loras(lora_args)
    elif "loras" in values:
        values["loras"] = parse_loras(values["loras"])
    control_args = values.pop("controlnet", None)  # likewise --controlnet NAME=PATH[,modes=A:B] and [controlnets]
    if control_args is not None or "controlnets" in values:
        values["controlnets"] = parse_controlnets(control_args if control_args is not None else values["controlnets"])
    ip_args = values.pop("ip_adapter", None)  # --ip-adapter NAME=PATH[,image_encoder=DIR] and [ip_adapters]
    if ip_args is not None or "ip_adapters" in values:
        values["ip_adapters"] = parse_ip_adapters(ip_args if ip_args is not None else values["ip_adapters"])
    upscale_args = values.pop("upscaler", None)  # and --upscaler NAME=PATH[,tile=N,overlap=N] and [upscalers]
    if upscale_args is not None or "upscalers" in values:
        values["upscalers"] = parse_upscalers(upscale_args if upscale_args is not None else values["upscalers"])
    if "limits" in values:
        values["limits"] = _limits(values["limits"])
    for key in ("keep_alive", "max_keep_alive"):  # durations: 5m, 300, 0, -1 (forever)
        if key in values:
            values[f"{key}_s"] = duration(values.pop(key), key)
    if "preload" in values:  # --preload replaces every other word on it, the tables' own included
        values["preload"] = preload_value(values["preload"])
        if overrides.get("preload") is not None:
            models = [replace(m, preload=None) for m in models]
    if "pin" in values:
        values["pin"] = tuple(values["pin"]) if isinstance(values["pin"], list | tuple) else (str(values["pin"]),)
        models = [replace(m, pinned=m.pinned or m.name in values["pin"]) for m in models]
    # TOML's lists as the fields' tuples; validate's check_fields refuses any other value, saying what to write
    values.update({k: tuple(values[k]) for k in ("allow_uid", "restart_backoff_s") if isinstance(values.get(k), list)})
    if isinstance(values.get("socket_mode"), str):
        try:
            values["socket_mode"] = int(values["socket_mode"], 8)
        except ValueError:
            raise ConfigError(f"socket_mode {values['socket_mode']!r} is not an octal mode like 0600") from None
    try:
        config = DaemonConfig(models=tuple(models), device_auto=device_auto, **values).validate()
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    config = replace(config, budgets=start_budgets(config))
    # offload=auto plans against the smallest budget of the model's devices: each of its workers must fit, beside
    # what it keeps there (residency/beside.py) and any model pinned there
    models = [resolve_offload(m, auto_budget(m, config.models, lambda d: config.budget_of(d).nbytes, NO_BUDGET),
                              kept_beside(m, config.models, [c.path for c in config.controlnets.values()],
                                          list(config.ip_adapters.values()),
                                          [u.path for u in config.upscalers.values()]),
                              pinned_beside(m, config.models)) for m in config.models]
    return replace(config, models=tuple(replace(m, warmup=resolve_warmup(
        m.name, m.warmup, config.batch_sizes_of(m), m.compile, model_options(m.spec, m.options)))
        for m in models))
