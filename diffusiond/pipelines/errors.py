"""The two exceptions a pipeline raises, in a module without torch.

They live apart from ``base`` so that code which only reads model specs (the daemon's config, the
CLI) can raise and catch them without loading torch.
"""

from __future__ import annotations


class PipelineError(Exception):
    """A model could not be loaded or a request cannot run; the message says what to do."""


class Interrupted(Exception):
    """The step callback asked to stop (every request of the batch was cancelled)."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(f"stopped at step {step} of {total}")
        self.step = step
        self.total = total
