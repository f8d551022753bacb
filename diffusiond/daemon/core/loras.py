"""The LoRA adapters this daemon serves: registration, what each one is, and the checks per request.

A LoRA is registered by name (``serve --lora NAME=PATH``, TOML ``[loras]``, or ``POST /v1/loras``).
Its safetensors header is read here, without torch (the engine never loads it): the layout
(diffusers/PEFT, as ``save_lora_weights`` writes it, or kohya), the rank and the components it
targets. Whether it fits a model's shapes only the model can tell, so each worker loads every
adapter once when it starts (and when one is added at run time) and reports the ones that do not
fit; ``Model.lora_errors`` keeps those reasons and requests naming such a pair are refused at
admission. Which adapters are loaded at a given moment is the workers' business (a bounded LRU,
``pipelines/loras.py``); they report it in their heartbeat answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import struct
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from diffusiond.daemon.errors import Conflict, InvalidRequest, NotFound, Unavailable
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.ipc.errors import ChannelClosed
from diffusiond.ipc.messages import Ack, AddLora
from diffusiond.protocol import ErrorCode, WorkerState

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what save_lora_weights writes into its folder
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
# kohya key prefixes -> the pipeline component they patch
_KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2",
                   "lora_te_": "text_encoder", "lora_transformer_": "transformer"}
_DOWN_MARKERS = (".lora_A.", ".lora.down.", ".lora_down.", ".lora_linear_layer.down.")


class LoraFileError(ValueError):
    """A LoRA file that cannot be served; the message names the file and says why."""


class LoraNotFound(NotFound):
    default_code = ErrorCode.LORA_NOT_FOUND


class LoraExists(Conflict):
    default_code = ErrorCode.LORA_EXISTS


@dataclass(frozen=True)
class LoraInfo:
    name: str
    path: str  # as given: a folder (diffusers layout) or a .safetensors file
    layout: str  # "diffusers" or "kohya"
    rank: int
    targets: tuple[str, ...]  # pipeline components it patches: unet, text_encoder, transformer, ...


def check_name(name: str) -> str | None:
    """Why ``name`` cannot name an adapter (it becomes a PEFT adapter name and a URL-safe id)."""
    if not 1 <= len(name) <= 64 or not set(name) <= _NAME_OK:
        return f"LoRA name {name!r} must be 1-64 characters of letters, digits, '_', '-' and '.'"
    return None


def weights_file(path: str) -> Path:
    p = Path(path).expanduser()
    return p / DIFFUSERS_WEIGHT_NAME if p.is_dir() else p


def read_lora(name: str, path: str) -> LoraInfo:
    """Read a LoRA's safetensors header; ``LoraFileError`` naming the file if it is not a LoRA."""
    bad_name = check_name(name)
    if bad_name:
        raise LoraFileError(bad_name)
    if not path.strip() or "\x00" in path:
        raise LoraFileError(f"LoRA {name!r}: the path {path!r} is empty or holds a NUL character; give a folder "
                            "written by save_lora_weights or a .safetensors file")
    if not os.path.isabs(os.path.expanduser(path)):
        raise LoraFileError(f"LoRA {name!r}: the path {path!r} is relative; give an absolute path (the daemon's "
                            "working directory is not yours)")
    try:
        file = weights_file(path)  # is_dir: ENAMETOOLONG and the like are the path's fault
    except OSError as exc:
        raise LoraFileError(f"LoRA {name!r}: the path {path[:120]!r} cannot be a file's "
                            f"({exc.strerror or exc}); give a folder or a .safetensors file") from None
    where = f"LoRA {name!r} ({file})"
    try:
        st = os.stat(file)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
            raise LoraFileError(f"{where} is not a regular file")
        with open(file, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER_BYTES, st.st_size - 8):
                raise LoraFileError(f"{where} is not a safetensors file (no valid header)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        hint = f" (a folder must hold {DIFFUSERS_WEIGHT_NAME}, as save_lora_weights writes it)" \
            if file != Path(path).expanduser() else ""
        raise LoraFileError(f"{where} does not exist{hint}") from None
    except OSError as exc:
        raise LoraFileError(f"{where} cannot be read: {exc.strerror or exc}") from None
    except RecursionError:
        raise LoraFileError(f"{where} is not a safetensors file (its header nests too deeply)") from None
    except ValueError:  # UnicodeDecodeError, JSONDecodeError, and int() of a number over 4,300 digits
        raise LoraFileError(f"{where} is not a safetensors file (its header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise LoraFileError(f"{where} is not a safetensors file (its header is not a JSON object)")
    if file.suffix != ".safetensors":
        # diffusers would read another suffix with torch.load (pickle): only safetensors are served
        raise LoraFileError(f"{where} is not a .safetensors file; LoRA files are read as safetensors only")
    _check_whole(where, header, st.st_size - 8 - n)
    return _describe(name, path, where, header)


def _check_whole(where: str, header: dict[str, object], held: int) -> None:
    """A download cut short keeps its header: refused here, naming the file, rather than by every worker that
    loads it with safetensors' "incomplete metadata" at its first job."""
    ends = [e["data_offsets"][1] for e in header.values() if isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and isinstance(e["data_offsets"][1], int)]
    if ends and max(ends) > held:
        raise LoraFileError(f"{where} is truncated: its header describes {max(ends)} bytes of tensors and the file "
                            f"holds {held}; download or write it again")


def _describe(name: str, path: str, where: str, header: dict[str, object]) -> LoraInfo:
    keys = [k for k in header if k != "__metadata__"]
    kohya = [k for k in keys if k.startswith(tuple(_KOHYA_PREFIXES))]
    targets: set[str] = set()
    ranks: list[int] = []
    for key in keys:
        entry = header[key]
        if not any(m in key for m in _DOWN_MARKERS) or not isinstance(entry, dict):
            continue
        shape = entry.get("shape")
        if isinstance(shape, list) and shape and isinstance(shape[0], int):
            ranks.append(shape[0])
        if key in kohya:
            targets.add(next(c for p, c in _KOHYA_PREFIXES.items() if key.startswith(p)))
        else:
            targets.add(key.split(".", 1)[0])
    if not ranks:
        sample = ", ".join(keys[:3]) or "none"
        raise LoraFileError(
            f"{where} holds no LoRA weights: expected diffusers keys like 'unet....lora_A.weight' (what "
            f"save_lora_weights writes) or kohya keys like 'lora_unet_..._lora_down.weight'; its first keys: {sample}")
    return LoraInfo(name=name, path=path, layout="kohya" if kohya else "diffusers", rank=max(ranks),
                    targets=tuple(sorted(targets)))


class ModelLoras(Protocol):
    """What the registry needs of a served model (the pool's ``Model`` fits): its name, its
    workers, and why adapters do not fit it (name -> reason)."""

    @property
    def name(self) -> str: ...

    workers: list[WorkerLink]
    lora_errors: dict[str, str]


def live_workers(models: Iterable[ModelLoras]) -> list[tuple[ModelLoras, WorkerLink]]:
    """The workers that can take an adapter now: a sleeping one takes it into host memory."""
    return [(m, w) for m in models for w in m.workers if w.state in (WorkerState.READY, WorkerState.SLEEPING)]


async def ask_all(live: Sequence[tuple[ModelLoras, WorkerLink]],
                  send: Callable[[WorkerLink], Awaitable[Ack]]) -> dict[str, str]:
    """Send one command to every live worker at once; the first refusal per model, by model name.
    A worker that does not answer refuses for its model: the adapter is not known to be there."""
    acks = await asyncio.gather(*(send(w) for _, w in live), return_exceptions=True)
    whys: dict[str, str] = {}
    for (m, _), ack in zip(live, acks, strict=True):
        if isinstance(ack, BaseException):
            whys.setdefault(m.name, f"the worker did not answer: {ack}")
        elif not ack.ok:
            whys.setdefault(m.name, ack.message)
    return whys


@dataclass
class Answers:
    """Each live worker's answer to one update, by model (``ask_each``). A worker that went away meanwhile
    because the engine stopped it (an unload, a keep_alive) is not counted: the update is for the workers
    that run, and one that starts later replays it. One that crashed or did not answer in
    time is: it may hold the update or not, so the model's workers may now differ."""

    asked: dict[str, int] = field(default_factory=dict)  # model -> its workers still there to answer
    took: dict[str, int] = field(default_factory=dict)  # model -> its workers that applied it
    whys: dict[str, str] = field(default_factory=dict)  # model -> its first refusal or failure
    # model -> each worker that did not take it, named, and why (a split's message lists them)
    failed: dict[str, list[str]] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)  # the models where a worker answered with a refusal
    # model -> why a worker of it failed half-way through the copy and restarts: nothing of the update is in
    # force there once it has, and sending it again is the remedy, not a refusal
    restarted: dict[str, str] = field(default_factory=dict)
    unanswered: bool = False  # a worker did not answer: it may still apply the update

    def split(self, model: str) -> bool:
        """Some of the model's workers applied it and some did not."""
        return bool(self.took.get(model)) and model in self.whys


async def ask_each(live: Sequence[tuple[ModelLoras, WorkerLink]], send: Callable[[WorkerLink], Awaitable[Ack]],
                   timeout: float) -> Answers:
    """Send one update to every live worker at once; who took it, who refused it, who did not answer."""
    acks = await asyncio.gather(*(send(w) for _, w in live), return_exceptions=True)
    out = Answers()
    for (m, w), ack in zip(live, acks, strict=True):
        if isinstance(ack, ChannelClosed) and w.asked_to_stop:
            continue
        out.asked[m.name] = out.asked.get(m.name, 0) + 1
        if isinstance(ack, Ack) and ack.ok:
            out.took[m.name] = out.took.get(m.name, 0) + 1
            continue
        if isinstance(ack, Ack) and ack.restarts:
            why = whose = f"{w.name} failed while copying it: {ack.message}"
            out.restarted.setdefault(m.name, why)
        elif isinstance(ack, Ack):
            why, whose = ack.message, f"{w.name} refused it: {ack.message}"
            out.refused.add(m.name)
        else:
            out.unanswered = True
            if isinstance(ack, TimeoutError):
                failure = (f"did not answer within {timeout:.0f}s (it applies an update between batches, and may "
                           "still apply this one when its batch ends)")
            else:
                failure = f"did not answer: {ack}"
            why, whose = f"the worker {failure}", f"{w.name} {failure}"
        out.whys.setdefault(m.name, why)
        out.failed.setdefault(m.name, []).append(whose)
    return out


def split_message(what: str, model: str, version: int, answers: Answers) -> str:
    """A split update's account: how many of the model's workers applied it, who did not and why, what to do."""
    return (f"{what}: update version {version} was applied by {answers.took[model]} of {answers.asked[model]} "
            f"workers of model {model}, not by all ({'; '.join(answers.failed[model])}); its workers now run "
            "different weights: send the update again (as a new version, every worker takes it)")


def refusals(whys: Mapping[str, str]) -> str:
    return "; ".join(f"{model}: {why}" for model, why in whys.items())


class LoraRegistry:
    """The adapters this daemon serves, by name."""

    def __init__(self, paths: Mapping[str, str], max_loras: int) -> None:
        self.max_loras = max_loras
        self.loras: dict[str, LoraInfo] = {}
        for name, path in paths.items():
            self.loras[name] = read_lora(name, path)
        # A compiled model's hot-swap slots are made at start this large; adapters added later must fit.
        self.start_rank = max((info.rank for info in self.loras.values()), default=0)
        self._adding = asyncio.Lock()  # one at a time: a worker answers one ADD_LORA at a time

    @property
    def paths(self) -> dict[str, str]:
        """name -> path: what each worker is told to load at start."""
        return {n: info.path for n, info in self.loras.items()}

    def unfit_at_start(self, models: Sequence[ModelLoras]) -> str | None:
        """Why the daemon cannot start: a configured LoRA that fits none of the models."""
        for info in self.loras.values():
            whys = [f"{m.name}: {m.lora_errors[info.name]}" for m in models if info.name in m.lora_errors]
            if len(whys) == len(models):
                return f"LoRA {info.name!r} ({weights_file(info.path)}) fits no model served here: {'; '.join(whys)}"
        return None

    def resolve(self, model: ModelLoras, loras: Sequence[tuple[str, float]]) -> None:
        """Admission: each adapter exists and fits ``model``, and no more than a worker holds at once."""
        if len(loras) > self.max_loras:
            raise InvalidRequest(f"{len(loras)} LoRA adapters in one request; the limit is {self.max_loras} "
                                 "(--max-loras)", field="loras")
        for name, _ in loras:
            if name not in self.loras:
                known = ", ".join(sorted(self.loras)) or "none are registered (serve --lora NAME=PATH)"
                raise LoraNotFound(f"no LoRA named {name!r}; known: {known}", field="loras")
            why = model.lora_errors.get(name)
            if why is not None:
                raise InvalidRequest(f"LoRA {name!r} does not fit model {model.name!r}: {why}", field="loras")

    async def add(self, name: str, path: str, models: Iterable[ModelLoras], timeout: float,
                  lora_paths: dict[str, str]) -> LoraInfo:
        """Register an adapter at run time: every live worker loads it; it must fit at least one
        model. A failure leaves the daemon as it was and raises a 4xx naming the field."""
        models = list(models)
        async with self._adding:
            if name in self.loras:
                raise LoraExists(f"a LoRA named {name!r} is already registered ({self.loras[name].path})",
                                 field="name")
            try:
                info = await asyncio.to_thread(read_lora, name, path)  # file I/O: off the loop
            except LoraFileError as exc:
                field = "name" if check_name(name) else "path"
                raise InvalidRequest(str(exc), field=field) from None
            live = live_workers(models)
            if not live:
                raise Unavailable("no worker is running to check the LoRA against its model; retry later",
                                  retry_after_s=5)
            whys = await ask_all(live, lambda w: w.command(AddLora(name, path), timeout))
            if not {m.name for m, _ in live} - set(whys):
                raise InvalidRequest(f"LoRA {name!r} ({weights_file(path)}) fits no model served here: "
                                     f"{refusals(whys)}", field="path")
            for m in models:
                if m.name in whys:
                    m.lora_errors[name] = whys[m.name]
                else:
                    m.lora_errors.pop(name, None)
            lora_paths[name] = path
            self.loras[name] = info
            return info
