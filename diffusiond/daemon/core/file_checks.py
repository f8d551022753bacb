"""A live update for a model that runs no worker, checked at once against what the model holds (issue 29).

Such an update is kept until the model starts. Kept unchecked, a bad one would be found only then, long
after the trainer's call returned a version, and it would stand in for good ones until then. So the
engine checks it without torch, in the words a running worker uses (``pipelines/live_checks.py``), so the
trainer reads one refusal whichever answered, against the best source it has:

1. The parameter table the model's last load reported (``ipc/params.py``, kept in the state dir by
   ``state/params.py`` under a fingerprint of its spec, options, files and package versions): what the
   worker's own check reads, so it answers as the worker would, whatever the model is built from. It wins over
   the headers. Not in it: what a compiled model's fixed adapter slots refuse (a text encoder's keys, a rank
   above the slots', a module outside them); such an adapter is taken here and refused at the start.
2. Otherwise (the model never loaded with this spec, options and files) its files' safetensors headers
   (``residency/sizes.py``), which name each component's tensors with their dtypes and shapes: the loaded
   model's parameters unless an option changes them at load.

What a model that never ran leaves to its start, where a refusal keeps the last proven update in force
(``kept.py``):
- a model built in code that was never saved (``random:``, ``synthetic``), a single-file checkpoint or a
  GGUF (their names are converted at load), and a model whose parameters an option changes at load
  (``quant``, ``fp8``, ``fuse_qkv``): nothing is checked;
- the components an IP-Adapter attaches (``image_encoder``) and the layers it adds to a UNet;
- a name a transformers component's file lacks (tied weights are saved once, and old names are renamed
  at load): only the names its file holds are checked;
- for a LoRA matrix, a module that is no Linear or Conv2d (a norm, an embedding: the header shows a
  weight's shape, not its class).
Once it has loaded, each of these is checked at once from its table. Either way an update of an existing
adapter is checked against the adapter's own tensors (``weights.py``), whatever the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from diffusiond.daemon.model_config import ModelConfig
from diffusiond.daemon.residency.sizes import FLOATS, model_weights, read_entries
from diffusiond.daemon.state.params import ParamTables, model_folder
from diffusiond.daemon.workers.link import FrameCallback, WorkerLink
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import WeightTensor
from diffusiond.ipc.params import ParamTable, ParamTableFrame, unpack
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
    out_of_reach,
    parameter_misfit,
)
from diffusiond.pipelines.modelcache import BUILT_FOLDERS, is_complete
from diffusiond.pipelines.spec import model_options, offload_mode, parse_spec

if TYPE_CHECKING:
    from diffusiond.daemon.config import DaemonConfig

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
    sequential: bool = False  # offload=sequential: no component's weights can be updated (``out_of_reach``)

    def weights_misfit(self, component: str, tensors: Iterable[WeightTensor]) -> str:
        """Why ``update_weights`` of ``component`` does not fit the files ('' if they cannot tell)."""
        comp = self.components.get(component)
        if comp is None:
            return "" if component in ATTACHED else no_component(self.model, component, sorted(self.components))
        if self.sequential:
            return out_of_reach(self.model, component)
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


@dataclass(frozen=True)
class _Held:
    params: Mapping[str, tuple[Shape, str]]  # name -> (shape, the dtype it is kept in if not updated in place)
    layers: Mapping[str, Layer]  # module path -> what a LoRA matrix there must fit
    out_of_reach: bool  # ComponentTable's


class ModelTable:
    """What the model held when it last loaded (its PARAM_TABLE): each check is the worker's
    (``worker/weights.py``) on the same facts, so it gives the worker's refusal, word for word."""

    def __init__(self, model: str, table: ParamTable) -> None:
        self.model = model
        self.lora_model = table.name or model  # a worker's LoRA refusals name its pipeline ("... (random weights)")
        self.no_lora = table.no_lora
        self.components = {c.name: _Held({p.name: (p.shape, p.keeps) for p in c.params},
                                         {r.path: Layer(r.in_features, r.out_features, r.kernel, r.other)
                                          for r in c.layers}, c.out_of_reach)
                           for c in table.components}

    def weights_misfit(self, component: str, tensors: Iterable[WeightTensor]) -> str:
        held = self.components.get(component)
        if held is None:
            return no_component(self.model, component, sorted(self.components))
        if held.out_of_reach:
            return out_of_reach(self.model, component)
        for t in tensors:
            have, keeps = held.params.get(t.name, (None, ""))
            why = parameter_misfit(t.name, tuple(t.shape), self.model, component, have, keeps)
            if why:
                return why
        return ""

    def lora_misfit(self, adapter: str, shapes: Mapping[str, Shape]) -> str:
        return self.no_lora or adapter_misfit(adapter, shapes, None, self._fits)

    def _fits(self, key: str, shape: Shape) -> str:
        name, _, rest = key.partition(".")
        held = self.components.get(name)
        if held is None:
            return no_lora_component(key, self.lora_model, name, sorted(self.components))
        path = rest[: -len(KINDS[0])]
        layer = held.layers.get(path)
        if layer is None:
            return no_module(key, self.lora_model, name, path)
        return lora_misfit(key, shape, name, path, layer)


class Checks(Protocol):
    """What an update for a model with no worker is checked against: its table, or its files' headers."""

    def weights_misfit(self, component: str, tensors: Iterable[WeightTensor]) -> str: ...
    def lora_misfit(self, adapter: str, shapes: Mapping[str, Shape]) -> str: ...


def read_model_files(config: ModelConfig) -> ModelFiles | None:
    """The headers of the files ``config``'s model loads, or None when they cannot tell its parameters."""
    try:
        parsed = parse_spec(config.spec)
        options = model_options(config.spec, config.options)
        sequential = offload_mode(options) == "sequential"
    except PipelineError:
        return None
    if any(options.get(k) for k in CHANGED_AT_LOAD):
        return None
    folder = model_folder(parsed)
    if folder is None or (parsed.kind in BUILT_FOLDERS and not is_complete(folder)):  # built by its first worker
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
    return ModelFiles(config.name, components, sequential)


def _library(index: object, name: str) -> str:
    entry = index.get(name) if isinstance(index, dict) else None
    return entry[0] if isinstance(entry, list) and entry and isinstance(entry[0], str) else ""


class FileChecks:
    """Each model's source of checks, found once (off the event loop) and kept: the files a model loads do
    not change under a running daemon, and a trainer checks against them at every step. A load's table
    replaces what was kept (``watching``): it is what the model holds now."""

    def __init__(self, configs: Mapping[str, ModelConfig], tables: ParamTables | None = None) -> None:
        self._configs = configs
        self._tables = tables or ParamTables()
        self._read: dict[str, Checks | None] = {}
        self._learning: dict[str, asyncio.Task[None]] = {}

    @classmethod
    def of(cls, config: DaemonConfig, root: Path | None) -> FileChecks:
        """The daemon's models, their tables kept under ``root`` (the state dir; None: for this run only)."""
        return cls({m.name: m for m in config.models}, ParamTables.of(config, root))

    async def __call__(self, model: str) -> Checks | None:
        learning = self._learning.get(model)
        if learning is not None:
            await asyncio.shield(learning)
        if model not in self._read:
            config = self._configs.get(model)
            found = None if config is None else await asyncio.to_thread(self._find, config)
            if found is None and config is not None and _built_in(config):
                return self._read.get(model)  # not built yet: read again next time
            # a load's table that came while the files were read is newer than what they said
            return self._read.setdefault(model, found)
        return self._read[model]

    def _find(self, config: ModelConfig) -> Checks | None:
        """The table its last load left, if it is of this spec, options and files; else its files' headers."""
        key = self._tables.key(config)
        packed = None if key is None else self._tables.load(config.name, key)
        if packed is not None:
            try:
                return ModelTable(config.name, unpack(packed))
            except ValueError as exc:
                log.warning("model %s: its remembered parameter table does not read (%s); its files answer",
                            config.name, exc)
        return read_model_files(config)

    def watching(self, on_frame: FrameCallback) -> FrameCallback:
        """``on_frame`` with each worker's PARAM_TABLE taken first: remembered (on disk where the daemon
        persists), and what the model's updates are checked against while it runs no worker."""

        def frame(worker: WorkerLink, f: Frame) -> None:
            msg = f.msg
            if not isinstance(msg, ParamTableFrame):
                on_frame(worker, f)
            elif msg.model_name in self._configs and msg.model_name not in self._learning:
                task = asyncio.ensure_future(self._learn(self._configs[msg.model_name], msg.table))
                self._learning[msg.model_name] = task
                task.add_done_callback(lambda _: self._learning.pop(msg.model_name, None))

        return frame

    async def _learn(self, config: ModelConfig, packed: bytes) -> None:
        try:
            self._read[config.name] = await asyncio.to_thread(self._keep, config, packed)
        except Exception:  # the files still answer: a table is a better answer, never a needed one
            log.exception("model %s: the parameter table its worker sent could not be kept", config.name)

    def _keep(self, config: ModelConfig, packed: bytes) -> ModelTable:
        table = ModelTable(config.name, unpack(packed))
        key = self._tables.key(config)
        if key is not None:
            self._tables.save(config.name, key, packed)
        return table


def _built_in(config: ModelConfig) -> bool:
    """A built-in model (options or none: ``tiny,attention=sdpa`` too), whose folder its first worker builds: its
    headers cannot tell before that, and can after, so "cannot tell" is not kept for it."""
    try:
        return parse_spec(config.spec).kind in BUILT_FOLDERS
    except PipelineError:
        return False
