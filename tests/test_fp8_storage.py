"""``quant=...:fp8-storage`` as the layers' own cast (pipelines/fp8_storage.py), which replaced diffusers' layerwise
casting hooks (issue 28: 0.83x bf16 on FLUX.1-dev, and refused with ``--compile`` because dynamo recompiled the
hooks layer by layer). What a user depends on: the same numbers as diffusers' casting gave, the weights in one
byte between forwards, and a compiled model that compiles each block class once, with no graph break.
"""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel
from diffusers.hooks import apply_layerwise_casting
from torch._dynamo.utils import counters

from diffusiond.pipelines import fp8_storage
from diffusiond.pipelines.quant import _skipped


def transformer() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 16, generator=g),
            "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}


def run(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(**inputs(), return_dict=False)[0]
    return out


def test_the_same_numbers_as_diffusers_layerwise_casting_with_the_weights_in_one_byte() -> None:
    hooked, own = transformer(), transformer()
    apply_layerwise_casting(hooked, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32,
                            skip_modules_pattern=_skipped(hooked), skip_modules_classes=(torch.nn.Embedding,))
    layers = fp8_storage.apply(own, torch.float32, _skipped(own))
    assert torch.equal(run(own), run(hooked))
    stored = {n for n, p in own.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert stored == {n for n, p in hooked.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert len(stored) >= layers > 0 and "transformer_blocks.0.attn.to_q.weight" in stored
    assert "proj_out.weight" not in stored and not any(".norm" in n for n in stored)  # skipped: as loaded
    assert fp8_storage.compute_dtype(own) == torch.float32 and fp8_storage.compute_dtype(transformer()) is None


def compiled_graphs(model: torch.nn.Module) -> tuple[int, int]:
    """Dynamo's graphs and graph breaks for two runs of ``model``'s blocks compiled as the daemon compiles a DiT
    (``compile_repeated_blocks``, fullgraph), each run checked against the model's eager output."""
    want = run(model)
    torch._dynamo.reset()
    counters.clear()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    for _ in range(2):
        assert torch.equal(run(model), want)
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_compiled_blocks_compile_as_the_unquantized_model_does() -> None:
    """As many graphs as the bf16 model (a graph per block class, and the stride recompile diffusers' FLUX has of
    its own), none per layer, no graph break."""
    stored = transformer()
    fp8_storage.apply(stored, torch.float32, _skipped(stored))
    plain = compiled_graphs(transformer())
    assert compiled_graphs(stored) == plain and plain[1] == 0 and 2 <= plain[0] < 5
