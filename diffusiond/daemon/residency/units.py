"""Sizes and durations as people write them in flags, TOML and request bodies.

The grammar follows what users already type elsewhere: sizes like ``--device-memory 20GiB`` or ``0.8`` (a
share of the device), durations like Ollama's ``keep_alive`` (``5m``, ``1h30m``, ``0``, ``-1``). Every error
is a ``ValueError`` whose message quotes the text and lists the accepted forms, because these messages go
back unchanged as the CLI's complaint or an HTTP 400 body.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

FOREVER: Final = math.inf
"""The duration that never ends (``-1`` or any negative): a model kept with it never expires."""

HORIZON_S: Final = 100 * 365.25 * 86400
"""Durations past this (a hundred years) are ``FOREVER``: a deadline that far off means the same thing,
and a time of day for it (``time.localtime`` in ``diffusiond ps``, a ``Date`` on the web page) overflows
somewhere past year 9999, so a client's ``keep_alive`` of 1e17 would break the tools that show it."""

# Long enough for any real value, short enough that no number in it can be expensive to convert.
_MAX_TEXT: Final = 64

_SIZE_UNITS: Final[dict[str, int]] = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_FORMS: Final = ("bytes as a whole number (2147483648), a number with a unit: K/M/G/T (powers of 1000) or "
                      "KiB/MiB/GiB/TiB (powers of 1024), e.g. 20GiB or 1.5G, or a share of the device's total "
                      "memory written with a decimal point, 0 < share <= 1 (0.8)")
_SIZE_RE: Final = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")

_DURATION_UNITS: Final[dict[str, float]] = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0,
}
_DURATION_FORMS: Final = ("a number of seconds (300, 2.5), a duration with units ns/us/ms/s/m/h such as 5m, 30s, "
                          "1h30m or 250ms, 0 to leave at once, or -1 (any negative) to stay forever")
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


@dataclass(frozen=True)
class Size:
    """A memory size as written: either a number of bytes, or a share of a total not known yet.

    A flag such as ``--device-memory 0.8`` is parsed before any device has been looked at; the share
    waits here until the engine knows each device's total and calls ``resolve``.
    """

    nbytes: int | None = None
    share: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.share is None):
            raise ValueError("a Size is either bytes or a share, exactly one of them")
        if self.nbytes is not None and self.nbytes < 0:
            raise ValueError(f"a size cannot be negative, got {self.nbytes} bytes")
        if self.share is not None and not 0.0 < self.share <= 1.0:
            raise ValueError(f"a share of the device must be 0 < share <= 1, got {self.share}")

    def resolve(self, total: int | None) -> int:
        """The bytes this size means on a device with ``total`` bytes (needed only for a share)."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.share is not None
        if total is None:
            raise ValueError(f"{self} is a share of the device's memory, and this device's total is not known; "
                             "give the size in bytes instead (e.g. 20GiB)")
        return int(total * self.share)

    def __str__(self) -> str:
        return f"{self.share:g} of the device" if self.share is not None else format_bytes(self.nbytes or 0)


def parse_size(value: str | int | float) -> Size:
    """A size from a flag or a TOML value.

    A plain integer is bytes; a number with a decimal point and no unit is a share of the device, so
    ``1`` is one byte and ``1.0`` the whole device (TOML hands integers and floats over already typed, and
    the same rule applies to them).
    """
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is a boolean; expected {_SIZE_FORMS}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative; expected {_SIZE_FORMS}")
        return Size(nbytes=value)
    if isinstance(value, float):
        return _share(value, repr(value))
    text = str(value)
    if len(text) > _MAX_TEXT:
        raise ValueError(f"size {text[:_MAX_TEXT]!r}... is too long to be a size; expected {_SIZE_FORMS}")
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"size {text!r} is not a size; expected {_SIZE_FORMS}")
    number, unit = match.group(1), match.group(2).lower()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} has an unknown unit {match.group(2)!r}; expected {_SIZE_FORMS}")
    if not unit and "." in number:
        return _share(float(number), repr(text))
    if "." not in number:
        return Size(nbytes=int(number) * _SIZE_UNITS[unit])
    return Size(nbytes=int(float(number) * _SIZE_UNITS[unit]))


def _share(value: float, shown: str) -> Size:
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"size {shown} is a share of the device's memory and must be 0 < share <= 1 "
                         f"(write whole bytes without a decimal point); expected {_SIZE_FORMS}")
    return Size(share=value)


def parse_duration(value: str | int | float) -> float:
    """Seconds from an Ollama-style duration; ``FOREVER`` (``math.inf``) for any negative value.

    Negative means forever whatever its size (``-1``, ``-5m``), as in Ollama, so a script that writes
    ``-1s`` gets what it meant rather than an error; so is anything past ``HORIZON_S``.
    """
    if isinstance(value, bool):
        raise ValueError(f"duration {value!r} is a boolean; expected {_DURATION_FORMS}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"duration {value!r} is not finite; expected {_DURATION_FORMS}")
        return FOREVER if value < 0 or value > HORIZON_S else float(value)
    text = str(value).strip()
    if len(text) > _MAX_TEXT:
        raise ValueError(f"duration {text[:_MAX_TEXT]!r}... is too long to be a duration; expected {_DURATION_FORMS}")
    body = text[1:] if text[:1] in "+-" else text
    if not body:
        raise ValueError(f"duration {text!r} is empty; expected {_DURATION_FORMS}")
    if re.fullmatch(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", body):  # 300, 2.5, 1e17 (api.md's forever)
        seconds = float(body)
    else:
        pos, seconds = 0, 0.0
        for part in _DURATION_PART.finditer(body):
            if part.start() != pos:
                break
            seconds += float(part.group(1)) * _DURATION_UNITS[part.group(2)]
            pos = part.end()
        if pos != len(body) or pos == 0:
            raise ValueError(f"duration {text!r} is not a duration; expected {_DURATION_FORMS}")
    if (text.startswith("-") and seconds > 0) or seconds > HORIZON_S:
        return FOREVER
    return seconds


def format_bytes(n: int) -> str:
    """Bytes for a person reading an error or a log line: binary units, as ``--device-memory`` takes them.
    An exbibyte or more is only ever what is left of no budget at all (``budget.NO_BUDGET``), so it says so,
    without saying why: that is a device whose memory cannot be read, or a host without ``--host-memory``,
    and the budget's own source (the start log) names which."""
    if n >= 1 << 60:
        return "unbounded"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{n} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"


def format_duration(seconds: float) -> str:
    """A duration as it would be written back in a flag (``5m``, ``1h30m``, ``forever``)."""
    if seconds == FOREVER:
        return "forever"
    if seconds < 1:
        return f"{seconds * 1000:g}ms" if seconds else "0s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    frac = seconds - whole
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "",
             f"{secs + frac:g}s" if secs or frac else ""]
    return "".join(parts)
