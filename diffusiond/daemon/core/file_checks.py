"""A live update for a model that runs no worker, checked against the model's files (issue 29).

Such an update is kept until the model starts. Kept unchecked, a bad one would be found only then, long
after the trainer's call returned a version, and it would stand in for good ones until then. So the
engine checks what the files can tell, without torch: the safetensors headers (``residency/sizes.py``)
name each component's tensors with their dtypes and shapes, which are the loaded model's parameters
unless an option changes them at load. What is refused here is refused in the words a running worker
uses (``pipelines/live_checks.py``), so the trainer reads one refusal whichever answered.

What the headers cannot tell is left to the model's start, where a refusal keeps the last proven update
in force (``kept.py``):
- a model built in code that was never saved (``random:``, ``synthetic``), a single-file checkpoint or a
  GGUF (their names are converted at load), and a model whose parameters an option changes at load
  (``quant``, ``fp8``, ``fuse_qkv``): nothing is checked;
- the components an IP-Adapter attaches (``image_encoder``) and the layers it adds to a UNet;
- a name a transformers component's file lacks (tied weights are saved once, and old names are renamed
  at load): only the names its file holds are checked;
- for a LoRA matrix, a module that is no Linear or Conv2d (a norm, an embedding: the header shows a
  weight's shape, not its class) and, for an existing adapter, nothing (its own tensors are the check,
  ``weights.py``, whatever the model).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from diffusiond.daemon.model_config import ModelConfig
from diffusiond.daemon.residency.fit import hub_folder
from diffusiond.daemon.residency.sizes import FLOATS, WeightsError, model_weights, read_entries
from diffusiond.ipc.messages import WeightTensor
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.live_checks import (
    KINDS,
    Layer,
    Shape,
    adapter_misfit,
    lora_misfit,
    no_component,
    no_lora_component,
    no_module,
    parameter_misfit,
)
from diffusiond.pipelines.modelcache import BUILT_FOLDERS, cache_root, is_complete
from diffusiond.pipelines.spec import model_options, parse_spec

log = logging.getLogger(__name__)

CHANGED_AT_LOAD = ("quant", "fp8", "fuse_qkv")
"""Options under which a component's parameters are not its files' (other names, dtypes or storage)."""
ATTACHED = frozenset({"image_encoder", "feature_extractor"})
"""Components an IP-Adapter sets on the pipeline when it loads (``pipelines/ip_adapter.py``)."""
ADDED_BY_IP_ADAPTER = (".processor.", "encoder_hid_proj.")
"""Where the layers an IP-Adapter adds to a UNet sit among its parameters' names."""
_TORCH_NAMES = {"I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8",
                "U64": "torch.uint64", "U32": "torch.uint32", "U16": "torch.uint16", "U8": "torch.uint8",
                "BOOL": "torch.bool"}


@dataclass(frozen=True)
class Component:
    diffusers: bool  # a diffusers model, whose file holds every parameter under its own name
    tensors: Mapping[str, tuple[str, Shape]]  # name -> (safetensors dtype, shape)


@dataclass(frozen=True)
class ModelFiles:
    model: str
    components: Mapping[str, Component]

    def weights_misfit(self, component: str, tensors: Iterable[WeightTensor]) -> str:
        """Why ``update_weights`` of ``component`` does not fit the files ('' if they cannot tell)."""
        comp = self.components.get(component)
        if comp is None:
            return "" if component in ATTACHED else no_component(self.model, component, sorted(self.components))
        for t in tensors:
            entry = comp.tensors.get(t.name)
            if entry is None:
                if comp.diffusers and not any(m in t.name for m in ADDED_BY_IP_ADAPTER):
                    return parameter_misfit(t.name, tuple(t.shape), self.model, component, None, "")
                continue
            stored, shape = entry
            keeps = "" if stored in FLOATS else _TORCH_NAMES.get(stored, stored)
            why = parameter_misfit(t.name, tuple(t.shape), self.model, component, shape, keeps)
            if why:
                return why
        return ""

    def lora_misfit(self, adapter: str, shapes: Mapping[str, Shape]) -> str:
        """Why a new LoRA adapter does not fit the files ('' if they cannot tell)."""
        return adapter_misfit(adapter, shapes, None, self._fits)

    def _fits(self, key: str, shape: Shape) -> str:
        name, _, rest = key.partition(".")
        comp = self.components.get(name)
        if comp is None:
            return "" if name in ATTACHED else no_lora_component(key, self.model, name, sorted(self.components))
        path = rest[: -len(KINDS[0])]
        weight = comp.tensors.get(path + ".weight")
        if weight is None:
            known = any(n.startswith(path + ".") for n in comp.tensors)
            return no_module(key, self.model, name, path) if comp.diffusers and not known else ""
        size = weight[1]
        if len(size) == 2:
            return lora_misfit(key, shape, name, path, Layer(size[1], size[0]))
        if len(size) == 4:
            return lora_misfit(key, shape, name, path, Layer(size[1], size[0], size[2:]))
        return ""


def read_model_files(config: ModelConfig) -> ModelFiles | None:
    """The headers of the files ``config``'s model loads, or None when they cannot tell its parameters."""
    try:
        parsed = parse_spec(config.spec)
        options = model_options(config.spec, config.options)
    except PipelineError:
        return None
    if any(options.get(k) for k in CHANGED_AT_LOAD):
        return None
    if parsed.kind == "folder":
        folder = Path(parsed.target)
    elif parsed.kind in BUILT_FOLDERS:
        folder = cache_root() / "models" / BUILT_FOLDERS[parsed.kind]
        if not is_complete(folder):  # built by the model's first worker
            return None
    elif parsed.kind == "hub":
        try:
            folder = hub_folder(parsed.target)
        except WeightsError:
            return None
    else:
        return None
    try:
        index = json.loads((folder / "model_index.json").read_text())
        weights = model_weights(folder, config.dtype)
        components = {name: Component(_library(index, name) == "diffusers",
                                      {k: v for f in files for k, v in read_entries(f.path).items()})
                      for name, files in weights.components.items() if files}
    except (OSError, ValueError) as exc:  # WeightsError is a ValueError; the load will say it again
        log.warning("model %s: its files' headers cannot be read to check live updates: %s", config.name, exc)
        return None
    return ModelFiles(config.name, components)


def _library(index: object, name: str) -> str:
    entry = index.get(name) if isinstance(index, dict) else None
    return entry[0] if isinstance(entry, list) and entry and isinstance(entry[0], str) else ""


class FileChecks:
    """Each model's headers, read once (off the event loop) and kept: the files a model loads do not change
    under a running daemon, and a trainer checks against them at every step."""

    def __init__(self, configs: Mapping[str, ModelConfig]) -> None:
        self._configs = configs
        self._read: dict[str, ModelFiles | None] = {}

    async def __call__(self, model: str) -> ModelFiles | None:
        if model not in self._read:
            config = self._configs.get(model)
            files = None if config is None else await asyncio.to_thread(read_model_files, config)
            if files is None and config is not None and _built_in(config):
                return None  # not built yet: read again next time
            self._read[model] = files
        return self._read[model]


def _built_in(config: ModelConfig) -> bool:
    """A built-in model (options or none: ``tiny,attention=sdpa`` too), whose folder its first worker builds: its
    headers cannot tell before that, and can after, so "cannot tell" is not kept for it."""
    try:
        return parse_spec(config.spec).kind in BUILT_FOLDERS
    except PipelineError:
        return False
