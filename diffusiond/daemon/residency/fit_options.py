"""The model's own options' word on ``fit``'s rows, kept apart from the header arithmetic (``fit.py``) because it
asks the loader's option checks, not the files: which rows a load with those options refuses, and what every row
approximates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from diffusiond.daemon.residency.fit_tensors import quant_approximations
from diffusiond.pipelines.attention import check_attention
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import check_options, parse_quant, parse_spec

DENOISERS: Final = ("transformer", "unet")


def spec_approximations(spec: str, options: Mapping[str, str] | None = None,
                        dtype: str = "bfloat16") -> tuple[str, ...]:
    """What a spec's options approximate in every configuration, named as the loaded model names it in its
    ``approximations``: SageAttention's int8 attention (``attention=sage*``; pipelines/attention.py), and
    the ``quant=`` methods (``quant_approximations``)."""
    opts = {**parse_spec(spec).options, **(options or {})}
    name = opts.get("attention", "")
    quantized = check_attention(name).quantized if name else ""
    return ((quantized,) if quantized else ()) + quant_approximations(opts, dtype)


def refused(name: str, opts: Mapping[str, str], gguf: bool) -> bool:
    """Whether the model's own options rule configuration ``name`` out, as a load with both would refuse them
    (``spec.check_options``): ``offload=stream`` beside ``quant=`` on the denoiser or ``fp8=``, fp8 storage of a
    denoiser already quantized, either beside a GGUF transformer, even an unquantized F16 one (model_config's and
    the GGUF loader's refusals). Listed, ``auto`` or a user would choose one the load refuses."""
    if gguf and name in ("stream", "fp8"):
        return True
    if name == "fp8":
        named = parse_quant(opts["quant"]) if opts.get("quant") else {}
        return any(d in named for d in DENOISERS) or opts.get("fp8") in ("1", "rowwise")
    trial = {k: v for k, v in opts.items() if k not in ("offload", "cpu_offload", "resident_blocks")}
    try:
        check_options({**trial, "offload": name})
    except PipelineError:
        return True
    return False
