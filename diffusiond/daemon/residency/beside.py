"""What a model's worker keeps on its device beside the pipeline, from the files' headers, before it loads.

Each worker loads every configured ControlNet, IP-Adapter (its weights and image encoder) and upscaler once and
keeps them on its device (worker/process.py counts them in its READY figure). ``offload=auto`` and
``offload=stream``'s plan choose at the start from the budget, so they take these out of it first: a stream plan
fills what it is given with resident blocks, and a 6.6 GB union ControlNet beside FLUX.1-dev in 24 GiB left
1.4 GiB for activations when it was not counted (review52-a 1). Every configured one is counted, including those
a worker finds do not fit its model (it names them, after loading them): the count errs high, which costs
resident blocks, not a failed job. A file whose size the headers cannot tell (an upscaler's ``.pth``, a pickle the
engine does not open) makes the whole figure unknown, and auto then keeps to what leaves the budget to activations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from diffusiond.daemon.residency.sizes import WeightsError, model_weights
from diffusiond.daemon.residency.units import format_bytes

UPSCALER_DTYPE = "float32"  # pipelines/upscalers.py runs them in float32, whatever the model's dtype


@dataclass(frozen=True)
class Beside:
    """The bytes kept beside the pipeline on each of its devices (None: not known from the headers), and what."""

    nbytes: int | None = 0
    what: str = ""

    def note(self, budget: int | None) -> str:
        """Words for the start's offload reason: where the budget the plan was given came from."""
        if not self.nbytes or budget is None:
            return ""
        return f" (the --device-memory budget of {format_bytes(budget)} less {self.what}, kept beside it)"


NOTHING_BESIDE: Final = Beside()


def beside(controlnets: Iterable[str], ip_adapters: Iterable[tuple[str, str]], upscalers: Iterable[str],
           dtype: str) -> Beside:
    """ControlNets' paths, IP-Adapters' (weights, image encoder) and upscalers' paths, at the model's ``dtype``
    (upscalers at theirs)."""
    counted: dict[str, int] = {}
    try:
        for path in controlnets:
            _add(counted, "ControlNets", model_weights(path, dtype).bytes_at(dtype))
        for weights, encoder in ip_adapters:
            _add(counted, "IP-Adapters", model_weights(weights, dtype).bytes_at(dtype)
                 + model_weights(encoder, dtype).bytes_at(dtype))
        for path in upscalers:
            _add(counted, "upscalers", model_weights(path, UPSCALER_DTYPE).bytes_at(UPSCALER_DTYPE))
    except WeightsError as exc:
        return Beside(None, f"what is configured beside the model, whose size its files do not tell ({exc})")
    return Beside(sum(counted.values()), _words(counted))


def _add(counted: dict[str, int], kind: str, nbytes: int) -> None:
    counted[kind] = counted.get(kind, 0) + nbytes


def _words(counted: Mapping[str, int]) -> str:
    return " and ".join(f"the {kind}' {format_bytes(n)}" for kind, n in counted.items())
