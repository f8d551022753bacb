"""How many bytes a model's weights take, from its files' headers alone.

Residency has to know whether a model fits before it loads it, and the engine never loads torch, so the
answer comes from the safetensors headers: 8 bytes of little-endian length, then a JSON object naming each
tensor's dtype, shape and byte range. Reading a header costs one small read per file, whatever the model's
size. The files are untrusted (a download, a hand-edited folder), so every header is bounded before it is
parsed: its length, its nesting and its numbers, and each fault is an error that names the file.

A diffusers folder is sized component by component (``model_index.json`` names them), each by the files its
worker will read: where a component holds several variants of its weights, the loader's own rule chooses
(pipelines/variants.py), and a component the loader does not read (the safety checker) is not counted.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from diffusiond.pipelines.variants import NOT_LOADED, choose_variant, weight_names

MAX_HEADER_BYTES: Final = 100_000_000
"""The safetensors library's own limit, far above any real header (FLUX.1's transformer: about 100 kB). A
hostile header this long, full of valid numbers, still takes seconds and about 1 GB to parse, so the engine
should size models off its event loop (a thread)."""
MAX_INDEX_BYTES: Final = 50_000_000
"""A sharded model's ``*.safetensors.index.json`` (a few hundred kB for the largest models)."""
MAX_DEPTH: Final = 3
"""A safetensors header is 3 levels deep (tensors, their entry, its lists); an index is 2."""
MAX_NUMBER_DIGITS: Final = 20
"""Every number a header may hold is a byte offset or a dimension, so it fits in 64 bits."""
MAX_CHECKED_BYTES: Final = 16_000_000
"""The longest header parsed with each integer checked (a long digit run, most likely in metadata text)."""
_DIGITS_TO_1: Final = bytes(49 if 48 <= b <= 57 else 32 for b in range(256))  # digits -> "1", the rest -> " "

DTYPE_BITS: Final[Mapping[str, int]] = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64, "U32": 32,
    "U16": 16, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}
"""Bits per element of each safetensors dtype (the sub-byte ones are packed, rounded up to whole bytes)."""

FLOATS: Final = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
"""What loading at a ``torch_dtype`` converts: diffusers 0.42 casts every floating-point parameter without a
quantizer, float8 included (``model_loading_utils.load_model_dict_into_meta``), so an fp8 checkpoint takes
the model's dtype once loaded; integers, bools and the packed sub-byte formats stay as stored."""

TARGET_BYTES: Final[Mapping[str, int]] = {"float32": 4, "float16": 2, "bfloat16": 2}
"""The model dtypes diffusiond loads at (protocol.MODEL_DTYPES) and their element size."""

DEFAULT_DTYPE: Final = "float32"
"""The dtype a model loads at on a CPU unless ``--dtype`` says (``serve``; ``fit`` takes it too, so that the two
agree)."""


def default_dtype(devices: tuple[str, ...] | str) -> str:
    """A model's dtype when none is given: bfloat16 on a GPU (float32 there doubled every model's memory and
    halved its speed for nothing a diffusion model's outputs show), float32 on a CPU, where
    half precision is slow. ``--dtype float16`` for GPUs without bfloat16 (before Ampere).

    One dtype per model, all its workers and its sizing alike: a list that mixes the CPU and GPUs gets the GPUs'
    (its CPU worker runs bfloat16, slowly; docs/api.md says so and how to avoid it). A dtype per
    worker would need the pool to resolve it per device and residency to size the model per device."""
    names = (devices,) if isinstance(devices, str) else devices
    return "bfloat16" if any(d.startswith("cuda") for d in names) else DEFAULT_DTYPE


class WeightsError(ValueError):
    """A model's weight files cannot be sized; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class WeightFile:
    """One safetensors file's tensors, summed by dtype (all that sizing needs)."""

    path: Path
    bytes_by_dtype: Mapping[str, int]
    tensors: int

    @property
    def stored_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    def bytes_at(self, dtype: str) -> int:
        """Bytes once loaded at ``dtype``: float tensors take its element size, the rest stay as stored."""
        size = _target(dtype)
        return sum(n * size * 8 // DTYPE_BITS[d] if d in FLOATS else n for d, n in self.bytes_by_dtype.items())


@dataclass(frozen=True)
class ModelWeights:
    """The weight files one model loads, grouped by component ("" for a single checkpoint)."""

    path: Path
    components: Mapping[str, tuple[WeightFile, ...]] = field(default_factory=dict)

    @property
    def files(self) -> tuple[WeightFile, ...]:
        return tuple(f for files in self.components.values() for f in files)

    @property
    def stored_bytes(self) -> int:
        """Bytes on disk of tensor data (what a load reads)."""
        return sum(f.stored_bytes for f in self.files)

    def bytes_at(self, dtype: str) -> int:
        """Bytes on the device once loaded at ``dtype`` (fp32 files loaded as float16: half)."""
        return sum(f.bytes_at(dtype) for f in self.files)


def model_weights(path: str | os.PathLike[str], dtype: str = "float32", variant: str | None = None) -> ModelWeights:
    """The weights of a model given as a diffusers folder, one component's folder, or a .safetensors file."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise WeightsError(f"{p}: only .safetensors checkpoints can be sized without loading them "
                               "(a .bin/.ckpt is a pickle, which diffusiond does not open in the engine)")
        return ModelWeights(p, {"": (read_header(p),)})
    if not p.is_dir():
        raise WeightsError(f"{p}: no such file or folder")
    index = p / "model_index.json"
    if not index.exists():
        return ModelWeights(p, {"": component_files(p, dtype, variant)})
    entries = _load_json(index, MAX_INDEX_BYTES, "model_index.json")
    if not isinstance(entries, dict):
        raise WeightsError(f"{index}: expected a JSON object naming the pipeline's components")
    components: dict[str, tuple[WeightFile, ...]] = {}
    for name, spec in sorted(entries.items()):
        # components look like "unet": ["diffusers", "UNet2DConditionModel"]; a [null, null] one is absent
        if (name.startswith("_") or name in NOT_LOADED or not isinstance(spec, list) or None in spec
                or not (p / name).is_dir()):
            continue
        components[name] = component_files(p / name, dtype, variant)
    return ModelWeights(p, components)


def pipeline_class_name(folder: Path) -> str | None:
    """The pipeline class a diffusers folder's ``model_index.json`` names (what the loader builds), None where it
    names none; a WeightsError where the file is unreadable."""
    entries = _load_json(folder / "model_index.json", MAX_INDEX_BYTES, "model_index.json")
    name = entries.get("_class_name") if isinstance(entries, dict) else None
    return name if isinstance(name, str) else None


def component_files(folder: Path, dtype: str = "float32", variant: str | None = None) -> tuple[WeightFile, ...]:
    """The weight files one component loads: a sharded index's shards, or single files, of one variant."""
    sets = _weight_sets(folder)
    pick = choose_variant(set(sets), dtype, variant)
    if pick is None:
        return ()
    return tuple(read_header(f) for f in sorted(sets[pick]))


def _weight_sets(folder: Path) -> dict[str, set[Path]]:
    """Variant -> the files that make up that variant's weights in one folder (a sharded index: its shards)."""
    sets: dict[str, set[Path]] = {}
    for variant, names in weight_names(f.name for f in folder.iterdir()).items():
        for name in names:
            files = _shards(folder / name) if name.endswith(".json") else {folder / name}
            sets.setdefault(variant, set()).update(files)
    return sets


def _shards(index: Path) -> set[Path]:
    doc = _load_json(index, MAX_INDEX_BYTES, "sharded weights index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(f"{index}: expected a JSON object with a \"weight_map\" of tensor name -> shard file")
    shards = set()
    for name in set(weight_map.values()):
        if "/" in name or "\\" in name or name in ("", ".", "..") or not name.endswith(".safetensors"):
            raise WeightsError(f"{index}: shard {name!r} is not a .safetensors file name in the index's folder")
        shard = index.parent / name
        if not shard.is_file():
            raise WeightsError(f"{index}: names shard {name!r}, which is missing from {index.parent}")
        shards.add(shard)
    return shards


def read_header(path: str | os.PathLike[str]) -> WeightFile:
    """One safetensors file's tensor bytes by dtype, read from its header and checked against its length."""
    return _read(path)[1]


def read_tensors(path: str | os.PathLike[str]) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Each tensor's (dtype, bytes as stored, shape), by name: what ``fit`` groups into blocks and modules to size
    offloaded configurations (the shape: which are a linear layer's, for ``fp8=rowwise``). The header is checked
    exactly as ``read_header`` checks it."""
    header, _ = _read(path)
    return {name: (e["dtype"], e["data_offsets"][1] - e["data_offsets"][0], tuple(e["shape"]))
            for name, e in header.items() if name != "__metadata__"}


def read_entries(path: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (dtype, shape), by name: what a live update for a model with no worker is checked
    against (issue 29). Checked exactly as ``read_header`` checks it."""
    header, _ = _read(path)
    return {name: (e["dtype"], tuple(e["shape"])) for name, e in header.items() if name != "__metadata__"}


def read_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, by name: what tells a single checkpoint's kind (a union ControlNet's mode
    embedding, its number of modes) where no config says it. Checked exactly as ``read_header`` checks it."""
    header, _ = _read(path)
    return {name: tuple(e["shape"]) for name, e in header.items() if name != "__metadata__"}


def _read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], WeightFile]:
    """A safetensors file's header (every entry checked, ``_describe``) and its tensors summed by dtype."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{p}: not a safetensors file: {len(head)} bytes, shorter than the 8-byte "
                                   "header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise WeightsError(f"{p}: not a safetensors file (or a corrupt one): its header length is {n} "
                                   f"bytes, over the limit of {MAX_HEADER_BYTES}")
            if n > size - 8:
                raise WeightsError(f"{p}: truncated: its header length is {n} bytes but the file holds "
                                   f"{size - 8} after the length")
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{p}: cannot be read: {e.strerror or e}") from None
    header = _parse(raw, p, "safetensors header")
    return header, _describe(p, header, size - 8 - n)


def _describe(p: Path, header: Any, data_bytes: int) -> WeightFile:
    if not isinstance(header, dict):
        raise WeightsError(f"{p}: its safetensors header is not a JSON object")
    by_dtype: dict[str, int] = {}
    tensors = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{p}: tensor {name[:200]!r}"
        if not isinstance(entry, dict):
            raise WeightsError(f"{where}: expected an object with dtype, shape and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise WeightsError(f"{where}: unknown dtype {str(dtype)[:40]!r} (known: {', '.join(DTYPE_BITS)})")
        if not isinstance(shape, list) or not all(_small_int(d) for d in shape):
            raise WeightsError(f"{where}: shape must be a list of non-negative integers, got {str(shape)[:80]}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_small_int(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise WeightsError(f"{where}: data_offsets must be [start, end] with 0 <= start <= end, "
                               f"got {str(offsets)[:80]}")
        start, end = offsets
        elements = 0 if 0 in shape else 1
        for d in shape if elements else ():
            elements *= d
            if elements * DTYPE_BITS[dtype] > 8 * data_bytes:
                break  # already more than the file holds: no need to multiply a hostile shape out
        expected = -(-elements * DTYPE_BITS[dtype] // 8)
        if end - start != expected:
            need = f"{expected} bytes" if expected <= data_bytes else f"more than the file's {data_bytes} bytes"
            raise WeightsError(f"{where}: holds {end - start} bytes but its dtype {dtype} and shape "
                               f"{str(shape)[:80]} need {need}; the header is corrupt")
        if end > data_bytes:
            raise WeightsError(f"{where}: ends at byte {end} of the data, but the file holds only {data_bytes} "
                               "bytes of data (truncated?)")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + end - start
        tensors += 1
    return WeightFile(p, by_dtype, tensors)


def _small_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _load_json(path: Path, limit: int, what: str) -> Any:
    try:
        size = path.stat().st_size
        if size > limit:
            raise WeightsError(f"{path}: {size} bytes, over the limit of {limit} for a {what}")
        raw = path.read_bytes()
    except OSError as e:
        raise WeightsError(f"{path}: cannot be read: {e.strerror or e}") from None
    return _parse(raw, path, what)


def _parse(raw: bytes, path: Path, what: str) -> Any:
    """JSON with its numbers and nesting bounded. CPython's parser counts its own recursion (RecursionError,
    in linear time, however deep the text); a run of more digits than any offset can have sends the text
    through a parser that checks each integer before converting it (slower, so only for such text)."""
    try:
        text = raw.decode("utf-8")
        if b"1" * (MAX_NUMBER_DIGITS + 1) not in raw.translate(_DIGITS_TO_1):  # a C-speed scan, unlike re
            return json.loads(text, parse_constant=_parse_constant)
        if len(raw) > MAX_CHECKED_BYTES:
            raise WeightsError(f"{path}: its {what} holds a number of more than {MAX_NUMBER_DIGITS} digits and is "
                               f"{len(raw)} bytes long; no valid file has both")
        return json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except WeightsError:
        raise
    except UnicodeDecodeError:
        raise WeightsError(f"{path}: its {what} is not UTF-8 text") from None
    except RecursionError:
        raise WeightsError(f"{path}: its {what} is nested too deeply to be a valid file (a safetensors header "
                           f"is {MAX_DEPTH} levels deep at most)") from None
    except ValueError as e:
        raise WeightsError(f"{path}: its {what} is not valid JSON ({str(e)[:200]})") from None


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number of {len(text)} digits, more than any offset or dimension can have")
    return int(text)


def _parse_constant(text: str) -> float:
    raise ValueError(f"{text} is not a number a header can hold")


def _target(dtype: str) -> int:
    try:
        return TARGET_BYTES[dtype]
    except KeyError:
        raise WeightsError(f"dtype {dtype!r} is not one of {', '.join(TARGET_BYTES)}") from None
