"""How flags and TOML values are read: durations, addresses, devices, LoRA lists, preload,
upscalers.

Each reader takes a value as a user wrote it (a flag's string or a TOML value) and returns it checked, or
raises ``ConfigError`` whose message names the flag and the forms it accepts. Kept apart from ``config.py``,
which assembles and cross-checks the configuration, so that each stays one job; ``config.py`` re-exports
the names other modules import from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from diffusiond.daemon.residency.preload import parse_preload
from diffusiond.daemon.residency.sizes import WeightsError, read_shapes
from diffusiond.daemon.residency.units import parse_duration
from diffusiond.ipc.upscale import DEFAULT_OVERLAP, DEFAULT_TILE, MAX_TILE, MIN_TILE, UpscalerSetting
from diffusiond.protocol import BATCH_SIZES, DEFAULT_WEB_ADDRESS


class ConfigError(ValueError):
    pass


def check_fields(settings: Any, prefix: str = "") -> None:
    """Each setting of a configuration dataclass (and of one inside it, as ``limits.``) holds the type it declares,
    and a number is finite (inf only for a keep-alive's "forever"). A TOML file gives any type: "10", 1.5 or nan
    reached the comparisons and arithmetic after, which failed naming no setting, or not at all."""
    hints = typing.get_type_hints(type(settings))
    for f in dataclasses.fields(settings):
        value, key = getattr(settings, f.name), prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_fields(value, f"{key}.")
            continue
        want = _wanted(value, hints[f.name])
        shown = list(value) if isinstance(value, tuple) else value
        if want is not None:
            like = f", like {key} = [{json.dumps(shown, default=str)}]" if want == "a list" else ""
            raise ConfigError(f"{key} must be {want}{like}, got {shown!r} ({type(shown).__name__}); "
                              "correct it in the config file or on the command line")
        numbers = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) and not (v == math.inf and "keep_alive" in key)
               for v in numbers):
            raise ConfigError(f"{key} must be a finite number, got {shown}")


def _wanted(value: Any, hint: Any) -> str | None:
    """What ``hint`` wants, where ``value`` is not that; None where it is, or where the value's own reader checks
    it (a Literal's words, a table, a model)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "a whole number"
    if hint is float:
        return None if isinstance(value, int | float) and not isinstance(value, bool) else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if hint is type(None):
        return None if value is None else ""
    if origin in (typing.Union, types.UnionType):
        wants = [_wanted(value, a) for a in args]
        if None in wants:
            return None
        if "a number" in wants:  # a float's field takes whole numbers too: naming both says nothing more
            wants.remove("a whole number")
        return " or ".join(w for w in wants if w)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, tuple):
            return "a list"
        item = next((w for w in (_wanted(v, args[0]) for v in value) if w is not None), None)
        return None if item is None else f"a list, each item {item}"
    return None


def unknown_keys(given: Iterable[Any], known: Sequence[str], where: str) -> None:
    """Refuse the keys of ``given`` not in ``known`` (``where``: which table, for the message), with the close
    matches of each and every known key, close ones first. A misspelled key (``max_bach``, ``pinned``) would
    otherwise be dropped without a word and the daemon served without it, so the top level, ``[limits]`` and each
    ``[[models]]`` table refuse them alike."""
    unknown = [str(k) for k in given if k not in known]
    if not unknown:
        return
    guesses = {k: get_close_matches(k, known, n=2) for k in unknown}
    named = ", ".join(f"{k} (did you mean {' or '.join(g)}?)" if g else k for k, g in guesses.items())
    close = list(dict.fromkeys(c for g in guesses.values() for c in g))
    raise ConfigError(f"unknown {where}: {named}; fix or remove them (known: "
                      f"{', '.join(close + [k for k in known if k not in close])})")


def whole(value: Any, key: str) -> int:
    """A count as TOML or a flag gives it: 2 or "2", nothing else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ConfigError(f"{key} must be a whole number, like 2; got {value!r}")


def duration(value: Any, name: str) -> float:
    """A keep-alive as flags, TOML and requests give it (``5m``, ``300``, ``0``, ``-1``), in seconds."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def parse_host_port(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (all addresses); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{flag}: put an IPv6 address in brackets, like [::1]:7860; got {text!r}")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{flag} wants HOST:PORT with a port of 0-65535, like {DEFAULT_WEB_ADDRESS}; got {text!r}")
    return host, int(port)


def parse_loras(value: Any, flag: str = "--lora", what: str = "LoRA") -> dict[str, str]:
    """``--lora NAME=PATH`` (a list of those) or a TOML ``[loras]`` table (name = path) -> name -> path."""
    if isinstance(value, dict):
        return {str(k): absolute(str(v)) for k, v in value.items()}
    out: dict[str, str] = {}
    for arg in value if isinstance(value, list) else [value]:
        name, sep, path = str(arg).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"{flag} wants NAME=PATH (a folder or a .safetensors file), got {arg!r}")
        if name.strip() in out:
            raise ConfigError(f"{what} name {name.strip()!r} is given twice")
        out[name.strip()] = absolute(path.strip())
    return out


def absolute(path: str) -> str:
    """Paths as the user meant them from where they ran ``serve``: workers and later requests may
    run elsewhere (systemd starts the daemon in /)."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


def preload_value(value: Any) -> tuple[str, ...]:
    try:
        return parse_preload(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def own_preload(table: dict[str, Any]) -> bool | None:
    """A ``[[models]]`` table's ``preload``: true or false (a string such as "no" would read as true)."""
    value = table.get("preload")
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"model {table.get('name', table['spec'])!r}: preload {value!r} is not true or false")
    return value


def check_batching(model: str | None, max_batch: Any, sizes: Any) -> str | None:
    """Why a ``max_batch`` or ``batch_sizes`` (the top level's, or ``model``'s own in its ``[[models]]`` table,
    where None is the top level's) would not do, or None. One reader for both, so a model's own value is
    refused in the words the top-level one is."""
    where, table = ("", "") if model is None else (f"model {model!r}: ", " in its [[models]] table")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        return (f"{where}max_batch must be a whole number of at least 1, got {max_batch!r}; give max_batch = N"
                f"{table} (the most outputs one forward runs: 16 suits a small model, 1 a large one)")
    if sizes is not None and sizes not in BATCH_SIZES:
        return (f"{where}batch_sizes {sizes!r} is not one of {', '.join(BATCH_SIZES)}{table} (auto: powers of two "
                "for compiled models, any size for eager ones)")
    return None


def parse_compile_mode(value: Any) -> str:
    """TOML ``compile = true`` means inductor's default mode, ``false`` eager; a string names a mode."""
    if value is True:
        return "default"
    if value is False or value is None:
        return ""
    return str(value)


_CONTROL_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
UNION_CLASS = "ControlNetUnionModel"  # SDXL's union ControlNets (xinsir's layout), their own pipelines
CONTROLNET_FORMS = "NAME=PATH or NAME=PATH,modes=NAME:NAME:... (a union ControlNet's modes, in their order)"
_MODE_NAME = re.compile(r"[a-z0-9_-]{1,64}")
_OPTION = re.compile(r"\s*([A-Za-z_]\w*)\s*=(.*)$", re.DOTALL)  # a ``,key=value`` after a path


@dataclass(frozen=True)
class ControlNetSetting:
    """A served ControlNet: its folder or file, and the names of a union one's modes (in mode order;
    empty: requests give the numbers). diffusers' configs do not name the modes, the model card does."""

    path: str
    modes: tuple[str, ...] = ()


def parse_controlnets(value: Any) -> dict[str, ControlNetSetting]:
    """``--controlnet NAME=PATH[,modes=A:B:...]`` (a list of those) or a TOML ``[controlnets]`` table whose
    values are ``"PATH[,modes=A:B:...]"`` or tables ``{path, modes}`` (modes a list or ``"A:B"``)."""
    out: dict[str, ControlNetSetting] = {}
    for name, setting, where in named_settings(value, "controlnet", CONTROLNET_FORMS):
        if isinstance(setting, dict):
            path, options = _table(setting, ("modes",), where)
        else:
            path, options = split_options(str(setting), ("modes",), (".safetensors",), where, CONTROLNET_FORMS)
        modes = options.get("modes", ())
        names = [str(m) for m in modes] if isinstance(modes, list | tuple) else str(modes).split(":")
        out[name] = ControlNetSetting(path=absolute(path.strip()), modes=tuple(n.strip() for n in names))
    return out


def named_settings(value: Any, flag: str, forms: str) -> list[tuple[str, Any, str]]:
    """``--FLAG NAME=SETTING`` (a list of those) or a TOML ``[FLAGs]`` table -> (name, setting, where it was
    written, for messages), each name once."""
    items: list[tuple[str, Any, str]] = []
    if isinstance(value, dict):
        items = [(str(k), v, f"[{flag}s] {k}") for k, v in value.items()]
    else:
        for arg in value if isinstance(value, list) else [value]:
            name, sep, rest = str(arg).partition("=")
            if not sep or not name.strip() or not rest.strip():
                raise ConfigError(f"--{flag} wants {forms}, got {str(arg)[:200]!r}")
            items.append((name.strip(), rest, f"--{flag} {str(arg)[:200]}"))
    names = [name for name, _, _ in items]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ConfigError(f"{flag} name {twice!r} is given twice")
    return items


def _table(value: dict[str, Any], keys: tuple[str, ...], where: str) -> tuple[str, dict[str, Any]]:
    """A TOML table setting: its ``path`` (a string) and the options ``keys`` name, or a ConfigError."""
    unknown = sorted(set(map(str, value)) - {"path", *keys})
    if unknown or not isinstance(value.get("path"), str):
        takes = ", ".join(["path (a string)", *keys[:-1]]) + f" and {keys[-1]}"
        raise ConfigError(f"{where}: a table takes {takes}"
                          f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}")
    return str(value["path"]), {k: value[k] for k in keys if k in value}


def split_options(text: str, keys: tuple[str, ...], endings: tuple[str, ...], where: str,
                  forms: str) -> tuple[str, dict[str, str]]:
    """``PATH,key=value,...`` -> the path and the options, read from the right: only ``,word=...`` ends
    that do not end as a model file does are options, so a path with a comma in it (``/models/4x,sharp.pth``,
    ``/models/a,v=2.pth``) still reads as the path it always did."""
    parts = text.split(",")
    options: dict[str, str] = {}
    while len(parts) > 1 and (m := _OPTION.match(parts[-1])) and not parts[-1].strip().lower().endswith(endings):
        key = m.group(1)
        if key not in keys:
            raise ConfigError(f"{where}: unknown option {key!r}; the forms are {forms}")
        if key in options:
            raise ConfigError(f"{where}: {key} is given twice")
        options[key] = m.group(2).strip()
        parts.pop()
    path = ",".join(parts)
    if not path.strip():
        raise ConfigError(f"{where}: no path; the forms are {forms}")
    return path, options


def check_mode_names(name: str, setting: ControlNetSetting) -> str | None:
    """Why a ControlNet's ``modes=`` cannot be served (None: fine): one name per mode its config has,
    each of ``[a-z0-9_-]``, not a bare number (that is a mode's number), and each once."""
    if not setting.modes:
        return None
    count, where = control_modes(setting.path), f"ControlNet {name!r}: modes="
    if not count:
        return (f"{where}{':'.join(setting.modes)[:200]}, but it has a single control mode (its config.json has "
                "no num_control_type or num_mode); leave out modes=")
    if len(setting.modes) != count:
        return (f"{where} names {len(setting.modes)} modes, but the ControlNet has {count}; name each of them, "
                "in the order of their numbers (the model card says which is which)")
    for mode in setting.modes:
        if not _MODE_NAME.fullmatch(mode) or mode.isdigit():
            return (f"{where}{mode[:80]!r} is not a mode name: give 1-64 of a-z, 0-9, '_' and '-', not a bare number "
                    "(requests give numbers as numbers)")
    twice = next((m for i, m in enumerate(setting.modes) if m in setting.modes[:i]), None)
    if twice is not None:
        return f"{where}{twice!r} is given twice; each mode needs its own name"
    return None


def controlnet_config(path: str) -> dict[str, Any]:
    """A ControlNet folder's ``config.json`` ({} for a single file, or one that does not parse)."""
    try:
        cfg = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def control_modes(path: str) -> int:
    """How many control modes a union ControlNet folder has (0: not a union one), from its
    ``config.json`` as diffusers writes it: ``ControlNetUnionModel``'s ``num_control_type`` (SDXL's,
    xinsir's layout), or a ``FluxControlNetModel``'s ``num_mode`` (InstantX's union). Read by the
    engine at start, without torch, so admission checks a request's ``mode`` before any worker runs it;
    a single checkpoint file has no config to say: it is a single-mode ControlNet (a union one's is
    refused at start, ``union_file``)."""
    cfg = controlnet_config(path)
    count = cfg.get("num_control_type") if cfg.get("_class_name") == UNION_CLASS else cfg.get("num_mode")
    return count if isinstance(count, int) and count > 0 else 0


def check_controlnet(name: str, path: str) -> str | None:
    """Why ``name``/``path`` cannot be served (None: fine); what the configuration refuses at start."""
    if not 1 <= len(name) <= 64 or not set(name) <= _CONTROL_NAME_OK:
        return f"ControlNet name {name!r} must be 1-64 characters of letters, digits, '_', '-' and '.'"
    if not path.strip() or "\x00" in path:
        return f"ControlNet {name!r}: the path {path!r} is empty or holds a NUL character"
    p = Path(path).expanduser()
    if not p.is_absolute():
        return f"ControlNet {name!r}: the path {path!r} is relative; give an absolute path"
    try:
        if p.is_dir():
            if not (p / "config.json").is_file():
                return f"ControlNet {name!r} ({p}) is a folder without config.json; give a folder save_pretrained wrote"
            return None
        if not p.is_file():
            return (f"ControlNet {name!r} ({p}) does not exist; give a diffusers ControlNet folder or a "
                    ".safetensors file")
    except OSError as exc:
        return f"ControlNet {name!r}: the path {path[:120]!r} cannot be read ({exc.strerror or exc})"
    if p.suffix != ".safetensors":
        return f"ControlNet {name!r} ({p}) is not a .safetensors file; single files are read as safetensors only"
    return union_file(name, p)


# A union ControlNet's own tensors, as diffusers names them (its classes in models/controlnets/): SDXL's
# ControlNetUnionModel (xinsir's layout) has a row of ``task_embedding`` per mode and the transformer over
# them (``transformer_layes``, sic; its ``control_type_proj`` holds no weights), FLUX's union (InstantX's)
# a row of ``controlnet_mode_embedder`` per mode. -> (what it is, its class, the tensor whose rows are its modes)
_SDXL_UNION = ("an SDXL union ControlNet", UNION_CLASS, "task_embedding")
_UNION_TENSORS = {"task_embedding": _SDXL_UNION, "transformer_layes.": _SDXL_UNION,
                  "controlnet_mode_embedder.": ("a FLUX union ControlNet", "FluxControlNetModel with num_mode",
                                                "controlnet_mode_embedder.weight")}
FOLDER_WEIGHTS = "diffusion_pytorch_model.safetensors"  # what from_pretrained reads in a ControlNet folder


def union_file(name: str, p: Path) -> str | None:
    """Why single file ``p`` cannot be served (None: a single-mode ControlNet, read with ``from_single_file``).
    A union ControlNet cannot: diffusers 0.42 reads ``ControlNetUnionModel`` and ``FluxControlNetModel`` from
    a folder only (neither is in ``from_single_file``'s table, and ``ControlNetModel.from_single_file``
    takes neither's weights), and without its config.json the engine could not know its modes either.
    People download union ControlNets as one file (``diffusion_pytorch_model_promax.safetensors``), so
    its header says what it is and the message what to do with it."""
    try:
        shapes = read_shapes(p)
    except WeightsError as exc:
        return f"ControlNet {name!r}: {exc}; give a diffusers ControlNet folder or a .safetensors file"
    kind = next((_UNION_TENSORS[k] for k in _UNION_TENSORS if any(t.startswith(k) for t in shapes)), None)
    if kind is None:
        return None
    what, cls, counted = kind
    rows = shapes.get(counted, ())
    modes = f", {rows[0]} control modes" if rows else ""
    where = (f"ControlNet {name!r} ({p}) is {what} ({cls}{modes}); diffusers reads it from a folder (its "
             "config.json and weights), not as a single file")
    if control_modes(str(p.parent)):  # the model's repository, downloaded whole: its config.json is there
        if p.name == FOLDER_WEIGHTS:
            return f"{where}; give the folder it lies in: --controlnet {name}={p.parent}"
        return (f"{where}, and reads the folder's weights from {FOLDER_WEIGHTS}: copy this file under that name "
                f"into a new folder with {p.parent / 'config.json'}, and give that folder: --controlnet {name}=FOLDER")
    return (f"{where}; put it in a folder as {FOLDER_WEIGHTS} beside the config.json of the repository it came "
            f"from (the model's page lists both), and give that folder: --controlnet {name}=FOLDER")


def parse_ip_adapters(value: Any) -> dict[str, tuple[str, str]]:
    """``--ip-adapter NAME=PATH[,image_encoder=DIR]`` (a list of those) or a TOML ``[ip_adapters]`` table
    (name = "PATH[,image_encoder=DIR]") -> name -> (weights file, image encoder folder).

    PATH is the weights file (``.safetensors``) or a folder holding exactly one; the image encoder is
    the ``image_encoder/`` folder beside that file unless ``image_encoder=DIR`` says otherwise: the
    layout of h94/IP-Adapter's ``models/`` folders, where several adapters share one encoder."""
    items = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else (
        value if isinstance(value, list) else [value])
    out: dict[str, tuple[str, str]] = {}
    for arg in items:
        name, sep, rest = str(arg).partition("=")
        path, comma, option = rest.partition(",")
        key, eq, encoder = option.partition("=")
        if not sep or not name.strip() or not path.strip() or (comma and (key.strip() != "image_encoder"
                                                                          or not eq or not encoder.strip())):
            raise ConfigError(f"--ip-adapter wants NAME=PATH or NAME=PATH,image_encoder=DIR, got {arg!r}")
        if name.strip() in out:
            raise ConfigError(f"IP-Adapter name {name.strip()!r} is given twice")
        weights = Path(absolute(path.strip()))
        if weights.is_dir():
            files = sorted(weights.glob("*.safetensors"))
            if len(files) != 1:
                raise ConfigError(f"IP-Adapter {name.strip()!r}: the folder {weights} holds {len(files)} .safetensors "
                                  "files; name the weights file itself")
            weights = files[0]
        out[name.strip()] = (str(weights),
                             absolute(encoder.strip()) if comma else str(weights.parent / "image_encoder"))
    return out


def check_ip_adapter(name: str, weights: str, encoder: str) -> str | None:
    """Why an IP-Adapter cannot be served (None: fine); what the configuration refuses at start."""
    if not 1 <= len(name) <= 64 or not set(name) <= _CONTROL_NAME_OK:
        return f"IP-Adapter name {name!r} must be 1-64 characters of letters, digits, '_', '-' and '.'"
    try:
        if not Path(weights).is_file():
            return f"IP-Adapter {name!r}: {weights} does not exist; give its .safetensors weights file"
        if not weights.endswith(".safetensors"):
            return f"IP-Adapter {name!r}: {weights} is not a .safetensors file (no pickle)"
        if not (Path(encoder) / "config.json").is_file():
            return (f"IP-Adapter {name!r}: its image encoder {encoder} is not a folder with config.json; "
                    "give image_encoder=DIR (a CLIPVisionModelWithProjection's save_pretrained folder)")
    except (OSError, ValueError) as exc:
        return f"IP-Adapter {name!r}: {weights[:120]!r} cannot be read ({exc})"
    return None


def check_upscaler(name: str, path: str) -> str | None:
    """Why ``--upscaler name=path`` cannot be served, before spandrel reads it (None: fine so far)."""
    flag = f"--upscaler {name}={path[:120]}"
    if not 1 <= len(name) <= 64 or not set(name) <= _CONTROL_NAME_OK:
        return f"{flag}: the name must be 1-64 characters of letters, digits, '_', '-' and '.'"
    p = Path(path)
    if "\x00" in path or not p.is_absolute():
        return f"{flag}: give an absolute path without NUL characters"
    if p.suffix.lower() not in (".pth", ".safetensors"):
        return f"{flag}: upscalers are read from .pth or .safetensors files (spandrel's state dicts)"
    try:
        if not p.is_file():
            return f"{flag}: no such file"
    except OSError as exc:
        return f"{flag}: the file cannot be read ({exc.strerror or exc})"
    return None


UPSCALER_FORMS = "NAME=PATH, NAME=PATH,tile=N or NAME=PATH,tile=N,overlap=N"


def parse_upscalers(value: Any) -> dict[str, UpscalerSetting]:
    """``--upscaler NAME=PATH[,tile=N][,overlap=N]`` (a list of those) or a TOML ``[upscalers]`` table
    whose values are ``"PATH[,tile=N][,overlap=N]"`` or tables ``{path, tile, overlap}``.

    Options are read from the right, and only ``,word=...`` ends that do not end as a model file does
    are options, so a path with a comma in it (``/models/4x,sharp.pth``, ``/models/a,v=2.pth``)
    still reads as the path it always did."""
    return {name: _upscaler_setting(setting, where)
            for name, setting, where in named_settings(value, "upscaler", UPSCALER_FORMS)}


def _upscaler_setting(value: Any, where: str) -> UpscalerSetting:
    options: dict[str, Any]
    if isinstance(value, dict):
        path, options = _table(value, ("tile", "overlap"), where)
        if not path.strip():
            raise ConfigError(f"{where}: no path; the forms are {UPSCALER_FORMS}")
    else:
        path, options = split_options(str(value), ("tile", "overlap"), (".pth", ".safetensors"), where,
                                      UPSCALER_FORMS)
    tile = _whole(options.get("tile", DEFAULT_TILE), "tile", where)
    # left out, the overlap is a quarter of a tile smaller than 128: tile=64 alone is a valid setting
    overlap = _whole(options["overlap"], "overlap", where) if "overlap" in options else \
        min(DEFAULT_OVERLAP, tile // 4) if tile else DEFAULT_OVERLAP
    if tile != 0 and not MIN_TILE <= tile <= MAX_TILE:
        raise ConfigError(f"{where}: tile {tile} is not 0 (the whole picture at once) or a side of {MIN_TILE} to "
                          f"{MAX_TILE} input pixels")
    if overlap < 0:
        raise ConfigError(f"{where}: overlap {overlap} is negative; give 0 or more input pixels")
    if tile and 2 * overlap >= tile:
        raise ConfigError(f"{where}: overlap {overlap} must be under half the tile ({tile}), so that a tile "
                          "is more than its blended edges")
    return UpscalerSetting(path=absolute(path.strip()), tile=tile, overlap=overlap)


def _whole(value: Any, key: str, where: str) -> int:
    """A whole number of pixels from a flag's text or a TOML integer (TOML's true is not one)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]{1,12}", value.strip()):
        return int(value)
    shown = repr(value[:40]) if isinstance(value, str) else json.dumps(value, default=str)[:40]  # TOML's spelling: true
    raise ConfigError(f"{where}: {key} {shown} is not a whole number of input pixels")
