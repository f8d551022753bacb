"""Does a GGUF transformer trace under the daemon's regional compile? (issue 28, before spending GPU time on it)

    PYTHONPATH=. python scripts/check_gguf_compile.py [--qtype Q8_0]

diffusers dequantizes a GGUF layer's weight with separate torch ops on every forward (0.72x of bf16 for
FLUX Q8_0 on the H200, docs/benchmarks.md); compiled, inductor can fuse them. This writes tests/fluxkit.py's tiny
FLUX transformer as GGUF, loads it back through diffusers' GGUF support as the daemon's loader does, runs one
forward eager, then ``compile_repeated_blocks(fullgraph=True)`` as ``serve --compile`` does for a transformer,
and prints the compiled forward's largest difference from the eager one (float32, CPU).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qtype", default="Q8_0", choices=["Q8_0", "Q4_0"])
    a = ap.parse_args()
    import diffusers
    import torch
    from fluxkit import tiny_transformer, write_gguf

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        t = tiny_transformer()
        path, cfg = Path(tmp) / "t.gguf", Path(tmp) / "config"
        write_gguf(t, path, a.qtype)
        t.save_config(str(cfg))
        m = diffusers.FluxTransformer2DModel.from_single_file(
            str(path), config=str(cfg), torch_dtype=torch.float32,
            quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32))
    c = m.config
    kw = {"hidden_states": torch.randn(1, 16, c.in_channels),
          "encoder_hidden_states": torch.randn(1, 8, c.joint_attention_dim),
          "pooled_projections": torch.randn(1, c.pooled_projection_dim), "timestep": torch.tensor([0.5]),
          "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3),
          "guidance": torch.tensor([3.5]) if c.guidance_embeds else None, "return_dict": False}
    with torch.no_grad():
        eager = m(**kw)[0]
        m.compile_repeated_blocks(fullgraph=True)
        compiled = m(**kw)[0]
    diff = (compiled - eager).abs().max().item()
    print(f"{a.qtype}: compiled (regional, fullgraph) max |compiled - eager| = {diff:.2e}")


if __name__ == "__main__":
    main()
