"""A one-line progress bar for ``diffusiond generate``, drawn on stderr.

No dependency (tqdm and friends would be the CLI's only reason to need them), and it draws only on a
terminal: when stderr is a file or a pipe, carriage-return animation is noise in someone's log.
"""

from __future__ import annotations

from typing import TextIO

WIDTH = 30


def render(step: int, total: int, stage: str = "", width: int = WIDTH) -> str:
    """The bar's text, without the leading carriage return: ``[#####.....] 7/20 steps``."""
    total = max(0, int(total))
    step = min(max(0, int(step)), total) if total else max(0, int(step))
    filled = round(width * step / total) if total else 0
    text = f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} steps"
    return f"{text}  {stage}" if stage else text


class ProgressBar:
    """Redraws one line in place; ``close()`` ends the line so later messages start clean."""

    def __init__(self, stream: TextIO, enabled: bool | None = None) -> None:
        self.stream = stream
        if enabled is None:
            isatty = getattr(stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._step = 0
        self._total = 0
        self._stage = ""
        self._drawn = 0  # length of the last line, to blank out leftovers of a longer one

    def update(self, step: int | None = None, total: int | None = None, stage: str | None = None) -> None:
        if step is not None:
            self._step = step
        if total is not None:
            self._total = total
        if stage is not None:
            # Mid-compute the steps say it all; other stages (queued, encoding) are worth naming.
            self._stage = "" if stage in ("computing", "done") else stage
        self._draw()

    def update_from_job(self, job: dict[str, object]) -> None:
        progress = job.get("progress")
        step = total = None
        if isinstance(progress, dict):
            step, total = progress.get("step"), progress.get("total")
        stage = job.get("stage")
        self.update(
            step if isinstance(step, int) else None,
            total if isinstance(total, int) else None,
            stage if isinstance(stage, str) else None,
        )

    def complete(self) -> None:
        """Fill the bar: a finished job's final snapshot may not repeat its last step count."""
        self.update(self._total, stage="")

    def _draw(self) -> None:
        if not self.enabled:
            return
        line = render(self._step, self._total, self._stage)
        self.stream.write("\r" + line + " " * max(0, self._drawn - len(line)))
        self.stream.flush()
        self._drawn = len(line)

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0
