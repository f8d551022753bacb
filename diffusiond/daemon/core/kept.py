"""The live updates the engine keeps for workers that start later (issue 29), and which of them are proven.

Each adapter (``update_lora``) or model component (``update_weights``) has a chain of kept updates, in the
order they were accepted, each with a duplicate of its memfd; a new worker gets the chain in order. A
later update that names every tensor of an earlier one makes it useless, and its memfd is closed, so what
is kept stays bounded by the tensors the trainer sends.

An update is *proven* once a worker applied it. One accepted while no worker could check it (its model on
disk, asleep at level 2) is kept on trust: the model's last table or its files' headers passed it
(``file_checks.py``), but what only a loaded model shows can still refuse it when the model starts. So an
update on trust never supersedes a proven one: the last proven values stay kept behind it, the model falls
back to them if the start refuses the newer one, and only once a worker takes it (``prove``) is the older one
dropped. Updates on trust supersede each other (the trainer's newest is the one it wants), so at most one
generation of each tensor waits behind the proven one.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import NamedTuple

from diffusiond.ipc.messages import UpdateLora, UpdateWeights

Update = UpdateLora | UpdateWeights


class Kept(NamedTuple):
    msg: Update
    fd: int
    proven: bool  # a worker applied it (else kept on trust, checked when its model next starts)


Chains = dict[Hashable, list[Kept]]


def _names(msg: Update) -> set[str]:
    return {t.name for t in msg.tensors}


def keep(kept: Chains, key: Hashable, msg: Update, fd: int, *, proven: bool) -> None:
    """Remember ``msg`` (with a duplicate of its memfd) at the end of ``key``'s chain; earlier updates whose
    every tensor it names again are closed, unless they are proven and it is not."""
    names = _names(msg)
    chain = []
    for entry in kept.get(key, []):
        if _names(entry.msg) <= names and (proven or not entry.proven):
            os.close(entry.fd)
        else:
            chain.append(entry)
    kept[key] = [*chain, Kept(msg, os.dup(fd), proven)]


def prove(chain: list[Kept], entry: Kept) -> None:
    """A worker applied ``entry``: it is proven, and the earlier updates it covers are dropped."""
    names = _names(entry.msg)
    at = chain.index(entry)
    for old in chain[:at]:
        if _names(old.msg) <= names:
            os.close(old.fd)
            chain.remove(old)
    chain[chain.index(entry)] = entry._replace(proven=True)


def drop(chain: list[Kept], entry: Kept) -> str:
    """Remove ``entry``, refused when its model started; what its tensors run instead, in words: the
    version of the last update before it that names any of them, or the files' values."""
    names = _names(entry.msg)
    at = chain.index(entry)
    chain.remove(entry)
    os.close(entry.fd)
    earlier = [old.msg.version for old in chain[:at] if _names(old.msg) & names]
    return f"version {max(earlier)}" if earlier else "the files' values"
