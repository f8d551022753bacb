"""Live LoRA updates (``Client.update_lora``): a trainer's adapter weights into the workers, no files.

The tensors arrive in memfds a local client filled (1 to ``MAX_PARTS`` "parts", written in parallel), with a
msgspec header (UPDATE_LORA: each tensor's name, dtype, shape, part and offset) on the output socket
(``edge/handoff.py``): the one socket where fds travel. Everything that needs no model is checked here, first
bad tensor named: the adapter's name, that it is not a file-registered adapter, each tensor's name
(diffusers/PEFT: ``<component>.<module>.lora_A.weight`` / ``lora_B``), dtype, shape and that it lies inside its
part's memfd. Then each live worker gets a duplicate of every fd with the version this update makes; it copies
the tensors out, checks them against its model and applies them between batches (see ``worker/weights.py``), and
ACKs. The engine never maps or copies the tensors itself.

An adapter created this way is registered like a file one (same admission, same ``GET
/v1/loras`` entry, path ``LIVE_PATH``). A worker started later (a replacement for one that died, a
model loaded on demand or again after an unload, a wake from a level-2 sleep) gets every accepted
update again before it takes a job (``replay``, called by the pool between the worker's READY and
its first batch): the engine keeps a duplicate of each update's memfds, dropping them as soon as a
later update of the same adapter or component names all of its tensors, so what is kept is bounded
by the tensors the trainer sends, and the new worker ends at the same versions as the others.

A model with no worker running (on disk after its keep_alive, retired by a level-2 sleep, never
loaded under ``--preload none``) is exactly when a trainer pushes weights, so it does not make an
update fail: the update is kept, and that model's next worker checks it against the model and
applies it before its first job; a refusal then shows in the model's ``lora_errors``, as one from
a running worker does; a refused component update (``update_weights``) shows in the model's
``weight_errors``. Only when every model that could take the update ran it and refused is it a
400. Versions count accepted updates (1 for the first); a number that a worker may hold (it did
not answer in time) is never given again.

One update at a time, under the registry's lock: versions are drawn in the order updates are sent,
and an update of an adapter being registered by ``POST /v1/loras`` must not race it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from diffusiond.daemon.core.file_checks import Checks
from diffusiond.daemon.core.kept import (
    Chains,
    Kept,
    clear,
    close,
    drop,
    dups,
    holds_alone,
    in_force,
    keep,
    prove,
    restarted,
)
from diffusiond.daemon.core.loras import (
    Answers,
    LoraInfo,
    LoraRegistry,
    ModelLoras,
    ask_each,
    check_name,
    live_workers,
    refusals,
    split_message,
)
from diffusiond.daemon.core.update_fds import part_sizes
from diffusiond.daemon.errors import InvalidRequest, Unavailable, UpdateSplit
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.ipc.messages import LIVE_PATH, UpdateLora, UpdateWeights, WeightTensor
from diffusiond.ipc.tensors import nbytes
from diffusiond.pipelines.live_checks import KINDS, Shape, adapter_misfit
from diffusiond.protocol import MODEL_DTYPES

log = logging.getLogger(__name__)

DTYPES = MODEL_DTYPES  # weights are taken in the dtypes a model runs in (the client checks the same)
MAX_DIMS = 4  # Linear (2) and Conv2d (4) LoRA matrices


Files = Callable[[str], Awaitable[Checks | None]]  # a model's table or files' headers, when they can tell


async def _no_files(model: str) -> Checks | None:
    return None


class LiveLoras:
    def __init__(self, registry: LoraRegistry, files: Files = _no_files) -> None:
        self.registry = registry
        self.files = files
        self.versions: dict[str, int] = {}  # live adapter -> the version of its last accepted update
        self._drawn: dict[str, int] = {}  # the highest version a worker may hold: never given twice
        self.kept: Chains = {}  # adapter -> its updates still in force
        # adapter -> why an update kept on trust was refused when a model started (``GET /v1/loras``), until
        # an update sent after it is accepted
        self.refused: dict[str, str] = {}
        # (adapter, model): the model did not take the adapter's last update only because a worker of it did
        # not answer, or took it on some workers only: the next update goes to it again
        self._retry: set[tuple[str, str]] = set()
        # adapter -> its tensors' shapes, once no kept update holds all of it (``MAX_RESTARTS`` dropped the one
        # that did): its next update must hold all of them, and goes to every model
        self._gone: dict[str, dict[str, Shape]] = {}

    async def replay(self, model: ModelLoras, worker: WorkerLink, timeout: float) -> bool:
        """Every live adapter's kept updates into a worker that started after them (under the lock, so
        no update overtakes them); the model's entry says whether it fits there. ``kept`` is read
        under the lock: an update in flight when the worker came up, too early to reach it among the
        live ones, is kept by the time the lock is free, so it is sent here. True: the worker exits."""
        async with self.registry._adding:
            for name, chain in self.kept.items():
                assert isinstance(name, str)
                why = await self._resend(model, worker, name, chain, timeout)
                if why is None:  # it failed half-way through an update and exits: its replacement starts over
                    return True
                if why:
                    log.warning("live LoRA %r was not restored on %s: %s", name, worker.name, why)
                    model.lora_errors[name] = why
                else:
                    model.lora_errors.pop(name, None)
        return False

    async def _resend(self, model: ModelLoras, worker: WorkerLink, name: str, chain: list[Kept],
                      timeout: float) -> str | None:
        """Send a kept chain to one worker, in order, each after the last's ACK; '' or why the adapter is
        not there, None where the worker failed half-way through one and exits (it is kept).
        A later update kept on trust that the worker refuses is bad on every model (it was checked against
        the adapter's own tensors, which are the same everywhere): it is dropped, and the worker keeps the
        last version it took."""
        if not chain:  # the update holding all of it was dropped after workers failed copying it
            return self.refused.get(name, "no update of it is kept")
        for entry in list(chain):
            try:
                ack = await worker.command(entry.msg, timeout, dups(entry.fds))
            except Exception as exc:
                return f"the worker did not answer: {exc}"
            if ack.restarts:
                entry, dropped = restarted(chain, entry, f"live LoRA {name!r}", worker.name, ack.message,
                                           f"the last of model {model.name}")
                if dropped:
                    self.refused[name] = f"{dropped}; {self._dropped(name, chain, entry)}"
                    log.error("live LoRA %r: %s", name, self.refused[name])
                return None
            if ack.ok:
                prove(chain, entry)  # proven, and a count of failures before starts over
                continue
            if entry.proven or entry is chain[0]:  # the adapter itself does not fit this model
                return ack.message
            instead = drop(chain, entry)
            self.refused[name] = (f"update version {entry.msg.version} was refused when model {model.name} "
                                  f"started, and dropped: {ack.message}; in force instead: {instead}")
            log.error("live LoRA %r: %s", name, self.refused[name])
        return ""

    def _dropped(self, name: str, chain: list[Kept], entry: Kept) -> str:
        """Drop ``entry`` at the bound; what runs instead, in words. Workers that run it keep it.
        Without the only update holding some of the adapter's tensors, the rest would build a part of it in a
        new worker: all go, and the adapter's next update must hold all of it."""
        if not holds_alone(chain, entry):
            instead = drop(chain, entry)
            return in_force(instead, entry.msg.version if entry.proven else 0)
        held = max((e.msg.version for e in chain if e.proven), default=0)
        self._gone[name] = _tensors(chain)
        clear(chain)
        running = f"workers already running keep version {held}" if held else "no worker runs it"
        return (f"no kept update holds all of the adapter now, so workers that start from now on run without it and "
                f"their models refuse it ({running}): send all of its {len(self._gone[name])} tensors in one "
                f"update_lora of {name!r} to serve it everywhere again")

    def version(self, name: str) -> int:
        return self.versions.get(name, 0)

    async def update(self, msg: UpdateLora, fds: list[int], models: Iterable[ModelLoras], timeout: float) -> int:
        """Apply ``msg`` (tensors in ``fds``, its parts, closed here) to every live worker that holds or can
        hold the adapter; the new version. A refusal raises a 4xx naming the first bad tensor."""
        try:
            check_header(msg, fds, self.registry.loras.get(msg.name))
            async with self.registry._adding:
                return await self._send(msg, fds, list(models), timeout)
        finally:
            close(fds)

    async def _send(self, msg: UpdateLora, fds: list[int], models: list[ModelLoras], timeout: float) -> int:
        name = msg.name
        new = name not in self.registry.loras
        if not new and name not in self.versions:  # registered from a file meanwhile
            raise _file_registered(self.registry.loras[name])
        gone = self._gone.get(name)  # no kept update holds all of it: one that does goes everywhere, as a new one
        fresh = new or gone is not None
        # a model that did not take an update only because a worker did not answer or split it is asked again
        targets = [m for m in models if fresh or name not in m.lora_errors or (name, m.name) in self._retry]
        if not targets:
            raise InvalidRequest(f"LoRA {name!r} is served by no model here "
                                 f"({refusals({m.name: m.lora_errors[name] for m in models})}); send the "
                                 "trainer's adapter whole under a new name", field="name")
        shapes = {t.name: tuple(t.shape) for t in msg.tensors}
        # an update of an existing adapter is checked against the adapter's tensors, whatever the model:
        # here, so that one for models that run no worker is refused at once, not kept
        why = "" if new else adapter_misfit(name, shapes, gone or _tensors(self.kept.get(name, [])), _no_model)
        if not why and gone is not None and len(shapes) < len(gone):
            why = (f"it holds {len(shapes)} of the {len(gone)} tensors of LoRA {name!r}, and no kept update holds the "
                   "others (one was dropped after workers failed copying it: `refused` in GET /v1/loras); send all "
                   f"{len(gone)} in one update")
        if why:
            raise InvalidRequest(f"LoRA {name!r} update refused: {refusals({m.name: why for m in targets})}",
                                 field="tensors")
        version = max(self.versions.get(name, 0), self._drawn.get(name, 0)) + 1
        forward = UpdateLora(name, msg.tensors, version)
        answers = await ask_each(live_workers(targets), lambda w: w.command(forward, timeout, dups(fds)),
                                 timeout)
        # checked when it next starts; one whose workers all stopped meanwhile too
        idle = [m for m in targets if m.name not in answers.asked]
        misfits = {}  # a new adapter against the files of the models that run no worker, where they tell
        for m in idle if new else ():
            files = await self.files(m.name)
            why = files.lora_misfit(name, shapes) if files is not None else ""
            if why:
                misfits[m.name] = why
        idle = [m for m in idle if m.name not in misfits]
        whys = {**misfits, **answers.whys}
        accepted = set(answers.asked) - set(whys)
        split = [m for m in answers.asked if answers.split(m)]
        # A refusal of a new adapter may be the model's (no such component): an idle model may still
        # take it. One of an existing adapter is about the adapter, which is the same on every model.
        if not accepted and (not idle or (whys and not fresh)):
            if answers.unanswered or split:  # a worker may hold it: the number is never given again
                self._drawn[name] = version
            if len(whys) == 1:  # one model: a split or a worker that did not answer is said as such
                _refuse_split(f"LoRA {name!r}", next(iter(whys)), version, answers)
            elif split:
                message = " / ".join(split_message(f"LoRA {name!r}", sm, version, answers) for sm in split)
                log.error("%s", message)
                raise UpdateSplit(message)
            if set(whys) <= set(answers.restarted):
                raise _restarts(f"LoRA {name!r}", version, refusals(whys))
            raise InvalidRequest(f"LoRA {name!r} update refused: {refusals(whys)}", field="tensors")
        for split_model in split:  # taken elsewhere: the call returns a version, the split is logged and shown
            log.error("%s", split_message(f"LoRA {name!r}", split_model, version, answers))
        for m in targets:
            if m.name in whys:
                # it holds the old weights, or none, or (split) both: not served there
                m.lora_errors[name] = split_message(f"LoRA {name!r}", m.name, version, answers) \
                    if m.name in split else whys[m.name]
                if m.name in split or (m.name in answers.whys and m.name not in answers.refused):
                    self._retry.add((name, m.name))
            elif fresh or (name, m.name) in self._retry:
                m.lora_errors.pop(name, None)
                self._retry.discard((name, m.name))
        if idle:
            log.info("LoRA %r version %d kept for %s, which run no worker: applied when they start", name,
                     version, ", ".join(m.name for m in idle))
        if new:
            self.registry.loras[name] = _info(msg)
        if accepted or gone is not None:
            self.refused.pop(name, None)
        self._gone.pop(name, None)
        self.versions[name] = self._drawn[name] = version
        keep(self.kept, name, forward, fds, proven=bool(accepted))
        return version


def check_header(msg: UpdateLora, fds: list[int], registered: LoraInfo | None) -> None:
    """What needs no model: the name, the tensors' names, dtypes, shapes and places in the memfds."""
    why = check_name(msg.name)
    if why:
        raise InvalidRequest(why, field="name")
    if registered is not None and registered.path != LIVE_PATH:
        raise _file_registered(registered)
    check_tensors(msg.tensors, fds, lora=True)


def check_tensors(tensors: list[WeightTensor], fds: list[int], *, lora: bool) -> None:
    """How many memfds came, and each tensor's name, dtype, shape and place in its part's memfd (``lora``: LoRA
    naming and shapes)."""
    sizes = part_sizes(fds)
    if not tensors:
        raise InvalidRequest("the update holds no tensors; give a state dict", field="tensors")
    seen: set[str] = set()
    for t in tensors:
        where = f"tensor {t.name[:200]!r}"
        if t.name in seen:
            raise InvalidRequest(f"{where} is given twice", field="tensors")
        seen.add(t.name)
        component, _, rest = t.name.partition(".")
        if not t.name or len(t.name) > 1000:
            raise InvalidRequest(f"{where} is not a parameter's name (1-1000 characters)", field="tensors")
        if lora and (not component or not rest.endswith(KINDS) or not rest[: -len(KINDS[0])]):
            raise InvalidRequest(f"{where} is not a LoRA weight in diffusers/PEFT naming: expected "
                                 "'<component>.<module>.lora_A.weight' or '...lora_B.weight' (e.g. "
                                 "'unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight')",
                                 field="tensors")
        if t.dtype not in DTYPES:
            raise InvalidRequest(f"{where} has dtype {t.dtype[:40]!r}; LoRA weights are taken as "
                                 f"{', '.join(DTYPES)}", field="tensors")
        if lora and (not 2 <= len(t.shape) <= MAX_DIMS or any(not 1 <= d < 1 << 31 for d in t.shape)):
            raise InvalidRequest(f"{where} has shape {t.shape[:8]}; a LoRA matrix has 2 dimensions (4 for a "
                                 "convolution's), each at least 1", field="tensors")
        if not lora and (len(t.shape) > 8 or any(not 0 <= d < 1 << 31 for d in t.shape)):
            raise InvalidRequest(f"{where} has shape {t.shape[:9]}; give at most 8 dimensions, none negative",
                                 field="tensors")
        if not 0 <= t.part < len(sizes):
            raise InvalidRequest(f"{where} lies in part {t.part}; the update came with {len(sizes)} memfd(s), "
                                 f"parts 0 to {len(sizes) - 1}", field="tensors")
        size, end = nbytes(t.dtype, t.shape), sizes[t.part]
        if t.offset < 0 or t.offset + size > end:
            raise InvalidRequest(f"{where} ({size} bytes at offset {t.offset} of part {t.part}) does not lie inside "
                                 f"that part's memfd of {end} bytes", field="tensors")


class LiveComponents:
    """``update_weights``: whole parameters of one component, in place in every live worker of a model. A model's
    workers run the same weights, so each must accept. Where some applied it and one refused or did not answer, the
    call is a 409 saying how many took it (send it again), the split is logged and shown in ``weight_errors``; where
    the only answer missing is a worker's that timed out, a 503, not a refusal of the tensors. A
    worker the engine stopped meanwhile is not counted. A model with no live worker has it checked
    against the table its last load reported, else its files' headers (``file_checks.py``: a refusal there is the
    400 a worker gives), then takes it on trust: it is kept, behind the last proven update of the same tensors
    (``kept.py``), and checked by the model when it next starts; one refused then is dropped, since no worker of
    that model would ever take it, the model runs the update before it (or the files' values), and the trainer,
    whose call returned long ago, reads why and which version is in force in the model's ``weight_errors`` (``GET
    /v1/models``) until an update of that component sent after the refusal is accepted."""

    def __init__(self, files: Files = _no_files) -> None:
        self.files = files
        self.versions: dict[tuple[str, str], int] = {}  # the version of each one's last accepted update
        self._drawn: dict[tuple[str, str], int] = {}  # the highest version a worker may hold
        self._lock = asyncio.Lock()
        self.kept: Chains = {}  # (model, component) -> updates in force
        # (model, component) -> (the highest version drawn when a start refused one, why): the update
        # refused was kept on trust, so its call returned a version and this is where its refusal shows;
        # also (its version, the 409's message) for an update some workers took and others did not
        self.errors: dict[tuple[str, str], tuple[int, str]] = {}

    def weight_errors(self, model: str) -> dict[str, str]:
        """component -> why its update was refused at ``model``'s start (its entry in ``GET /v1/models``)."""
        return {c: why for (m, c), (_, why) in sorted(self.errors.items()) if m == model}

    def _accepted(self, key: tuple[str, str], version: int) -> None:
        """A worker took ``version``: a refusal is cleared only by an update sent after it, not by a
        later one of the same replay (which does not name what the refused one did, or it would have
        superseded it in ``kept``)."""
        if key in self.errors and version > self.errors[key][0]:
            del self.errors[key]

    async def replay(self, model: ModelLoras, worker: WorkerLink, timeout: float) -> bool:
        """The model's kept component updates into a worker that started after them (``kept`` read
        under the lock, as for ``LiveLoras.replay``). True: the worker exits."""
        async with self._lock:
            for key, chain in self.kept.items():
                if isinstance(key, tuple) and key[0] == model.name:
                    for entry in list(chain):
                        msg = entry.msg
                        try:
                            ack = await worker.command(msg, timeout, dups(entry.fds))
                        except Exception as exc:  # the worker runs the files' weights there: it is replaced
                            log.error("%s of model %s was not restored on %s: the worker did not answer: %s",
                                      key[1], model.name, worker.name, exc)
                            break
                        assert isinstance(msg, UpdateWeights)
                        mine = (model.name, msg.component)
                        if ack.ok:
                            self._accepted(mine, msg.version)
                            prove(chain, entry)  # and failures before it are no crash loop
                            continue
                        if ack.restarts:  # not a refusal: kept for its replacement, within a bound
                            self._restarted(chain, entry, model, worker, ack.message)
                            return True
                        instead = drop(chain, entry)
                        why = (f"update version {msg.version} was refused when the model started, and dropped: "
                               f"{ack.message}; in force instead: {instead}")
                        log.error("%s of model %s: %s", key[1], model.name, why)
                        self.errors[mine] = (self._drawn.get(mine, msg.version), why)
        return False

    def _restarted(self, chain: list[Kept], entry: Kept, model: ModelLoras, worker: WorkerLink,
                   message: str) -> None:
        """``worker`` failed half-way through ``entry`` at its start: kept, unless ``MAX_RESTARTS`` workers in a
        row did. The model's running workers applied a proven one, and keep it: said so."""
        assert isinstance(entry.msg, UpdateWeights)
        key = (model.name, entry.msg.component)
        what, version = f"{key[1]} of model {key[0]}", entry.msg.version
        entry, dropped = restarted(chain, entry, what, worker.name, message)
        if not dropped:
            return
        running = [w.name for _, w in live_workers([model]) if w is not worker] if entry.proven else []
        why = f"{dropped}; {in_force(drop(chain, entry), version if running else 0, ', '.join(running))}"
        log.error("%s: %s", what, why)
        self.errors[key] = (self._drawn.get(key, version), why)

    def _refuse(self, key: tuple[str, str], version: int, answers: Answers, why: str) -> None:
        """Raise for an update a worker (or the files) did not take. A split stays in the model's
        ``weight_errors`` until an update sent after it is accepted."""
        model, component = key
        try:
            _refuse_split(f"{component} of model {model}", model, version, answers)
        except UpdateSplit as exc:
            self.errors[key] = (version, exc.message)
            raise
        raise InvalidRequest(f"{component} of model {model}: update refused: {why}", field="tensors")

    async def update(self, msg: UpdateWeights, fds: list[int], models: Callable[[str], ModelLoras],
                     timeout: float) -> int:
        """``models`` finds the served model by name (ModelNotFound otherwise)."""
        try:
            model = models(msg.model)
            if not 1 <= len(msg.component) <= 64 or not msg.component.isidentifier():
                raise InvalidRequest(f"component {msg.component[:80]!r} is not a component's name (e.g. unet, "
                                     "transformer, text_encoder)", field="component")
            check_tensors(msg.tensors, fds, lora=False)
            async with self._lock:
                key = (model.name, msg.component)
                version = max(self.versions.get(key, 0), self._drawn.get(key, 0)) + 1
                forward = UpdateWeights(msg.model, msg.component, msg.tensors, version)
                live = live_workers([model])
                answers = await ask_each(live, lambda w: w.command(forward, timeout, dups(fds)), timeout)
                ran = bool(answers.asked)  # every live worker stopped meanwhile: as if none ran
                files = None if ran else await self.files(model.name)
                why = files.weights_misfit(msg.component, msg.tensors) if files is not None else ""
                whys = answers.whys if ran else {model.name: why} if why else {}  # no worker: the files answer
                if whys:
                    if answers.unanswered or answers.took:  # a worker may hold it: the number is never given again
                        self._drawn[key] = version
                    self._refuse(key, version, answers, whys[model.name])
                if ran:
                    self._accepted(key, version)
                else:
                    log.info("%s of model %s version %d kept: no worker runs, applied when one starts",
                             msg.component, model.name, version)
                self.versions[key] = self._drawn[key] = version
                keep(self.kept, key, forward, fds, proven=ran)
                return version
        finally:
            close(fds)


def _refuse_split(what: str, model: str, version: int, answers: Answers) -> None:
    """Raise the error for an update that some of ``model``'s workers did not take: a 409 when
    others did, a 503 when none refused and one did not answer (nothing is wrong with the tensors); else
    return, for the caller's 400."""
    if answers.split(model):
        message = split_message(what, model, version, answers)
        log.error("%s", message)
        raise UpdateSplit(message)
    if model in answers.restarted and model not in answers.refused:
        raise _restarts(what, version, answers.restarted[model])
    if model in answers.whys and model not in answers.refused:
        raise Unavailable(f"{what}: update version {version} was not applied: {answers.whys[model]}; "
                          "send the update again", retry_after_s=5)


def _restarts(what: str, version: int, why: str) -> Unavailable:
    """A worker failed half-way through copying the update and restarts: the tensors were not
    refused, and its replacement starts from the updates accepted before, so sending it again is the remedy."""
    return Unavailable(f"{what}: update version {version} was not applied: {why}; nothing of version {version} is "
                       "in force on that worker, whose replacement starts from the updates accepted before: send "
                       "the update again", retry_after_s=5)


def _tensors(chain: list[Kept]) -> dict[str, Shape]:
    """A live adapter's tensors and their shapes: its kept updates together hold all of them (one is
    dropped only for a later one that names all of its tensors)."""
    return {t.name: tuple(t.shape) for entry in chain for t in entry.msg.tensors}


def _no_model(key: str, shape: Shape) -> str:
    return ""


def _file_registered(info: LoraInfo) -> InvalidRequest:
    return InvalidRequest(f"LoRA {info.name!r} is registered from a file ({info.path}); only adapters created by "
                      "update_lora can be updated: give the trainer's adapter a name of its own", field="name")


def _info(msg: UpdateLora) -> LoraInfo:
    ranks = [t.shape[0] for t in msg.tensors if t.name.endswith(KINDS[0])]
    targets = sorted({t.name.partition(".")[0] for t in msg.tensors})
    return LoraInfo(name=msg.name, path=LIVE_PATH, layout="live", rank=max(ranks, default=0),
                    targets=tuple(targets))

