"""The kernels' floor (``diffusiond/bench/floor.py``, issue 31) records what a forward really calls.

A floor that missed a layer, or counted one twice, would tell a reader that a speed target is out of reach
(or within it) for the wrong reason. These tests run tiny pipelines under the recorder and check its counts
against hooks on every linear and convolution module, and its attention calls against the pipeline's SDPA
calls; then that the replay times every signature and sums them into the floor.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.parametrize("name", ["tiny", "tiny-flux"])
def test_the_recorder_counts_every_heavy_call(model_cache: Path, name: str) -> None:
    import torch
    import torch.nn.functional as F

    from diffusiond.bench.floor import KINDS, recorder, replay
    from diffusiond.ipc.messages import BatchParams
    from diffusiond.pipelines.ltx2 import as_served
    from diffusiond.pipelines.registry import load_pipeline

    pipeline = load_pipeline(name, device="cpu", dtype="float32")
    params = BatchParams(width=64, height=64, steps=2, guidance=pipeline.capabilities.guidance)
    reqs = as_served(pipeline.capabilities, "a fox", range(2), "")
    seen: Counter[str] = Counter()
    modules = [m for m in pipeline.pipe.components.values() if isinstance(m, torch.nn.Module)]

    def hook(kind: str) -> Any:
        def count(*_: Any) -> None:
            seen[kind] += 1
        return count

    hooks = [m.register_forward_pre_hook(hook("linear" if isinstance(m, torch.nn.Linear) else "conv"))
             for c in modules for m in c.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    sdpa = F.scaled_dot_product_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen["attention"] += 1
        return sdpa(*args, **kwargs)

    calls: Counter[Any] = Counter()
    mode = recorder(calls)  # made first: it knows SDPA as torch's function, not the counting one
    try:
        F.scaled_dot_product_attention = counted  # diffusers looks it up on the module at each call
        with torch.inference_mode(), mode:
            pipeline.run(params, reqs, lambda step, total: True)
    finally:
        F.scaled_dot_product_attention = sdpa
        for h in hooks:
            h.remove()
    recorded = Counter({k: sum(n for c, n in calls.items() if c.kind == k) for k in KINDS})
    assert seen["linear"] and seen["conv"] and seen["attention"], seen  # the pipeline does all three
    for kind in ("linear", "conv", "attention"):
        assert recorded[kind] == seen[kind], (kind, recorded, seen)
    floor = replay(calls, "cpu", repeats=1, budget_s=0.001)
    assert floor.calls == sum(calls.values()) and len(floor.signatures) == len(calls)
    assert all(s.seconds > 0 for s in floor.signatures)
    assert floor.seconds == pytest.approx(sum(s.count * s.seconds for s in floor.signatures))
    # the FLOPs of the products are counted per call: a linear layer's 2·M·K·N at least
    assert floor.flops > 0 and floor.summary()["kinds"]["linear"]["seconds"] > 0
