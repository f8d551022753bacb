"""One model's configuration (``--model`` or a ``[[models]]`` table), and its ``offload`` made concrete at
start: ``auto`` chosen from the files' headers and the device budget (residency/fit.py), ``stream`` given its
``resident_blocks``, the other modes checked against the rest of the model's configuration. Apart from
config.py, which assembles the daemon's configuration around the models and re-exports ``ModelConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from diffusiond.daemon.residency.auto_skips import AUTO_STREAM_RESIDENT, STREAM_MEASURED, too_few_resident
from diffusiond.daemon.residency.beside import NOTHING_BESIDE, Beside, beside
from diffusiond.daemon.residency.fit import (
    choose_auto,
    device_weights,
    model_tensors,
    pipeline_class,
    plan_stream,
    stream_inputs,
)
from diffusiond.daemon.residency.sizes import DEFAULT_DTYPE, WeightsError
from diffusiond.daemon.residency.units import format_bytes
from diffusiond.daemon.values import ConfigError, unknown_keys
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import model_options, offload_mode, parse_spec
from diffusiond.pipelines.stream_plan import StreamPlan


@dataclass(frozen=True)
class ModelConfig:
    name: str
    spec: str
    devices: tuple[str, ...] = ("cpu",)  # one worker per entry
    dtype: str = DEFAULT_DTYPE
    options: dict[str, str] = field(default_factory=dict)
    compile: str = ""  # a torch.compile mode (protocol.COMPILE_MODES), "" for eager
    # (width, height, batch) run before the worker is ready; batch WARMUP_ALL (``WxH:all``) until build_config
    # makes it every size the model's batches form in (daemon/warmup.py)
    warmup: tuple[tuple[int, int, int], ...] = ()
    keep_alive_s: float | None = None  # TOML ``keep_alive``: this model's, over the daemon's --keep-alive
    pinned: bool = False  # TOML ``pin = true`` or --pin NAME: never leaves its device for another model
    preload: bool | None = None  # TOML ``preload = true|false``: over the file's top-level preload, under --preload
    # TOML ``max_batch`` and ``batch_sizes`` in its table: this model's, over the daemon's (None: the daemon's);
    # read through DaemonConfig.max_batch_of and batch_sizes_of, never directly
    max_batch: int | None = None
    batch_sizes: str | None = None
    offload_reason: str = ""  # why offload=auto chose what it did, or stream's plan (logged at start)
    auto_placed: bool = False  # offload=auto chose the offload: refusals' hints then name the mode it chose
    nothing_fits: str = ""  # offload=auto found no configuration within the budget: its jobs' refusal


TABLE_KEYS = ("name", "spec", "device", "workers", "dtype", "options", "offload", "compile", "warmup", "keep_alive",
              "pin", "preload", "max_batch", "batch_sizes")
"""The keys a ``[[models]]`` table takes (config.build_config reads each of them)."""


def check_table(table: Any, index: int) -> None:
    """Refuse a ``[[models]]`` entry that is not a table, or holds a key not in ``TABLE_KEYS``: a misspelled key
    (``max_bach``, ``pinned``) would otherwise be dropped without a word and the model served without it, as an
    unknown top-level setting is refused. The message names the model, the key and the keys there are, close
    matches first."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"[[models]] entry {index + 1} is {table!r}, not a table: give each model as a [[models]] "
                          'table with spec = "..." (and name, device, options ...)')
    who = table.get("name") or table.get("spec") or f"#{index + 1}"
    unknown_keys(table, TABLE_KEYS, f"key(s) in the [[models]] table of model {str(who)!r}")


def resolve_offload(m: ModelConfig, budget: int | None, kept: Beside = NOTHING_BESIDE,
                    pinned_beside: str = "") -> ModelConfig:
    """``offload=auto`` made concrete from the files' headers and the device budget (residency/fit.py), so the
    worker is told what to do and residency counts what it will hold; other modes checked against the rest.
    ``offload=stream`` (given, or auto's choice) gets its ``resident_blocks`` the same way unless it is given,
    planned in the budget less what the worker keeps beside the model (``kept``: residency/beside.py), since
    its plan fills what it is given. Auto chooses against the whole budget, as the other configurations leave it
    to activations, and does not stream where what is kept beside is not all known, where ``pinned_beside``
    names another model pinned on the same device, or where stream does not fit beside what is kept (group then);
    ``kept`` holds, for a pinned model, the largest model beside it too (``kept_beside``)."""
    parsed = parse_spec(m.spec)
    options = model_options(m.spec, m.options)  # a spec's own options (SPEC,offload=stream) count as the table's
    try:
        mode = offload_mode(options)
    except PipelineError as exc:
        raise ConfigError(f"model {m.name!r}: {exc}") from None
    on_cpu = all(d == "cpu" for d in m.devices)
    defaulted = not ({"offload", "cpu_offload"} & options.keys()) and budget is not None and not on_cpu
    if defaulted and not m.compile:  # auto is the default under a budget: none when it fits, as before
        mode = "auto"
    if mode != "none" and m.compile:
        raise ConfigError(f"model {m.name!r}: --compile with offload={mode} is refused (offload hooks move weights "
                          "inside the forward, which breaks the compiled graph); drop one of the two")
    if mode != "none" and mode != "auto" and on_cpu:
        raise ConfigError(f"model {m.name!r}: offload={mode} needs an accelerator device; on cpu the weights are in "
                          "host memory already, so there is nothing to offload to (use offload=none or auto)")
    if mode == "stream":
        if parsed.kind == "gguf":
            raise ConfigError(f"model {m.name!r}: offload=stream is refused for a GGUF transformer: its quantized "
                              "tensors are not plain ones a ring slot can hold; use offload=group (or none)")
        return resolve_stream(m, options, budget, "", kept)
    if mode != "auto":
        return m
    skips = {"stream": pinned_beside} if pinned_beside else {}
    if kept.unknown:
        skips["stream"] = f"what is kept beside it is not all sized: {kept.unknown}"
    chosen, reason, unfit = choose_auto(m.spec, options, m.dtype, on_cpu=on_cpu, budget=budget, skips=skips)
    if chosen == "stream" and budget is not None:
        why_not = _stream_short(m, options, kept, budget)
        if why_not:
            skips["stream"] = why_not
            chosen, reason, unfit = choose_auto(m.spec, options, m.dtype, on_cpu=on_cpu, budget=budget, skips=skips)
    # why FLUX is not streamed, where it would have been (group or slower chosen instead): something to act on
    if chosen in ("group", "model", "sequential") and budget is not None:
        reason += _passed_over(m, options, budget, skips.get("stream", ""))
    auto = "offload=auto (the default under a --device-memory budget)" if defaulted else "offload=auto"
    if chosen == "stream":  # the figures are the plan's in the room beside what is kept (resolve_stream's)
        reason = f"stream at {m.dtype}"
    m = replace(m, options={**m.options, "offload": chosen}, offload_reason=f"{auto} chose {reason}",
                nothing_fits=unfit, auto_placed=True)
    if chosen != "stream":
        return m
    return resolve_stream(m, {**options, "offload": chosen}, budget, m.offload_reason, kept)


def _stream_plan(m: ModelConfig, options: Mapping[str, str], room: int) -> tuple[StreamPlan | None, bool]:
    """The stream plan in ``room`` and whether it fits (None, False where the files cannot tell)."""
    try:
        plan, row = plan_stream(m.spec, {**options, "offload": "stream"}, m.dtype, room)
    except (WeightsError, PipelineError):
        return None, False
    return plan, bool(row.fits)


def _passed_over(m: ModelConfig, options: Mapping[str, str], budget: int, skipped: str) -> str:
    """Why FLUX.1 is not streamed, for its start line, where stream fits the budget: something to act on (a pin,
    a file, what is kept beside it), or that too few blocks would stay resident; "" for another model."""
    if pipeline_class(m.spec, options, m.dtype) not in STREAM_MEASURED:
        return ""
    plan, fits = _stream_plan(m, options, budget)
    if plan is None or not fits:
        return ""
    if too_few_resident(plan.resident_blocks, plan.blocks):
        skipped = _too_few(plan)
    return f"; stream passed over: {skipped}" if skipped else ""


def _too_few(plan: StreamPlan) -> str:
    return (f"only {plan.resident_blocks} of {plan.blocks} denoiser blocks would stay resident, streaming about "
            f"what group moves (auto streams from {AUTO_STREAM_RESIDENT:.0%} resident; ask for it by name)")


def _stream_short(m: ModelConfig, options: Mapping[str, str], kept: Beside, budget: int) -> str:
    """Why auto's stream falls short ("" where it does not): it does not fit beside what is kept, or it would keep
    too few blocks resident to stream clearly less than group moves (``AUTO_STREAM_RESIDENT``)."""
    plan, fits = _stream_plan(m, options, kept.room(budget))
    if plan is None or not fits:
        beside = f" left beside {kept.what}" if kept.nbytes else ""
        return f"its least plan does not fit the {format_bytes(kept.room(budget))}{beside}"
    return _too_few(plan) if too_few_resident(plan.resident_blocks, plan.blocks) else ""


def resolve_stream(m: ModelConfig, options: Mapping[str, str], budget: int | None, why: str,
                   kept: Beside = NOTHING_BESIDE) -> ModelConfig:
    """``resident_blocks`` for an ``offload=stream`` model: given, or the most the budget has room for beside
    what the worker keeps there (``kept``)."""
    given = options.get("resident_blocks")
    if given is not None:
        try:
            inputs = stream_inputs(model_tensors(m.spec, options, m.dtype)[0], m.dtype)
        except (WeightsError, PipelineError):
            return m  # sized when it loads: the worker refuses a count past the denoiser's
        if inputs is not None and int(given) > len(inputs[0]):
            raise ConfigError(f"model {m.name!r}: resident_blocks={given}, but its denoiser has {len(inputs[0])} "
                              f"blocks; give 0 to {len(inputs[0])}")
        return m
    if budget is None:
        raise ConfigError(f"model {m.name!r}: offload=stream keeps as many denoiser blocks on the device as "
                          "--device-memory has room for: give --device-memory SIZE, or resident_blocks=N "
                          "(diffusiond fit SPEC --device-memory SIZE prints N)")
    try:
        plan, row = plan_stream(m.spec, options, m.dtype, kept.room(budget))
        note = kept.note(budget)
        if not row.fits and kept.assumed and row.needs <= budget:  # a count that may be high (beside.py): the
            row = replace(row, fits=True)  # least plan, which fits the budget alone, costs blocks, not the model
            note = (f" (the least plan: it does not fit beside {kept.what} counted kept beside it, some of which "
                    "were counted by an assumed family and may not be kept)")
    except WeightsError as exc:
        raise ConfigError(f"model {m.name!r}: offload=stream cannot choose resident_blocks from the files "
                          f"({exc}); give resident_blocks=N") from None
    except PipelineError as exc:
        raise ConfigError(f"model {m.name!r}: {exc}") from None
    note += f" (not counted, its size unknown: {kept.unknown})" if kept.unknown else ""
    reason = why or f"offload=stream: {plan.describe()}"
    beside = f" beside {kept.what} kept with it" if kept.nbytes else ""
    unfit = m.nothing_fits if row.fits else (
        f"offload=stream does not fit the --device-memory budget of {format_bytes(budget)}{beside}: at its least "
        f"({plan.describe()}) it needs {format_bytes(row.needs)} on the device ({format_bytes(plan.device_bytes)} "
        f"of weights and ring, {format_bytes(row.working_bytes)} working); try offload=group, model or sequential")
    return replace(m, options={**m.options, "offload": "stream", "resident_blocks": str(plan.resident_blocks)},
                   offload_reason=(f"{why}: needs {format_bytes(row.needs)} on the device ({plan.describe()}){note}"
                                   if why else f"{reason}{note}"),
                   nothing_fits=unfit)


def kept_beside(m: ModelConfig, models: Sequence[ModelConfig], controlnets: Sequence[str],
                ip_adapters: Sequence[tuple[str, str]], upscalers: Sequence[str]) -> Beside:
    """What ``m``'s stream plan leaves room for (residency/beside.py); pinned, also the largest model sharing its
    device, which could never take its room back from it."""
    kept = NOTHING_BESIDE
    if controlnets or ip_adapters or upscalers:
        kept = beside(controlnets, ip_adapters, upscalers, m.dtype,
                      pipeline_class(m.spec, model_options(m.spec, m.options), m.dtype))
    # a pinned neighbour is left out of the budget already (``auto_budget``)
    near = [o for o in models if o.name != m.name and set(o.devices) & set(m.devices) and not o.pinned]
    if m.pinned and near:
        sizes = {o.name: _neighbour(o) for o in near}
        unsized = [n for n, (v, _) in sizes.items() if v is None]
        name = unsized[0] if unsized else max(sizes, key=lambda n: sizes[n][0] or 0)
        nbytes, sure = sizes[name]
        kept = kept.plus(f"{name} (the largest model beside it)", nbytes, assumed=not sure)
    return kept


def _neighbour(o: ModelConfig) -> tuple[int | None, bool]:
    """What a model keeps on the device, from its headers, and whether that is sure: at its own offload where it
    gives one that sizes (a neighbour under group holds 1.3 GiB, not its 31); else (auto, the
    default, or a stream plan not made yet) resident, which may be high."""
    options = model_options(o.spec, o.options)
    if options.get("offload", "auto") != "auto" or options.get("cpu_offload") == "1":
        own = device_weights(o.spec, options, o.dtype, on_cpu=False)
        if own is not None:
            return own, True
    return device_weights(o.spec, {**options, "offload": "none"}, o.dtype, on_cpu=False), False


def pinned_beside(m: ModelConfig, models: Sequence[ModelConfig]) -> str:
    """A model pinned on ``m``'s device, which a stream plan filling the budget would crowd ("" for none)."""
    pinned = next((o.name for o in models if o.pinned and o.name != m.name and set(o.devices) & set(m.devices)), "")
    return f"{pinned} is pinned on the same device" if pinned else ""


def auto_budget(m: ModelConfig, models: Sequence[ModelConfig], budget_of: Callable[[str], int],
                unbounded: int) -> int | None:
    """What ``offload=auto`` plans one worker of ``m`` in: the smallest of its devices' budgets, each shared by
    its workers there (``--device cuda:0,cuda:0`` holds two copies) and less the models pinned there, which never
    leave (either way auto chose ``none`` and residency then refused every job). None where no
    device has a budget (``unbounded`` or more)."""
    rooms = []
    for d in dict.fromkeys(m.devices):
        if budget_of(d) >= unbounded:
            continue
        pinned = sum((_neighbour(o)[0] or 0) * o.devices.count(d) for o in models
                     if o.pinned and o.name != m.name and d in o.devices)
        rooms.append(max(budget_of(d) // m.devices.count(d) - pinned, 0))
    return min(rooms, default=None)
