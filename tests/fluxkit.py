"""A tiny FLUX pipeline built in code, and GGUF files of its transformer, for the CPU tests of issue 28.

FLUX is the architecture the GGUF checkpoints users download are made of (city96's flux1-dev-Q8_0.gguf and
the like); a real one is 12 GB, so the tests build the same classes at a few hundred kB: FluxPipeline with
a FluxTransformer2DModel, CLIP and T5 text encoders, an AutoencoderKL and a flow-matching scheduler, the
tokenizers generated in code like the embedded models'. The GGUF writer keeps diffusers' tensor names
(diffusers loads both those and the original BFL names) and quantizes every 2-D weight whose rows are a
whole number of blocks, the rule llama.cpp's own converters follow; the rest stays F32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffusiond.pipelines.gen_tokenizers import clip_tokenizer, t5_tokenizer

TRANSFORMER = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
               "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
               "axes_dims_rope": [4, 6, 6]}


def tiny_transformer() -> Any:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(**TRANSFORMER)


def build_flux(out: Path) -> Path:
    """A tiny FluxPipeline saved (safetensors) in ``out``; 64x64 images in 2 steps take a second on a CPU."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok = clip_tokenizer(1024, max_length=77)
    t5_tok = t5_tokenizer(1024, extra_ids=0, max_length=64)
    with torch.random.fork_rng(devices=[]):
        transformer = tiny_transformer()
        torch.manual_seed(0)
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=77, projection_dim=32, bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id))
        torch.manual_seed(0)
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id))
        torch.manual_seed(0)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32,),
                            down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                            layers_per_block=1, norm_num_groups=32, sample_size=32, shift_factor=0.0,
                            scaling_factor=1.0)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def write_gguf(module: torch.nn.Module, path: Path, qtype: str = "Q8_0") -> dict[str, int]:
    """``module``'s state dict as a GGUF file: 2-D weights quantized to ``qtype`` where their rows are whole
    blocks, the rest F32. Returns each tensor's bytes as stored (what the tests check ``fit`` against)."""
    return write_tensors(module.state_dict(), path, qtype)


def bfl_state_dict(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel's weights under the original BFL names and layouts, as city96's GGUFs and BFL's
    own safetensors hold them (``prefix="model.diffusion_model."``: ComfyUI's): the inverse of diffusers'
    ``convert_flux_transformer_checkpoint_to_diffusers``, so attention's q, k, v are fused into one ``qkv``
    (with the MLP input, ``linear1``, in a single block) and the final norm's scale and shift are swapped."""
    sd = {k: v.detach() for k, v in module.state_dict().items()}
    out: dict[str, torch.Tensor] = {}

    def put(bfl: str, *diffusers: str, swap: bool = False) -> None:
        for suffix in ("weight", "bias"):
            parts = [sd.pop(f"{d}.{suffix}") for d in diffusers]
            joined = torch.cat(parts)
            if swap:
                scale, shift = joined.chunk(2)
                joined = torch.cat([shift, scale])
            out[f"{prefix}{bfl}.{suffix}"] = joined

    for bfl, embedder in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                          ("guidance_in", "guidance_embedder")):
        if f"time_text_embed.{embedder}.linear_1.weight" in sd:
            put(f"{bfl}.in_layer", f"time_text_embed.{embedder}.linear_1")
            put(f"{bfl}.out_layer", f"time_text_embed.{embedder}.linear_2")
    put("txt_in", "context_embedder")
    put("img_in", "x_embedder")
    for i in range(len(module.transformer_blocks)):  # type: ignore[arg-type]
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        put(f"{b}.img_mod.lin", f"{d}.norm1.linear")
        put(f"{b}.txt_mod.lin", f"{d}.norm1_context.linear")
        put(f"{b}.img_attn.qkv", f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")
        put(f"{b}.txt_attn.qkv", f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj")
        put(f"{b}.img_mlp.0", f"{d}.ff.net.0.proj")
        put(f"{b}.img_mlp.2", f"{d}.ff.net.2")
        put(f"{b}.txt_mlp.0", f"{d}.ff_context.net.0.proj")
        put(f"{b}.txt_mlp.2", f"{d}.ff_context.net.2")
        put(f"{b}.img_attn.proj", f"{d}.attn.to_out.0")
        put(f"{b}.txt_attn.proj", f"{d}.attn.to_add_out")
        for bfl, name in (("img_attn.norm.query_norm", "norm_q"), ("img_attn.norm.key_norm", "norm_k"),
                          ("txt_attn.norm.query_norm", "norm_added_q"), ("txt_attn.norm.key_norm", "norm_added_k")):
            out[f"{prefix}{b}.{bfl}.scale"] = sd.pop(f"{d}.attn.{name}.weight")
    for i in range(len(module.single_transformer_blocks)):  # type: ignore[arg-type]
        d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        put(f"{b}.modulation.lin", f"{d}.norm.linear")
        put(f"{b}.linear1", f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp")
        put(f"{b}.linear2", f"{d}.proj_out")
        out[f"{prefix}{b}.norm.query_norm.scale"] = sd.pop(f"{d}.attn.norm_q.weight")
        out[f"{prefix}{b}.norm.key_norm.scale"] = sd.pop(f"{d}.attn.norm_k.weight")
    put("final_layer.linear", "proj_out")
    put("final_layer.adaLN_modulation.1", "norm_out.linear", swap=True)
    if sd:
        raise AssertionError(f"no BFL name for {sorted(sd)}")
    return out


def write_gguf_bfl(module: torch.nn.Module, path: Path, qtype: str = "Q8_0", prefix: str = "") -> dict[str, int]:
    """``module`` as a downloaded FLUX GGUF holds it: BFL names (``bfl_state_dict``), quantized as
    ``write_gguf`` does, so the fused qkv is one quantized tensor diffusers must split on load."""
    return write_tensors(bfl_state_dict(module, prefix), path, qtype)


def write_tensors(tensors: dict[str, torch.Tensor], path: Path, qtype: str, arch: str = "flux",
                  floats: tuple[str, ...] = ()) -> dict[str, int]:
    """``tensors`` as a GGUF file of architecture ``arch`` under their own names, quantized as ``write_gguf``
    says but for names holding one of ``floats`` (city96's converter keeps some embeddings F32: Wan's
    ``time_embedding.``); a tensor of more than 2 dimensions (Wan's Conv3d patch embedding, 5-D) stays F32 at
    its shape, as city96's converter writes it."""
    import gguf
    import numpy as np

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    sizes = {}
    for name, tensor in tensors.items():
        data = tensor.detach().float().numpy()
        if data.ndim == 2 and data.shape[1] % block == 0 and not any(f in name for f in floats):
            q = gguf.quants.quantize(data, kind)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
            sizes[name] = q.nbytes
        else:
            data = np.ascontiguousarray(data, dtype=np.float32)
            writer.add_tensor(name, data)
            sizes[name] = data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes
