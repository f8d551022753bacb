"""What peft's hot-swap would refuse for an adapter, asked before anything in the model changes.

peft (``hotswap_adapter_from_state_dict``) finds a tensor for a layer the slot lacks, or of another shape than the
slot's other than in rank, only while it copies, after earlier tensors were written; and diffusers checks the
adapter's settings against the slot's (``check_hotswap_configs_compatible``: rsLoRA, dropout, per-layer alphas,
DoRA) inside the same ``try``. Either failure makes diffusers delete the slot from every layer. Asked first, a
misfit adapter is a refusal that costs no slot. The adapter is read as the
pipeline's own loader reads it (``read_adapter``), or a kohya SDXL file's block names would not be mapped to the
model's, and a file that swaps in fine would be refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def read_adapter(pipe: Any, where: Any, kwargs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """The adapter's state dict, network alphas and metadata, as ``load_lora_weights`` reads them for this UNet."""
    read = pipe.lora_state_dict(where, unet_config=pipe.unet.config, return_lora_metadata=True, **kwargs)
    state, alphas, metadata = read if len(read) == 3 else (*read, None)
    return state, alphas, metadata


def hotswap_misfit(unet: Any, slot: str, state: Mapping[str, torch.Tensor], alphas: Any = None,
                   metadata: Any = None) -> str:
    """Why ``state`` (``lora_state_dict``'s, keys ``unet.…``) cannot be hot-swapped into ``slot``, else ''."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    tensors = {k.removeprefix("unet."): v for k, v in state.items() if k.startswith("unet.")}
    if tensors and "lora_A" not in next(iter(tensors)):  # as diffusers' load_lora_adapter converts
        tensors = convert_unet_state_dict_to_peft(tensors)
    params = {n.removeprefix("_orig_mod."): p for n, p in unet.named_parameters()}
    for key, value in tensors.items():
        module, _, kind = key.rpartition(".lora_")  # "<module>", "A.weight"
        part, _, leaf = kind.partition(".")
        have = params.get(f"{module}.lora_{part}.{slot}.{leaf}")
        if have is None:
            return f"its tensor {key!r} is for a layer the LoRA slots lack"
        rank_dim = 0 if part == "A" else 1  # lora_A is (rank, in), lora_B (out, rank): only the rank may be smaller
        if value.dim() != have.dim() or any(n != o for i, (n, o) in enumerate(zip(value.shape, have.shape, strict=True))
                                            if i != rank_dim):
            return f"its tensor {key!r} has shape {tuple(value.shape)} where the slot's is {tuple(have.shape)} " \
                   "(size mismatch: made for another model?)"
    return _settings_misfit(unet, slot, tensors, alphas, metadata)


def _settings_misfit(unet: Any, slot: str, tensors: dict[str, torch.Tensor], alphas: Any, metadata: Any) -> str:
    """The config diffusers would make for the adapter (as ``load_lora_adapter`` does), against the slot's."""
    from diffusers.utils.peft_utils import _create_lora_config
    from peft.utils.hotswap import check_hotswap_configs_compatible

    model = getattr(unet, "_orig_mod", unet)
    rank = {f"^{k}": v.shape[1] for k, v in tensors.items() if "lora_B" in k and v.ndim > 1}
    alphas = {k.removeprefix("unet."): v for k, v in (alphas or {}).items() if k.startswith("unet.")} or None
    if metadata:
        metadata = {k.removeprefix("unet."): v for k, v in metadata.items() if k.startswith("unet.")}
    try:
        config = _create_lora_config(tensors, alphas, metadata or None, rank, model_state_dict=model.state_dict(),
                                     adapter_name=slot)
        check_hotswap_configs_compatible(model.peft_config[slot], config)
    except (ValueError, TypeError) as exc:
        return f"its settings differ from the slots' ({exc})"
    return ""
