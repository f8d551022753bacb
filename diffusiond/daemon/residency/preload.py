"""Which models the start loads (``--preload``, TOML ``preload``), and which wait on disk for a job.

A workstation shares its GPU: a model loaded at start holds device memory whether or not anyone
uses it, and a daemon that systemd starts on a client's first connection should hold nothing it
was not asked for. So the start only loads what it is told to (or, by default, what fits), and
every other model is known from the start (its name, spec and, where it ran before, its
capabilities and size from the state dir) but loaded when a job first needs it.

Who decides, most specific first: ``--preload`` on the command line (it replaces every other
word, as flags replace the file); a model's own ``preload = true|false`` in its ``[[models]]``
table; the file's top-level ``preload``; and without any of them the default: every model that
fits the budget, in the order configured, except in a socket-activated daemon, which loads none.

Pure functions of the configuration (no I/O, no import of ``config.py``, which imports this),
so the rules are tested without a daemon; ``keeper.preload`` carries the choice out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ALL, NONE = "all", "none"


def parse_preload(value: Any) -> tuple[str, ...]:
    """What ``--preload`` (repeatable, each a name or a comma list) or TOML's ``preload`` (a string,
    a list of names, or true/false for all/none) says: model names in the order given, or
    ``("all",)`` or ``("none",)``. Raises ValueError saying what is accepted."""
    if value is True or value is False:
        return (ALL,) if value else (NONE,)
    names: list[str] = []
    for part in value if isinstance(value, list | tuple) else [value]:
        if not isinstance(part, str):
            raise ValueError(f"preload {part!r} is not a model name; give model names (a,b), all or none")
        names += [n.strip() for n in part.split(",") if n.strip()]
    if not names:
        raise ValueError("preload is empty; give model names (a,b), all or none")
    words = [n for n in names if n in (ALL, NONE)]
    if words and len(set(names)) > 1:
        raise ValueError(f"preload {','.join(names)}: {words[0]!r} stands alone, not beside model names")
    return tuple(dict.fromkeys(names))


def check_preload(preload: tuple[str, ...] | None, models: Sequence[str]) -> None:
    """Every name ``preload`` gives is a configured model: a typo would otherwise load nothing, silently."""
    if preload is None or preload in ((ALL,), (NONE,)):
        return
    unknown = [n for n in preload if n not in models]
    if unknown:
        raise ValueError(f"--preload {', '.join(unknown)}: no such model (models: {', '.join(models)}; "
                         "or all, or none)")


def choose(models: Sequence[tuple[str, bool | None]], preload: tuple[str, ...] | None,
           socket_activated: bool) -> dict[str, tuple[bool, str]]:
    """Model name -> (load it at start?, why), for ``models`` as (name, its own ``preload`` or None).
    A model chosen is still loaded only if it fits beside those before it (``keeper.preload``)."""
    out: dict[str, tuple[bool, str]] = {}
    for name, own in models:
        if own is not None:
            out[name] = (own, f"preload = {'true' if own else 'false'} in its [[models]] table")
        elif preload is not None:
            out[name] = (preload == (ALL,) or name in preload, f"preload {','.join(preload)}")
        elif socket_activated:
            out[name] = (False, "a socket-activated daemon loads no model until a job needs it (--preload asks)")
        else:
            out[name] = (True, "by default the start loads every model that fits, in the order configured")
    return out


class Preloading:
    """What the start's preload is doing, for ``/ready`` and ``/health`` (issue 27): ``/ready`` answers 200 as
    soon as jobs are admitted, while the preload goes on, so a client that needs the models loaded (a
    benchmark, the test kit) waits for ``state`` ``done`` instead. ``models``: those the preload has yet to
    finish, loading now or waiting their turn, in the order they load."""

    def __init__(self) -> None:
        self.running = True  # from the daemon's start: nothing is loaded before the preload has run
        self.models: list[str] = []

    def begin(self, names: Sequence[str]) -> None:
        self.running, self.models = True, list(names)

    def ended(self, name: str) -> None:
        """``name``'s load at start is over, however it went (loaded, left on disk, failed)."""
        if name in self.models:
            self.models.remove(name)

    def done(self) -> None:
        self.running, self.models = False, []

    def view(self) -> dict[str, Any]:
        return {"state": "running" if self.running else "done", "models": list(self.models)}
