"""argparse types of the command line's flags: a bad value is a usage error (exit 2) that names the flag,
before any request is built.

Every float a flag takes goes through ``finite_float``: Python's ``float()`` reads ``nan``
and ``inf``, which JSON has no words for, so they reached the daemon as a body it could not parse, and the
refusal named neither the flag nor the value. Apart from ``generate.py`` because ``serve``, ``history`` and
``bench`` use them too, and generate.py is near the 500-line bound.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

from diffusiond.client import params

__all__ = ["HISTORY_MAX_LIMIT", "MODE_CHARS", "control_arg", "dash_values", "finite_float", "int_between",
           "ip_adapter_arg", "job_id_arg", "lora_arg", "parse_size", "positive_float", "positive_int"]


HISTORY_MAX_LIMIT = 1000
"""The most jobs a history page holds: the daemon's bound (daemon/edge/jobs.py, which the client side must not
import; a test holds the two equal), for ``history --limit``'s help and check."""


def dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--flag -value`` written ``--flag=-value`` where ``-value`` is no flag of the command.

    argparse takes a word that begins with '-' (and is no negative number) for a flag, so ``--size -128x128``
    was "argument --size: expected one argument", naming neither the value nor what a size must be; given to
    the flag, the value meets the flag's own check (``parse_size``: "expected WxH with positive integers"),
    and a text flag gets what was typed (``--negative -blurry``). A word that may be a flag is left alone:
    ``--anything``, and ``-n``, ``-n4`` and the like where the command has ``-n``; past ``--`` nothing is."""
    commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    at = next((i for i, word in enumerate(argv) if commands and word in commands.choices), None)
    if commands is None or at is None:
        return list(argv)
    flags = {f: a for a in commands.choices[argv[at]]._actions for f in a.option_strings}
    out = list(argv[: at + 1])
    words = iter(argv[at + 1 :])
    for word in words:
        action = flags.get(word)
        value = next(words, None) if action is not None and action.nargs is None else None
        if value is None:
            out.append(word)
            if word == "--":
                out.extend(words)
        elif value.startswith("-") and not value.startswith("--") and len(value) > 1 and value[:2] not in flags:
            out.append(f"{word}={value}")
        else:
            out += [word, value]
    return out


def parse_size(text: str) -> tuple[int, int]:
    """``WxH`` -> (width, height), read as the client reads ``size``; its message kept (argparse drops a
    ValueError's for "invalid parse_size value")."""
    try:
        return params.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def whole_number(text: str) -> int:
    """Any integer; the range is the daemon's to check and name (a seed's depends on ``-n``)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def int_between(low: int, high: int) -> Callable[[str], int]:
    """A whole number in [low, high], refused here rather than by the daemon, whose refusal names its
    query field and not the flag (``history --limit 100000``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return parse


def finite_float(text: str) -> float:
    """A number that JSON can carry: not ``nan`` nor ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def job_id_arg(text: str) -> str:
    """A job id as ``cancel`` takes it: an empty one would be ``DELETE /v1/jobs/``, which the daemon answers
    with a 404 about a path the user never typed."""
    if not text.strip():
        raise argparse.ArgumentTypeError("JOB_ID is empty; `diffusiond history` lists the jobs and their ids")
    return text.strip()


def lora_arg(text: str) -> dict[str, Any]:
    """``--lora NAME[:WEIGHT]`` -> one entry of the request's ``loras`` (weight 1 when left out)."""
    name, sep, weight = text.rpartition(":") if ":" in text else (text, "", "")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME or NAME:WEIGHT (e.g. ink:0.8), got {text!r}")
    if not sep:
        return {"name": name.strip(), "weight": 1.0}
    try:
        value = float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the weight in --lora {text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"the weight in --lora {text!r} is not a finite number")
    return {"name": name.strip(), "weight": value}


MODE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")  # a mode's number, or a name serve gave it


def control_arg(text: str) -> dict[str, Any]:
    """``--control NAME[@MODE]:IMAGE[:SCALE]`` -> one entry of the request's ``control`` (scale 1 when left
    out; the image is a local file, read and sent base64 by ``build_body``). ``@MODE`` picks a union
    ControlNet's control mode, by number or by the name ``serve --controlnet NAME=PATH,modes=...`` gave
    it: a ControlNet's name has no '@', so it cannot be mistaken for one. A SCALE of ``nan`` or ``inf``
    is refused, not read as part of the file's name."""
    name, sep, rest = text.partition(":")
    name, at, mode = name.partition("@")
    mode = mode.strip()
    if at and not (mode and set(mode) <= MODE_CHARS):
        raise argparse.ArgumentTypeError(f"the MODE in NAME@MODE is a union ControlNet's mode, its number or its "
                                         f"name (e.g. union@2:depth.png or union@depth:depth.png), got {text!r}")
    image, scale = rest, None
    head, colon, tail = rest.rpartition(":")
    if colon and head:
        try:
            scale = float(tail)
            image = head
        except ValueError:
            pass  # a ':' inside the file name
    if scale is not None and not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"the SCALE in {text!r} is not a finite number")
    if not sep or not name.strip() or not image:
        raise argparse.ArgumentTypeError(f"expected NAME:IMAGE or NAME:IMAGE:SCALE (e.g. edges:lines.png:0.8), "
                                         f"got {text!r}")
    entry: dict[str, Any] = {"name": name.strip(), "image": image}
    if scale is not None:
        entry["scale"] = scale
    if at:
        entry["mode"] = int(mode) if mode.isdigit() else mode
    return entry


def ip_adapter_arg(text: str) -> dict[str, Any]:
    """``--ip-adapter NAME:IMAGE[:SCALE]`` -> one entry of the request's ``ip_adapter``, read as ``--control`` is."""
    entry = control_arg(text)
    if "mode" in entry:
        raise argparse.ArgumentTypeError(f"--ip-adapter takes no @mode (a union ControlNet's), got {text!r}")
    return entry
