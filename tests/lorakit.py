"""LoRA files for the tests, built in code on the ``tiny`` model (no download).

``build_lora`` puts PEFT ``LoraConfig`` adapters with random (non-zero) weights on tiny's UNet
and, optionally, its text encoder, and saves them with the pipeline's ``save_lora_weights``: the
diffusers/PEFT layout a user gets from training scripts. ``to_kohya`` rewrites such a file into
the kohya layout (``lora_unet_..._lora_down.weight`` with ``.alpha``), which diffusers converts
when it loads it.
"""

from __future__ import annotations

from pathlib import Path

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def build_lora(out: Path, *, seed: int, rank: int = 4, text_encoder: bool = True, scale: float = 1.0) -> Path:
    """Write ``out/pytorch_lora_weights.safetensors``; returns the folder."""
    import torch
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    from diffusiond.pipelines.tiny import ensure_tiny

    pipe = StableDiffusionPipeline.from_pretrained(str(ensure_tiny()), safety_checker=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # init_lora_weights=False: random A and B, so the adapter changes the output (B is zero by default)
        pipe.unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=UNET_TARGETS,
                                         init_lora_weights=False))
        te_layers = None
        if text_encoder:
            # peft directly: transformers' own add_adapter wants a newer peft than the venv has
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=TEXT_TARGETS,
                                               init_lora_weights=False), pipe.text_encoder)
            te_layers = get_peft_model_state_dict(pipe.text_encoder)
        unet_layers = get_peft_model_state_dict(pipe.unet)
    if scale != 1.0:
        unet_layers = {k: v * scale for k, v in unet_layers.items()}
    out.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(str(out), unet_lora_layers=unet_layers,
                                              text_encoder_lora_layers=te_layers, safe_serialization=True)
    return out


def to_kohya(folder: Path, out: Path) -> Path:
    """The same adapter as one kohya-layout ``.safetensors`` file (UNet and text encoder)."""
    from safetensors.torch import load_file, save_file

    src = load_file(str(folder / "pytorch_lora_weights.safetensors"))
    dst = {}
    for key, value in src.items():
        prefix, _, rest = key.partition(".")
        module, _, kind = rest.rpartition(".lora_")
        kind = kind.removesuffix(".weight")  # "A" or "B"
        if prefix == "unet":
            name = "lora_unet_" + module.replace(".", "_")
        elif prefix == "text_encoder":
            name = "lora_te_" + module.replace(".", "_")
        else:
            raise ValueError(f"unexpected key {key}")
        dst[f"{name}.lora_down.weight" if kind == "A" else f"{name}.lora_up.weight"] = value.contiguous()
        if kind == "A":
            dst[f"{name}.alpha"] = __import__("torch").tensor(float(value.shape[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(dst, str(out))
    return out
