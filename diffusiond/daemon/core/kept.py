"""The live updates the engine keeps for workers that start later (issue 29), and which of them are proven.

Each adapter (``update_lora``) or model component (``update_weights``) has a chain of kept updates, in the order
they were accepted, each with a duplicate of each of its memfds (its parts); a new worker gets the chain in
order. A later update that names every tensor of an earlier one makes it useless, and its memfds are closed, so
what is kept stays bounded by the tensors the trainer sends.

An update is *proven* once a worker applied it. One accepted while no worker could check it (its model on
disk, asleep at level 2) is kept on trust: the model's last table or its files' headers passed it
(``file_checks.py``), but what only a loaded model shows can still refuse it when the model starts. So an
update on trust never supersedes a proven one: the last proven values stay kept behind it, the model falls
back to them if the start refuses the newer one, and only once a worker takes it (``prove``) is the older one
dropped. Updates on trust supersede each other (the trainer's newest is the one it wants), so at most one
generation of each tensor waits behind the proven one.

A worker that fails half-way through copying a kept update at its start (an I/O or device error, ``Ack.restarts``)
did not refuse it: it exits, and its replacement gets the same chain. Only after ``MAX_RESTARTS`` such failures of
one update in a row, with no worker applying it in between, is it dropped, so that a model does not restart forever;
failures spread over starts that took it are no crash loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from diffusiond.ipc.messages import UpdateLora, UpdateWeights

log = logging.getLogger(__name__)

Update = UpdateLora | UpdateWeights
MAX_RESTARTS = 3  # workers in a row that fail half-way through one kept update at their start before it is dropped


class Kept(NamedTuple):
    msg: Update
    fds: tuple[int, ...]  # the engine's own duplicates of the update's parts, in the frame's order
    proven: bool  # a worker applied it (else kept on trust, checked when its model next starts)
    restarts: int = 0  # workers in a row that failed half-way through it at their start, and exited


Chains = dict[Hashable, list[Kept]]


def _names(msg: Update) -> set[str]:
    return {t.name for t in msg.tensors}


def dups(fds: Sequence[int]) -> list[int]:
    """A duplicate of each of ``fds`` (an update's parts, for a worker or for ``keep``); none left open if one
    cannot be made (EMFILE)."""
    out: list[int] = []
    try:
        for fd in fds:
            out.append(os.dup(fd))
    except BaseException:
        close(out)
        raise
    return out


def close(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


_closer = ThreadPoolExecutor(1, thread_name_prefix="diffusiond-kept-close")


def retire(entry: Kept) -> None:
    """Close a superseded update's memfds on a thread of their own. Once the client and the workers closed theirs,
    the engine's are the last: closing them frees the pages, and for an SDXL UNet's 4.9 GB that took 0.37-0.51 s
    of each ``update_weights`` call after the first on an H100 host (docs/benchmarks.md), on the event loop and
    before the answer."""
    _closer.submit(_close_each, entry.msg, entry.fds)


def _what(msg: Update) -> str:
    where = f"LoRA {msg.name!r}" if isinstance(msg, UpdateLora) else f"{msg.component} of model {msg.model}"
    return f"{where} update version {msg.version}"


def _close_each(msg: Update, fds: tuple[int, ...]) -> None:
    """Every fd, whatever the others do: one that fails (EBADF would be a double close elsewhere) must not leave
    the rest of the update's pages held, and nobody waits on this thread to hear of it."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            log.error("closing memfd %d of the kept %s failed: %s", fd, _what(msg), exc)


def keep(kept: Chains, key: Hashable, msg: Update, fds: Sequence[int], *, proven: bool) -> None:
    """Remember ``msg`` (with a duplicate of each of its memfds) at the end of ``key``'s chain; earlier updates
    whose every tensor it names again are closed, unless they are proven and it is not."""
    names = _names(msg)
    mine = tuple(dups(fds))  # first: a failure leaves the chain as it was
    chain = []
    for entry in kept.get(key, []):
        if _names(entry.msg) <= names and (proven or not entry.proven):
            retire(entry)
        else:
            chain.append(entry)
    kept[key] = [*chain, Kept(msg, mine, proven)]


def prove(chain: list[Kept], entry: Kept) -> None:
    """A worker applied ``entry``: it is proven, the earlier updates it covers are dropped, and the failures
    before are no crash loop any more."""
    names = _names(entry.msg)
    at = chain.index(entry)
    for old in chain[:at]:
        if _names(old.msg) <= names:
            retire(old)
            chain.remove(old)
    chain[chain.index(entry)] = entry._replace(proven=True, restarts=0)


def drop(chain: list[Kept], entry: Kept) -> str:
    """Remove ``entry``, refused when its model started; what its tensors run instead, in words: the
    version of the last update before it that names any of them, or the files' values."""
    names = _names(entry.msg)
    at = chain.index(entry)
    chain.remove(entry)
    retire(entry)
    earlier = [old.msg.version for old in chain[:at] if _names(old.msg) & names]
    return f"version {max(earlier)}" if earlier else "the files' values"


def in_force(instead: str, held: int, who: str = "") -> str:
    """What runs instead of an update dropped at the bound. The workers running (``who``, where known) applied it
    before (version ``held``, 0: none did) and keep it until they restart, unlike those that start from now on."""
    if not held:
        return f"in force instead: {instead}"
    return (f"in force instead: {instead} on workers that start from now on, while the workers already running"
            f"{f' ({who})' if who else ''} keep version {held}")


def restarted(chain: list[Kept], entry: Kept, what: str, worker: str, message: str,
              last: str = "the last") -> tuple[Kept, str]:
    """A worker failed half-way through ``entry`` at its start and exits (``message``: why). ``entry`` stays,
    counted, and '' says so (logged); once ``MAX_RESTARTS`` workers in a row did, the start of the message saying it
    is dropped, which the caller does (what runs instead differs for adapters and components)."""
    at = chain.index(entry)
    chain[at] = entry = entry._replace(restarts=entry.restarts + 1)
    if entry.restarts < MAX_RESTARTS:
        log.error("%s: %s failed while copying update version %d at its start (%d of %d before it is dropped): %s",
                  what, worker, entry.msg.version, entry.restarts, MAX_RESTARTS, message)
        return entry, ""
    return entry, (f"update version {entry.msg.version} was dropped: {MAX_RESTARTS} workers in a row failed while "
                   f"copying it when they started ({last}: {message})")


def holds_alone(chain: list[Kept], entry: Kept) -> bool:
    """Whether ``entry`` holds a tensor no other kept update of its chain does: without it, a worker that starts
    would build a live adapter from the rest, a part of it."""
    return bool(_names(entry.msg) - {name for other in chain if other is not entry for name in _names(other.msg)})


def clear(chain: list[Kept]) -> None:
    for entry in chain:
        retire(entry)
    chain.clear()
