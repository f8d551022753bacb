"""A one-line progress bar for ``diffusiond generate``, drawn on stderr.

No dependency (tqdm and friends would be the CLI's only reason to need them). The bar is drawn
only on a terminal: when stderr is a file or a pipe, carriage-return animation is noise in
someone's log. There a plain line comes now and then instead (``job j_... step 5/20 (25 %)``),
at each tenth of the steps but at most once a second, and at least every ``LOG_EVERY_S`` while
steps come: a five-minute job in a script's log must not look hung. Before and after the steps, a
line names each stage the job enters (``job j_... loading``, ``waiting_for_memory``, ``computing`` until its
first step ends, ``encoding``) and again every ``LOG_EVERY_S`` while it stays there (``tick``): a model loading
for minutes, or a first step that takes them, is no quieter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

WIDTH = 30
LOG_EVERY_S = 5.0
"""On a stream that is not a terminal, a progress line at least this often while steps come."""
LOG_MIN_GAP_S = 1.0
"""...and at most once in this long, so a fast job writes a line or two, not one per step."""


def render(step: int, total: int, stage: str = "", width: int = WIDTH) -> str:
    """The bar's text, without the leading carriage return: ``[#####.....] 7/20 steps``."""
    total = max(0, int(total))
    step = min(max(0, int(step)), total) if total else max(0, int(step))
    filled = round(width * step / total) if total else 0
    text = f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} steps"
    return f"{text}  {stage}" if stage else text


class ProgressBar:
    """Redraws one line in place; ``close()`` ends the line so later messages start clean."""

    def __init__(self, stream: TextIO, enabled: bool | None = None, *, lines: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        if enabled is None:
            isatty = getattr(stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.lines = not enabled if lines is None else lines  # plain lines now and then, off a terminal
        self.job_id = ""  # named in those lines (a log may hold several jobs)
        self._clock = clock
        self._logged_at: float | None = None
        self._logged: tuple[int, int] = (0, 0)
        self._step = 0
        self._total = 0
        self._stage = ""
        self._stage_since = 0.0  # when the job entered ``_stage``
        self._stage_logged: tuple[str, float] = ("", 0.0)  # the stage the last stage line named, and when
        self._drawn = 0  # length of the last line, to blank out leftovers of a longer one

    def update(self, step: int | None = None, total: int | None = None, stage: str | None = None) -> None:
        if step is not None:
            self._step = step
            if step > 0 and self._stage == "computing":  # its steps say it from now on
                self._stage = ""
        if total is not None:
            self._total = total
        if stage is not None:
            # Mid-compute the steps say it all; other stages (queued, encoding) are worth naming, and so is
            # computing before its first step ends, in a log (minutes for a large image on a CPU)
            first = stage == "computing" and self._step == 0 and self.lines
            stage = "" if stage in ("computing", "done") and not first else stage
            if stage != self._stage:
                self._stage, self._stage_since = stage, self._clock()
        self._draw()

    def tick(self) -> None:
        """Called every second or so while the job runs: off a terminal, a stage that lasts with no event
        (a load, a wait for memory or a turn) still gets a line every ``LOG_EVERY_S``."""
        if not self.enabled:
            self._line()

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
            self._line()
            return
        line = render(self._step, self._total, self._stage)
        self.stream.write("\r" + line + " " * max(0, self._drawn - len(line)))
        self.stream.flush()
        self._drawn = len(line)

    def _line(self) -> None:
        """A plain progress line when a new tenth of the steps is reached (at most once a second)
        or ``LOG_EVERY_S`` have passed since the last line; the first step always gets one. Outside the
        steps, the stage's line instead."""
        if self.lines and self._stage:
            self._stage_line()
            return
        if not self.lines or self._total <= 0 or self._step <= 0 or (self._step, self._total) == self._logged:
            return
        now = self._clock()
        if self._logged_at is not None:
            since = now - self._logged_at
            new_tenth = self._step * 10 // self._total > self._logged[0] * 10 // max(1, self._logged[1])
            if since < LOG_MIN_GAP_S or (not new_tenth and since < LOG_EVERY_S):
                return
        who = f"job {self.job_id} " if self.job_id else ""
        self.stream.write(f"{who}step {self._step}/{self._total} ({100 * self._step // self._total} %)\n")
        self.stream.flush()
        self._logged_at, self._logged = now, (self._step, self._total)

    def _stage_line(self) -> None:
        """``job j_... loading`` when the job enters a stage, then ``still loading (10 s)`` every ``LOG_EVERY_S``."""
        now = self._clock()
        named, at = self._stage_logged
        again = named == self._stage
        if again and now - at < LOG_EVERY_S:
            return
        who = f"job {self.job_id} " if self.job_id else ""
        text = f"still {self._stage} ({now - self._stage_since:.0f} s)" if again else self._stage
        self.stream.write(f"{who}{text}\n")
        self.stream.flush()
        self._stage_logged = (self._stage, now)

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0
