"""What travels beside an output in its own region of shared memory: a run's trajectory (issue 29) and a
model's sound track (issue 30).

Both are small arrays a client wants next to the picture, kept as long as the job is (an encoded output's
slot goes back long before), so they share one region per output, laid out in ``protocol.SIDE_ARRAYS``' order,
held, pinned, spilled, written to the state dir and given back as one.
"""

from __future__ import annotations

import msgspec

from diffusiond.ipc.tensors import TensorDesc
from diffusiond.protocol import TrajectoryDtype


class TrajectorySpec(msgspec.Struct, frozen=True, kw_only=True):
    """What of a run's trajectory each output carries back (issue 29): the latents before and after
    every step (in ``dtype``), the steps' log-probabilities; their timesteps and sigmas always."""

    latents: bool = True
    log_probs: bool = True
    dtype: TrajectoryDtype = "float32"


class TrajectoryDesc(msgspec.Struct, frozen=True, kw_only=True):
    """Where one output's side arrays lie (its trajectory's, and its sound track's ``audio``): ``region``
    (uint8, one slot, or one dedicated memfd) holds every array; each of ``arrays`` lies inside it (same
    slot id; offsets into the same mapping). The region is held, shared and given back as one, like an
    output's tensor."""

    region: TensorDesc
    arrays: dict[str, TensorDesc]
