"""The two exceptions a pipeline raises, the one-line reason an adapter does not fit, and the first cause of a
failure that libraries wrapped, in a module without torch.

They live apart from ``base`` so that code which only reads model specs (the daemon's config, the
CLI) can raise and catch them without loading torch.
"""

from __future__ import annotations


class PipelineError(Exception):
    """A model could not be loaded or a request cannot run; the message says what to do."""


class HalfApplied(RuntimeError):
    """A live update failed after the first byte was written (a copy, or a compiled model's hot-swap): the weights
    hold parts of two versions, which no refusal can undo. The worker reports it and exits, and its replacement
    starts from the files and the updates accepted before. Here, not in the worker, because a
    pipeline's adapters raise it too, and pipelines know nothing of the processes."""


class Interrupted(Exception):
    """The step callback asked to stop (every request of the batch was cancelled)."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(f"stopped at step {step} of {total}")
        self.step = step
        self.total = total


def root_cause(exc: BaseException) -> BaseException:
    """The first exception of ``exc``'s chain: diffusers and transformers wrap the one that says what is wrong
    (safetensors' "file not fully covered" lay three exceptions down, under "Unable to load weights")."""
    root, seen = exc, {id(exc)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(nxt))
    return root


# diffusers' advice to whoever calls its loaders, not to someone choosing an adapter for a model
_LOADER_ADVICE = ("If you want to instead overwrite randomly initialized weights",)
MAX_REASON_CHARS = 400


def fit_reason(exc: BaseException) -> str:
    """Why an adapter (LoRA, IP-Adapter, ControlNet) does not fit a model, in one readable line.

    The reason is shown in ``GET /v1/loras``, ``/v1/ip-adapters`` and ``/v1/controlnets`` and in the 400
    of every request naming the pair, but torch's ``load_state_dict`` error lists every mismatched tensor, one per
    line (an SD 1.5 LoRA on SDXL: dozens). The first mismatch says what is wrong as well as all of
    them, so it is kept (joined to the header line that names the module) with a count of the rest.
    """
    text = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    first, rest = lines[0], lines[1:]
    if first.endswith(":") and rest:  # "Error(s) in loading state_dict for X:" says nothing alone
        first = f"{first} {rest.pop(0)}"
    for advice in _LOADER_ADVICE:
        first = first.split(advice, 1)[0]
    first = " ".join(first.split())  # and "Cannot load  because", where diffusers had no name to give
    if len(first) > MAX_REASON_CHARS:
        first = first[:MAX_REASON_CHARS].rstrip() + "..."
    if rest:
        what = "tensors" if all(line.startswith("size mismatch for ") for line in rest) else "lines"
        first = f"{first.rstrip('.')} ... and {len(rest)} more {what}"
    return first
