"""The ``generate`` flag behind each request field, so a refusal the daemon words for its HTTP API names the
flag a CLI user gives (``field mask: --mask``) rather than leaving them to guess.

Apart from ``generate.py`` because ``cli.py`` prints the daemon's refusals, and from ``client/`` because only
the command line has flags.
"""

from __future__ import annotations

import re

__all__ = ["FLAG_OF", "with_flag"]

FLAG_OF = {
    "model": "--model", "n": "-n", "width": "--size", "height": "--size", "size": "--size", "steps": "--steps",
    "guidance_scale": "--guidance", "negative_prompt": "--negative", "seed": "--seed", "output_format": "--format",
    "num_frames": "--frames", "fps": "--fps", "audio": "--no-audio", "timeout_s": "--timeout", "loras": "--lora",
    "strength": "--strength", "upscale": "--upscale", "hires": "--hires", "keep_alive": "--keep-alive",
    "image": "--image", "image_path": "--image", "images": "--image", "mask": "--mask", "mask_path": "--mask",
    "control": "--control", "ip_adapter": "--ip-adapter", "preview": "--preview",
}
"""Request field (its top level: ``control[0].image`` is ``control``'s) -> the ``generate`` flag that sets it."""


def with_flag(text: str, field: str | None, output: str | None = None) -> str:
    """``text`` (a refusal as ``DaemonError`` prints it: ``... (invalid_request, HTTP 400, field mask)``) with the
    flag of its field beside the field's name. ``output``: the ``-o`` given without ``--format``, whose extension
    then chose the format, so a refused format names it rather than a --format never given."""
    top = re.split(r"[\[.]", field, maxsplit=1)[0] if field else None
    flag = FLAG_OF.get(top) if top else None
    if top == "output_format" and output:
        flag = f"-o {output}'s extension (or --format)"
    return text if flag is None else text.replace(f"field {field}", f"field {field}: {flag}", 1)
