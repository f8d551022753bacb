"""Which weights files a diffusers folder's components load from, where a component holds several variants of
its weights (``diffusion_pytorch_model.fp16.safetensors`` beside ``diffusion_pytorch_model.safetensors``).

Two processes need the answer and must get the same one: the engine sizes a model from the headers of the
files it will load, before any worker starts (daemon/residency/sizes.py), and the worker loads them through
diffusers (pipelines/loaders.py). So the rule is here, free of torch and diffusers, which the engine never
imports. It is made per component: the variant the model's dtype implies (``fp16`` for float16, the fewest
bytes to read), else the plain files (no precision lost to a half-precision copy), else the variant the
component has. diffusers takes one ``variant=`` for the whole pipeline and reads it in every component with
a file of it, the plain files elsewhere, so ``pipeline_variants`` says which one to pass and which components
it would read from the wrong files; the loader reads those itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

VARIANT_OF_DTYPE: Final[Mapping[str, str]] = {"float16": "fp16", "bfloat16": "bf16", "float32": ""}
"""The weights variant each model dtype reads where a component has it ("" the plain files)."""

NOT_LOADED: Final = frozenset({"safety_checker"})
"""Components the loader passes as None rather than reading (loaders.py): what they would do is discarded."""

_SHARD: Final = re.compile(r"-\d+-of-\d+$")
_VARIANT: Final = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # fp16, bf16, ema; not the "0" of "sd_xl_base_1.0"


def weight_names(names: Iterable[str], suffixes: tuple[str, ...] = (".safetensors",)) -> dict[str, set[str]]:
    """Variant -> the names, among one component folder's files, that make up that variant's weights: a sharded
    variant's index (``<name>.safetensors.index.<variant>.json``, which names its shards) or single files
    (``<name>.<variant>.safetensors``). A shard counts through its index only: without one nothing reads it."""
    sets: dict[str, set[str]] = {}
    for name in names:
        for suffix in suffixes:
            index = f"{suffix}.index"
            if index in name and name.endswith(".json"):
                variant = name.split(index, 1)[1].removesuffix(".json").lstrip(".")
            elif name.endswith(suffix) and not _SHARD.search(stem := name.removesuffix(suffix)):
                tail = stem.rsplit(".", 1)[1] if "." in stem else ""
                variant = tail if _VARIANT.fullmatch(tail) else ""
            else:
                continue
            sets.setdefault(variant, set()).add(name)
            break
    return sets


def choose_variant(available: set[str], dtype: str, variant: str | None = None) -> str | None:
    """Which of a component's variants (``weight_names``' keys) to load; None where it has no weights.

    An explicit ``variant`` where the component has it; else the variant ``dtype`` implies; else the plain
    files; else the first variant by name. The bytes on the device are those of ``dtype`` whichever is chosen:
    the choice changes what a load reads, not what it holds.
    """
    if not available:
        return None
    for pick in (variant, VARIANT_OF_DTYPE.get(dtype), ""):
        if pick is not None and pick in available:
            return pick
    return sorted(available)[0]


def diffusers_reads(names: Iterable[str], variant: str | None) -> bool:
    """Whether ``from_pretrained(variant=...)`` reads a component's files of ``variant`` rather than its plain
    ones: diffusers does where any file's name has a second dot-separated part starting with it
    (``pipeline_loading_utils._identify_model_variants``)."""
    if not variant:
        return False
    return any(n.split(".")[1].startswith(variant) for n in names if "." in n)


def pipeline_variants(folder: Path, names: Iterable[str], dtype: str,
                      suffixes: tuple[str, ...] = (".safetensors",)) -> tuple[str | None, dict[str, str]]:
    """The ``variant=`` to load the components ``names`` of ``folder`` with, and the components it would read
    from other files than ``choose_variant``'s, each with the variant to read ("" the plain files). The variant
    that leaves the fewest such components wins, ties going to the dtype's, then none; one that no component
    has is no candidate (diffusers refuses it)."""
    listings = {n: sorted(p.name for p in (folder / n).iterdir()) if (folder / n).is_dir() else [] for n in names}
    picks = {n: p for n, files in listings.items()
             if (p := choose_variant(set(weight_names(files, suffixes)), dtype)) is not None}

    def apart(v: str | None) -> dict[str, str]:
        return {n: p for n, p in picks.items() if p != (v if diffusers_reads(listings[n], v) else "")}

    preferred = (VARIANT_OF_DTYPE.get(dtype), None, *sorted(set(picks.values())))
    candidates = [v for v in dict.fromkeys(preferred)
                  if v is None or (v and any(diffusers_reads(files, v) for files in listings.values()))]
    best = min(candidates, key=lambda v: len(apart(v)))
    return best, apart(best)
