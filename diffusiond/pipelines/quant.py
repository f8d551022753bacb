"""``quant=COMPONENT:METHOD,...``: a component's weights stored in fewer bits, chosen per component.

Quantization is how a model bigger than the card fits without offloading: FLUX.1-dev's transformer is
24 GB in bf16 and 12 GB in fp8. Each method is diffusers' or a well-kept library's own; this module only
parses the option, refuses what cannot work on the device before any weight is read, and names what is in
force, because every quantized output differs from the model's own and says so in its ``approximations``.

- ``fp8-storage``: the weights are kept in float8 (e4m3) and each layer is cast to the model's dtype for
  its forward (diffusers' layerwise casting). No extra package, any device, and it applies to any
  component (the T5 encoder included); norms, embeddings and the first and last projections stay as
  loaded (diffusers' default skip list and the model's own ``_keep_in_fp32_modules``), as they are the
  layers most sensitive to rounding.
- ``int8``, ``fp8``: torchao's int8 and float8 weight-only quantization, applied to the loaded component
  (``pip install torchao``; ``fp8`` needs a GPU with fp8 matrix units, compute capability 8.9+).
- ``nf4``, ``fp4``, ``bnb8``: bitsandbytes 4-bit (NF4 or FP4, computed in the model's dtype) and 8-bit
  (LLM.int8), applied while the component is read from its files (diffusers' ``PipelineQuantizationConfig``),
  so the full-precision weights never sit on the device. CUDA only, ``pip install bitsandbytes``.

In a spec the option may keep the commas of the issue's form (``quant=transformer:nf4,text_encoder_2:int8``):
``spec.parse_options`` reads a ``COMPONENT:METHOD`` part without ``=`` as the continuation of ``quant``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from typing import Any

import torch

from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import AT_LOAD, METHODS, parse_quant

__all__ = ["METHODS", "apply_quant", "load_time_config", "parse_quant"]

def _need(package: str, method: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise PipelineError(f"quant {method} needs the {package} package (pip install {package})")


def load_time_config(quant: Mapping[str, str], index: Mapping[str, Any], dtype: torch.dtype,
                     device: torch.device) -> Any | None:
    """diffusers' ``PipelineQuantizationConfig`` for the bitsandbytes methods (None when there are none),
    each component's config taken from the library that loads it (diffusers or transformers), as
    ``model_index.json`` says."""
    wanted = {c: m for c, m in quant.items() if m in AT_LOAD}
    if not wanted:
        return None
    if device.type != "cuda":
        raise PipelineError(f"quant {', '.join(f'{c}:{m}' for c, m in wanted.items())}: bitsandbytes runs on CUDA "
                            f"GPUs only, and this model is on {device}; fp8-storage works on any device")
    _need("bitsandbytes", next(iter(wanted.values())))
    import diffusers
    import transformers

    mapping: dict[str, Any] = {}
    for component, method in wanted.items():
        entry = index.get(component)
        if not (isinstance(entry, list) and len(entry) == 2):
            names = ", ".join(sorted(k for k in index if not k.startswith("_")))
            raise PipelineError(f"quant: the model has no component {component!r} (model_index.json names {names})")
        library = transformers if entry[0] == "transformers" else diffusers
        if method == "bnb8":
            mapping[component] = library.BitsAndBytesConfig(load_in_8bit=True)
        else:
            mapping[component] = library.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=method,
                                                            bnb_4bit_compute_dtype=dtype)
    return diffusers.PipelineQuantizationConfig(quant_mapping=mapping)


def apply_quant(pipe: Any, quant: Mapping[str, str], device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """Quantize the loaded components (the post-load methods; the others were applied at load) and name
    every method in force, for each output's ``approximations``."""
    names: list[str] = []
    components = pipe.components
    for component, method in quant.items():
        module = components.get(component)
        if not isinstance(module, torch.nn.Module):
            models = sorted(n for n, c in components.items() if isinstance(c, torch.nn.Module))
            raise PipelineError(f"quant: {type(pipe).__name__} has no model component {component!r}; "
                                f"its model components: {', '.join(models)}")
        compute = str(dtype).removeprefix("torch.")
        if method == "fp8-storage":
            from diffusers.hooks import apply_layerwise_casting

            if dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise PipelineError(f"quant {component}:fp8-storage computes in the model's dtype, which is {compute}")
            apply_layerwise_casting(module, storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype,
                                    skip_modules_pattern=_skipped(module), skip_modules_classes=(torch.nn.Embedding,))
            names.append(f"fp8-storage({component}, computed in {compute})")
        elif method in ("int8", "fp8"):
            names.append(_torchao(module, component, method, device))
        elif getattr(module, "hf_quantizer", None) is None:  # bitsandbytes is applied while reading files
            raise PipelineError(f"quant {component}:{method}: bitsandbytes quantizes while a diffusers folder or "
                                "hub id is read, and this model was not loaded that way (a single file, a GGUF's "
                                "base, or built in code with save=0); fp8-storage works on any loaded model")
        else:
            names.append(f"bitsandbytes-{method}({component}, computed in {compute})")
    return tuple(names)


def _skipped(module: torch.nn.Module) -> tuple[str, ...]:
    """diffusers' default skip list, plus the layers the model itself keeps in higher precision
    (``_keep_in_fp32_modules``: T5's ``wo``, whose forward casts its input to the weight's dtype).
    Embeddings stay too (``skip_modules_classes``): a lookup costs nothing to keep, and transformers reads a
    model's dtype off its first parameter, the token embedding, which pipelines then cast prompts to."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    return (*DEFAULT_SKIP_MODULES_PATTERN, *(rf"(^|\.){re.escape(k)}$" for k in keep))


def _torchao(module: torch.nn.Module, component: str, method: str, device: torch.device) -> str:
    if method == "fp8" and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise PipelineError(f"quant {component}:fp8 needs a CUDA GPU with fp8 matrix units (compute capability "
                            f"8.9+: Ada, Hopper), and this model is on {device}; fp8-storage works on any device")
    _need("torchao", method)
    from torchao.quantization import quantize_

    if method == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        quantize_(module, Int8WeightOnlyConfig())
    else:
        from torchao.quantization import Float8WeightOnlyConfig

        quantize_(module, Float8WeightOnlyConfig())
    return f"torchao-{method}-weights({component})"
