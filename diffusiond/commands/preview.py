"""``diffusiond generate --preview``: the latest preview drawn in the terminal, where it can show images.

Two inline-image protocols cover the terminals people run this in, and the environment says
which one is there: kitty's graphics protocol (kitty sets ``TERM=xterm-kitty`` and
``KITTY_WINDOW_ID``; it takes PNG, so the CLI asks for PNG previews) and iTerm2's (iTerm2 sets
``TERM_PROGRAM=iTerm.app`` and ``LC_TERMINAL=iTerm2``, WezTerm ``TERM_PROGRAM=WezTerm``; they
take JPEG). Sixel terminals cannot be told from the environment (only by querying the terminal,
which needs raw mode and a reply), so they, and every other terminal, get nothing extra: no
escape codes in a terminal that would print them as garbage, or in a file.

The picture keeps a fixed box of ``ROWS`` lines above the progress bar and is redrawn in place;
the daemon's base64 goes out as it came, so the CLI decodes no image (no Pillow here).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Literal, TextIO

Protocol = Literal["kitty", "iterm2"]
ROWS = 12
PREVIEW_FORMAT: dict[Protocol, str] = {"kitty": "png", "iterm2": "jpeg"}
KITTY_IMAGE_ID = 7251  # one id, so each preview replaces the last one's picture
_KITTY_CHUNK = 4096  # the protocol's limit for one escape code's payload


def image_protocol(env: Mapping[str, str] | None = None) -> Protocol | None:
    """Which inline-image protocol the terminal speaks, if the environment can tell."""
    env = os.environ if env is None else env
    if env.get("TERM") == "xterm-kitty" or env.get("KITTY_WINDOW_ID"):
        return "kitty"
    if env.get("TERM_PROGRAM") in ("iTerm.app", "WezTerm") or env.get("LC_TERMINAL") == "iTerm2":
        return "iterm2"
    return None


def kitty_image(b64: str, rows: int = ROWS) -> str:
    """Transmit-and-show a PNG at the cursor, ``rows`` lines high, without moving the cursor."""
    chunks = [b64[i : i + _KITTY_CHUNK] for i in range(0, len(b64), _KITTY_CHUNK)] or [""]
    head = f"a=T,f=100,i={KITTY_IMAGE_ID},q=2,C=1,r={rows}"

    def parts() -> Iterator[str]:
        for k, chunk in enumerate(chunks):
            more = int(k < len(chunks) - 1)
            keys = f"{head},m={more}" if k == 0 else f"m={more}"
            yield f"\x1b_G{keys};{chunk}\x1b\\"

    return "".join(parts())


def iterm2_image(b64: str, nbytes: int, rows: int = ROWS) -> str:
    """An inline image ``rows`` lines high (iTerm2's OSC 1337 File, also WezTerm's)."""
    return f"\x1b]1337;File=inline=1;size={nbytes};height={rows};preserveAspectRatio=1:{b64}\x07"


class PreviewPane:
    """Draws each new preview in the box above the progress bar's line, in place."""

    def __init__(self, stream: TextIO, protocol: Protocol, rows: int = ROWS) -> None:
        self.stream = stream
        self.protocol = protocol
        self.rows = rows
        self.reserved = False
        self.step = -1

    def show(self, data: dict[str, object]) -> None:
        image, step = data.get("image"), data.get("step")
        if not isinstance(image, str) or not isinstance(step, int) or step <= self.step or data.get("index", 0) != 0:
            return  # one picture: the first output's newest
        self.step = step
        out = []
        if not self.reserved:  # leave the bar's line, make room below it; the bar goes on under the box
            out.append("\r\n" + "\n" * self.rows)
            self.reserved = True
        out.append(f"\x1b7\x1b[{self.rows}A\r")  # save the cursor; up to the box's first line
        if self.protocol == "kitty":
            out.append(kitty_image(image, self.rows))
        else:
            out.append(iterm2_image(image, len(image) * 3 // 4, self.rows))
        out.append("\x1b8")  # back to the bar's line
        self.stream.write("".join(out))
        self.stream.flush()


def pane_for(stream: TextIO, env: Mapping[str, str] | None = None) -> PreviewPane | None:
    """A pane when ``stream`` is a terminal that shows images; else None (nothing extra)."""
    isatty = getattr(stream, "isatty", None)
    protocol = image_protocol(env)
    if protocol is None or not (isatty and isatty()):
        return None
    return PreviewPane(stream, protocol)
