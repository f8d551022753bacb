"""Fused QKV projections (pipelines/fusion.py) on tiny transformers of the families the daemon serves.

``fp8=rowwise`` fuses each attention's query, key and value before quantizing, so the fusion runs on every such
load, not only under ``fuse_qkv=1``: a fused model must compute what the unfused one does, hold each weight once,
and a model whose fused processors would compute something else must be left apart (fp8) or refused
(``fuse_qkv=1``). The models are built small in code from diffusers' classes, with norm gains away from one so a
skipped norm shows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import diffusers
import pytest
import torch

from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.compile import CompiledPipeline
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.fusion import fuse_for_fp8, fuse_qkv
from diffusiond.pipelines.ip_adapter import IpAdapters


def pipeline_of(transformer: torch.nn.Module) -> Any:
    """A stand-in pipeline holding only its denoiser, as ``denoisers`` finds it (no pipeline-level fuse method)."""
    pipe = type("Pipeline", (), {})()
    pipe.transformer = transformer
    pipe.components = {"transformer": transformer}
    return pipe


def sd35(dual: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
        qk_norm="rms_norm", dual_attention_layers=(0,) if dual else ()).eval()
    for mod in model.modules():
        if "RMSNorm" in type(mod).__name__ and getattr(mod, "weight", None) is not None:
            torch.nn.init.uniform_(mod.weight, 0.2, 3.0)
    return model


def sd35_inputs() -> dict[str, Any]:
    return {"hidden_states": torch.randn(1, 4, 8, 8), "encoder_hidden_states": torch.randn(1, 8, 32),
            "pooled_projections": torch.randn(1, 32), "timestep": torch.tensor([500])}


def wan_i2v() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=32, image_dim=32,
        added_kv_proj_dim=32).eval()


def wan_inputs() -> dict[str, Any]:
    """512 text tokens: Wan's I2V processor takes what comes before the last 512 as the image's."""
    return {"hidden_states": torch.randn(1, 4, 1, 8, 8), "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 512, 32), "encoder_hidden_states_image": torch.randn(1, 4, 32)}


def flux() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=[4, 6, 6]).eval()


def flux_inputs() -> dict[str, Any]:
    return {"hidden_states": torch.randn(1, 16, 64), "encoder_hidden_states": torch.randn(1, 8, 32),
            "pooled_projections": torch.randn(1, 32), "timestep": torch.tensor([0.5]),
            "guidance": torch.tensor([3.5]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    torch.manual_seed(1)
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("build", "inputs", "fused"), [
    (flux, flux_inputs, True),
    (wan_i2v, wan_inputs, True),  # its image key and value too (to_added_kv), add_k_proj a weightless flag
    (lambda: sd35(dual=False), sd35_inputs, False),  # SD3's fused processor would skip the query and key norms
    (lambda: sd35(dual=True), sd35_inputs, False),
])  # fmt: skip
def test_fp8s_fusion_keeps_the_models_numbers_and_holds_each_weight_once(
        build: Callable[[], torch.nn.Module], inputs: Callable[[], dict[str, Any]], fused: bool) -> None:
    """SD3.5 fused gave another picture (Large) or failed every job (Medium); Wan 2.1 I2V held
    its image projections twice, uncounted by ``fit``."""
    model = build()
    apart = copy.deepcopy(model)
    args = inputs()
    assert (fuse_for_fp8(pipeline_of(model)) > 0) is fused
    assert count(model) == count(apart)
    assert torch.allclose(forward(model, args), forward(apart, args), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dual", [False, True])
def test_fuse_qkv_refuses_sd35_whose_fused_processor_would_skip_its_norms(dual: bool) -> None:
    """``fuse_qkv=1`` swaps in SD3's fused processor, which applies no query or key norm and reads the text's
    projections in attentions that have none: refused by name, not a changed or failing model."""
    with pytest.raises(PipelineError, match="fuse_qkv=1: Pipeline's transformer cannot fuse its QKV projections: "
                                            "its fused processor FusedJointAttnProcessor2_0 skips"):
        fuse_qkv(pipeline_of(sd35(dual)))


def test_fuse_qkv_holds_wan_i2vs_image_projections_once_and_keeps_its_numbers() -> None:
    """``fuse_qkv=1`` kept ``add_k_proj``/``add_v_proj`` beside the fused ``to_added_kv`` (about 4 GB
    of Wan 2.1 I2V 14B held twice); the processor reads ``add_k_proj`` only as a flag, which a stand-in keeps."""
    model = wan_i2v()
    apart = copy.deepcopy(model)
    args = wan_inputs()
    fuse_qkv(pipeline_of(model))
    assert any(hasattr(m, "to_added_kv") for m in model.modules()) and count(model) == count(apart)
    assert torch.allclose(forward(model, args), forward(apart, args), atol=1e-5, rtol=0)
    blind = copy.deepcopy(apart)  # the image branch counts in these inputs: without it the output moves
    for m in blind.modules():
        if getattr(m, "add_k_proj", None) is not None:
            m.add_k_proj = None
    assert not torch.allclose(forward(blind, args), forward(apart, args), atol=1e-3, rtol=0)


def test_an_ip_adapter_on_a_unet_model_with_fused_projections_is_refused_naming_the_option() -> None:
    """``fuse_qkv=1`` (with ``--compile``) deletes the separate projections diffusers' IP-Adapter
    processors read, so every job with a reference failed after a start that reported nothing."""
    pipe = load_pipeline("tiny", name="t", device="cpu", dtype="float32")
    compiled = CompiledPipeline(pipe, "default", {"compile_backend": "eager", "fuse_qkv": "1"})
    adapters = IpAdapters(compiled, {"style": ("/nonexistent/ip.safetensors", "/nonexistent/encoder")})
    assert adapters.errors["style"].startswith("model t runs with fuse_qkv=1, whose fused attentions keep no "
                                               "separate query, key and value projections")
