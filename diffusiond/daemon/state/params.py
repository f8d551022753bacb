"""Each model's parameter table (``ipc/params.py``), remembered in the state dir for the next start (issue 29).

A trainer's update for a model that runs no worker is checked against what the model held when it last
loaded, whatever its files (none for ``random:``; names converted at load for a single file or a GGUF;
other dtypes under ``quant``). Such a table is only true of the same load: the same spec and options, the
same daemon-wide additions (IP-Adapters, a compiled model's start adapters, the preview decoder), the same
files (a ``random:`` preset's revision), the same software (a release renames modules, peft installed takes
LoRAs). So it is filed under a fingerprint of all of these, the files' sizes and mtimes included, and one
that no longer matches is not used (the files' headers answer, as for a model that never ran) until the
model's next load replaces it. One file per model name under ``params/``, written whole and renamed, so a
crash leaves the old table or the new one; a file that does not read is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

import diffusiond
from diffusiond.daemon.model_config import ModelConfig
from diffusiond.daemon.residency.fit import hub_folder
from diffusiond.daemon.residency.sizes import WeightsError
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.modelcache import BUILT_FOLDERS, cache_root
from diffusiond.pipelines.preset_tables import folder_name, get_preset
from diffusiond.pipelines.spec import ModelSpec, model_options, parse_spec

if TYPE_CHECKING:
    from diffusiond.daemon.config import DaemonConfig

log = logging.getLogger(__name__)

TABLE_REVISION = 1
"""Bumped with any change to diffusiond's own part of what a load holds: what ``worker/weights.param_table`` reads,
how the loaders name parameters (single files, GGUF, ``own_parameters``), an option's effect at load. Its version
number never changes in a checkout, so a table made by older code would otherwise still answer."""

LOADERS = ("diffusers", "transformers", "peft", "torch")
"""The packages a worker's load goes through: another version of any may name or take parameters otherwise."""


class _Remembered(msgspec.Struct, frozen=True):
    key: str
    table: bytes  # ipc/params.pack's bytes, as the worker sent them


def model_folder(parsed: ModelSpec) -> Path | None:
    """The diffusers folder a spec loads (a built-in model's may not be built yet), or None: a single file, a
    GGUF, a model built in code, a hub id not in the cache."""
    if parsed.kind == "folder":
        return Path(parsed.target)
    if parsed.kind in BUILT_FOLDERS:
        return cache_root() / "models" / BUILT_FOLDERS[parsed.kind]
    if parsed.kind == "hub":
        try:
            return hub_folder(parsed.target)
        except WeightsError:
            return None
    return None


def _files(spec: str, options: Mapping[str, str] | None = None) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of every file ``spec`` loads from, a GGUF's base and second expert included, whether
    its own options or ``options`` (a ``[[models]]`` table's, over them, as the loaders merge them) name them."""
    parsed = parse_spec(spec)
    opts = model_options(spec, options)
    roots = [Path(parsed.target)] if parsed.kind in ("checkpoint", "gguf") else []
    roots += [Path(opts["transformer_2"]).expanduser()] if opts.get("transformer_2") else []
    folder = model_folder(parsed)
    roots += [folder] if folder is not None else []
    out = []
    for root in roots:
        for path in sorted(root.rglob("*")) if root.is_dir() else [root]:
            try:
                st = path.stat()
            except OSError:
                continue
            if path.is_file():
                out.append((str(path), st.st_size, st.st_mtime_ns))
    base = opts.get("base") if parsed.kind == "gguf" else None
    return out + (_files(base) if base else [])


def table_key(config: ModelConfig, beside: Mapping[str, object]) -> str | None:
    """The fingerprint a table of ``config``'s model is filed under (None: its spec does not parse). ``beside``:
    the daemon-wide settings a worker loads with the model (``ParamTables.beside``)."""
    try:
        options = model_options(config.spec, config.options)
        files = _files(config.spec, config.options)
        parsed = parse_spec(config.spec)
        if parsed.kind == "checkpoint" and options.get("config"):  # the folder or hub id its configs come from
            files += _files(options["config"])
        preset = folder_name(get_preset(parsed.target)) if parsed.kind == "random" else None  # a typo: no table
    except (PipelineError, OSError):
        return None
    parts = {"spec": config.spec, "options": sorted(options.items()), "dtype": config.dtype,
             "compile": config.compile, "beside": beside, "files": files, "preset": preset,
             "software": software(), "revision": TABLE_REVISION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def software() -> dict[str, str]:
    """The versions of diffusiond (the running code's own: the installed one may be another checkout) and of the
    ``LOADERS`` ("absent" for one not installed), read from the packages' metadata: the engine imports no torch."""
    out = {"diffusiond": diffusiond.__version__}
    for name in LOADERS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


class ParamTables:
    """The tables on disk (``root``: the state dir; None with ``--no-persist``: nothing is kept past the run).
    Blocking file work: called off the event loop."""

    def __init__(self, root: Path | None = None, beside: Mapping[str, object] | None = None) -> None:
        self.dir = None if root is None else Path(root) / "params"
        self.beside = dict(beside or {})

    @classmethod
    def of(cls, config: DaemonConfig, root: Path | None) -> ParamTables:
        """From the daemon's configuration: what every worker loads beside its model (``WorkerConfig``)."""
        beside = {"ip_adapters": sorted(config.ip_adapters.items()), "loras": sorted(config.loras.items()),
                  "preview_decoder": config.preview_decoder}
        return cls(root, beside)

    def key(self, config: ModelConfig) -> str | None:
        beside = self.beside if config.compile else {**self.beside, "loras": []}  # adapters change only slots
        return table_key(config, beside)

    def _path(self, name: str) -> Path:
        assert self.dir is not None
        return self.dir / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.msgpack"

    def load(self, name: str, key: str) -> bytes | None:
        """Model ``name``'s table if it was filed under ``key``."""
        if self.dir is None:
            return None
        path = self._path(name)
        try:
            remembered = msgspec.msgpack.decode(path.read_bytes(), type=_Remembered)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("the remembered parameter table of model %s (%s) does not read (%s); updates for it with "
                        "no worker are checked against its files until it loads again", name, path, exc)
            return None
        return remembered.table if remembered.key == key else None

    def save(self, name: str, key: str, table: bytes) -> None:
        if self.dir is None:
            return
        path = self._path(name)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp.write_bytes(msgspec.msgpack.encode(_Remembered(key, table)))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("the parameter table of model %s could not be kept in %s: %s", name, self.dir, exc)
