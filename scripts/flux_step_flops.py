"""FLUX.1-dev's transformer FLOPs per step at 1024² (4096 image and 512 text tokens), counted on the meta device with
torch's FLOP counter: no weights, no GPU (docs/benchmarks.md, the first session of 2026-12-07).

    python scripts/flux_step_flops.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from diffusers import FluxTransformer2DModel
from torch.utils.flop_counter import FlopCounterMode

from diffusiond.pipelines import preset_tables as pt

cfg = pt.FLUX_DEV_PARTS["transformer"].config
with torch.device("meta"):
    m = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
    hs = torch.randn(1, 4096, cfg["in_channels"], dtype=torch.bfloat16)
    enc = torch.randn(1, 512, cfg["joint_attention_dim"], dtype=torch.bfloat16)
    pooled = torch.randn(1, cfg["pooled_projection_dim"], dtype=torch.bfloat16)
    t = torch.ones(1)
    g = torch.ones(1) * 3.5
    img_ids = torch.zeros(4096, 3)
    txt_ids = torch.zeros(512, 3)
    mode = FlopCounterMode(display=False)
    with mode, torch.inference_mode():
        m(hidden_states=hs, encoder_hidden_states=enc, pooled_projections=pooled, timestep=t, guidance=g,
          img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
tot = mode.get_total_flops()
print("per step TFLOP", tot/1e12, "28 steps PFLOP", 28*tot/1e15)
for k, v in sorted(mode.get_flop_counts()["Global"].items(), key=lambda kv: -kv[1])[:6]:
    print(k, v/1e12)
