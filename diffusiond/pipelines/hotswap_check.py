"""What peft's hot-swap would refuse for an adapter, asked before anything in the model changes.

peft (``hotswap_adapter_from_state_dict``) finds a tensor for a layer the slot lacks, or of another shape than the
slot's other than in rank, only while it copies, after earlier tensors were written; diffusers then deletes the
slot from every layer. Asked first, a misfit adapter is a refusal that costs no slot (review48-b 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def hotswap_misfit(unet: Any, slot: str, state: Mapping[str, torch.Tensor]) -> str:
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
    return ""
