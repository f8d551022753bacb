"""The ``trajectory`` field of a job (issue 29, docs/api.md "Trajectories"): its shape and when it applies.

Apart from ``requests.py`` because it is a field with rules of its own (which samplers have a
log-probability), and that module is at its size.
"""

from __future__ import annotations

from typing import Any

import msgspec

from diffusiond.daemon.errors import invalid
from diffusiond.ipc.sidearrays import TrajectorySpec
from diffusiond.protocol import TRAJECTORY_DTYPES


class TrajectoryBody(msgspec.Struct, forbid_unknown_fields=True):
    """``trajectory``: what of the run each output brings back besides the picture (issue 29)."""

    latents: bool = True
    log_probs: bool = True
    dtype: str = "float32"


def check_trajectory(body: Any, scheduler: str | None, eta: float | None, *,
                     inpainting: bool = False) -> TrajectorySpec | None:
    """``trajectory``: the steps' log-probabilities exist only under a stochastic sampler, and the
    latents are recorded by the same one, so both need ``flow-sde`` or ``ddim`` with ``eta`` > 0.
    Not on inpainting: the pipelines paste the known region back into the latents after each step,
    so the latents a step hands on are not the ones its log-prob is of, and a trainer recomputing the
    log-probs from them would get other numbers with no sign why."""
    if body is None:
        return None
    if isinstance(body, dict):  # a caller in process (the fuzz tests); bodies arrive decoded
        try:
            body = msgspec.convert(body, TrajectoryBody)
        except msgspec.ValidationError as exc:
            raise invalid(f"trajectory: {exc}", field="trajectory") from None
    if not isinstance(body, TrajectoryBody):
        raise invalid("trajectory must be an object such as {\"latents\": true, \"log_probs\": true}",
                      field="trajectory")
    if not (body.latents or body.log_probs):
        raise invalid("trajectory asks for neither latents nor log_probs; set one of them true, or leave out "
                      "trajectory", field="trajectory")
    if body.dtype not in TRAJECTORY_DTYPES:
        raise invalid(f"trajectory.dtype must be one of {', '.join(TRAJECTORY_DTYPES)}, got {body.dtype!r}",
                      field="trajectory.dtype")
    if inpainting:
        raise invalid("trajectory is not available on inpainting (an image with a mask): after each step the "
                      "pipeline pastes the unmasked region back into the latents, so the returned latents would "
                      "not be the ones the log-probs are of; leave out trajectory, or the mask",
                      field="trajectory")
    if not (scheduler == "flow-sde" or (scheduler == "ddim" and eta)):
        what = "log_probs" if body.log_probs else "latents"
        named = "the model's default (send scheduler)" if scheduler is None else repr(scheduler)
        raise invalid(f"trajectory {what} need a stochastic sampler, and {named}"
                      f"{' with eta 0' if scheduler == 'ddim' else ''} is deterministic: use scheduler 'flow-sde' "
                      "(flow-matching models) or 'ddim' with eta > 0 (the others)",
                      field=f"trajectory.{what}")
    return TrajectorySpec(latents=body.latents, log_probs=body.log_probs, dtype=body.dtype)
