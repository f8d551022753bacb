"""``generate --upscale NAME[:SCALE]`` and ``--hires SCALE[:STRENGTH[:STEPS[:UPSCALER]]]``: the request's
``upscale`` and ``hires`` fields (docs/api.md), written the way A1111's hires options read."""

from __future__ import annotations

import argparse
import math
from typing import Any


def upscale_arg(text: str) -> dict[str, Any]:
    """``NAME[:SCALE]`` -> ``{"name", "scale"?}``; the model's own scale when SCALE is left out."""
    name, sep, scale = text.partition(":")
    if not name.strip() or (sep and not scale):
        raise argparse.ArgumentTypeError(f"expected NAME or NAME:SCALE (e.g. esrgan:2), got {text!r}")
    entry: dict[str, Any] = {"name": name.strip()}
    if sep:
        entry["scale"] = _number(scale, "scale", text, float)
    return entry


def hires_arg(text: str) -> dict[str, Any]:
    """``SCALE[:STRENGTH[:STEPS[:UPSCALER]]]`` -> ``{"scale", "strength"?, "steps"?, "upscaler"?}``."""
    parts = text.split(":")
    if len(parts) > 4 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected SCALE[:STRENGTH[:STEPS[:UPSCALER]]] (e.g. 2:0.5:20:esrgan), "
                                         f"got {text!r}")
    entry: dict[str, Any] = {"scale": _number(parts[0], "scale", text, float)}
    if len(parts) > 1:
        entry["strength"] = _number(parts[1], "strength", text, float)
    if len(parts) > 2:
        entry["steps"] = _number(parts[2], "steps", text, int)
    if len(parts) > 3:
        entry["upscaler"] = parts[3]
    return entry


def _number(value: str, what: str, text: str, kind: type[float] | type[int]) -> Any:
    """``nan`` and ``inf`` are refused here: ``float()`` reads them, JSON cannot carry them."""
    try:
        number = kind(value)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"the {what} in {text!r} is not {noun}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"the {what} in {text!r} is not a finite number")
    return number
