"""A LoRA's own matrices on a component stored in fp8 (``quant=...:fp8-storage``, issue 28).

peft makes an adapter's matrices in the dtype of the layer it wraps (``_move_adapter_to_device_of_base_layer``
reads it off the base weight, through ``_get_base_layer_device_and_dtype``), and diffusers then ``copy_``s the
file's values into them. Under diffusers' layerwise casting that weight is float8 (e4m3) between forwards, so
the copy would round every value of the adapter to 3 mantissa bits, and no upcast afterwards gets them back:
every LoRA on an fp8-stored FLUX would be a different, rounded LoRA. So while an adapter is injected, a base
layer that carries a layerwise-casting hook reports the hook's compute dtype instead of its storage dtype: the
matrices are made in the dtype the layer computes in, and the file's values are copied into that.

Why this and not the alternatives (tried in session 47): loading the adapter a second time after a lift is a
hot-swap, which diffusers refuses for text encoders; ``low_cpu_mem_usage=True`` assigns the file's tensors
but peft casts some of them to the base layer's dtype again afterwards, leaving float8 matrices. Copying the
values again would need diffusers' key conversion (kohya, the model's own layouts) redone here. The patch is
scoped to the load, and changes nothing for a layer without the hook (another quantization, a layer skipped
by the casting, a model without fp8-storage).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

_STORAGE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HOOK = "layerwise_casting"  # the name diffusers registers its LayerwiseCastingHook under (hooks/layerwise_casting.py)
_PATCHED = "_get_base_layer_device_and_dtype"


@contextlib.contextmanager
def adapters_in_compute_dtype() -> Iterator[None]:
    """While it is open, peft makes the adapters it injects over an fp8-stored layer in that layer's compute
    dtype (see the module's docstring). A peft without the method patched here is left alone: the adapter is
    then lifted after the load, rounded, and the log says so (``lift_from_storage_dtype``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = BaseTunerLayer.__dict__.get(_PATCHED)
    if original is None:
        yield
        return

    def device_and_dtype(self: Any, base_layer: torch.nn.Module) -> tuple[Any, Any]:
        device, dtype = original(self, base_layer)
        compute = _hook_compute_dtype(base_layer)
        return device, (compute if compute is not None and dtype in _STORAGE_DTYPES else dtype)

    setattr(BaseTunerLayer, _PATCHED, device_and_dtype)
    try:
        yield
    finally:
        setattr(BaseTunerLayer, _PATCHED, original)


def _hook_compute_dtype(module: torch.nn.Module) -> torch.dtype | None:
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook(_HOOK) if registry is not None else None
    compute = getattr(hook, "compute_dtype", None)
    return compute if isinstance(compute, torch.dtype) else None


def lift_from_storage_dtype(pipe: Any, name: str) -> None:
    """The fallback: an adapter still in float8 after the load (a peft that ``adapters_in_compute_dtype``
    does not know how to steer) would not compute at all (no matmul takes float8), so it is cast to its
    component's compute dtype, with its values already rounded, which the log says."""
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        lifted = 0
        for module in component.modules():
            for attr in ("lora_A", "lora_B"):
                layer = getattr(module, attr, None)
                if not isinstance(layer, torch.nn.ModuleDict) or name not in layer:
                    continue
                inner = layer[name]
                weight = getattr(inner, "weight", None)
                if isinstance(weight, torch.Tensor) and weight.dtype in _STORAGE_DTYPES:
                    inner.to(_compute_dtype(component))
                    lifted += 1
        if lifted:
            log.warning("LoRA %s: %d of its matrices on %s were made in float8 by peft and are lifted with their "
                        "values rounded to e4m3; the adapter computes, but not exactly as trained", name, lifted,
                        type(component).__name__)


def _compute_dtype(component: torch.nn.Module) -> torch.dtype:
    """The dtype the layerwise-cast component computes in: its hooks' own, as diffusers reads it."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    return get_parameter_dtype(component)
