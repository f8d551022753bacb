"""The step caches (``cache=fbc|taylorseer``, pipelines/speedups.py) across a failed forward, and their
place among the options ``--compile`` refuses.

A cache hook keeps state between the denoiser's calls of one generation; diffusers resets it at the
end of a pipeline call, which a forward that raises (an out-of-memory in the denoise loop or the VAE
decode, a preview that fails) never reaches. The worker then retries the batch in halves, or runs
the next one, on the failed batch's state. The failure here is injected as the worker's step
callback raising mid-loop, which is how an error inside the forward reaches the pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline

PARAMS = m.BatchParams(width=64, height=64, steps=4, guidance=3.5)


@pytest.fixture(autouse=True)
def _cache(model_cache: Path) -> None:
    """tiny-flux is built once for the session."""


def run(pipe: object, seeds: list[int], fail_at: int = 0) -> torch.Tensor:
    def on_step(step: int, _total: int) -> bool:
        if step == fail_at:
            raise RuntimeError("injected: out of memory in the denoise loop")
        return True

    reqs = [m.RequestSpec(request_id=str(s), prompt=f"a red fox {s}", seed=s) for s in seeds]
    with torch.inference_mode():
        return torch.stack(pipe.run(PARAMS, reqs, on_step))  # type: ignore[attr-defined]


def test_a_failed_batch_leaves_no_cache_state_behind() -> None:
    """The batch after a failed one (here: its own retry at half the size) gives the output a fresh
    model gives, not one computed from the failed batch's cached features."""
    pipe = load_pipeline("tiny-flux", device="cpu", dtype="float32", options={"cache": "taylorseer:2"})
    fresh = run(pipe, [7])
    with pytest.raises(RuntimeError, match="injected"):
        run(pipe, [7, 8], fail_at=2)
    assert torch.equal(run(pipe, [7]), fresh)
