"""GGUF files sized from their header alone, without torch, numpy or the ``gguf`` package.

``diffusiond fit`` runs in the command line process and the engine sizes models on its loop's threads; neither
may load torch, and the ``gguf`` package's reader maps the file through numpy (which the command line does
not load either, tests/test_cli_imports.py). The header is small and simple: magic ``GGUF``, a version, the
tensor and key-value counts, the key-values, then per tensor its name, dimensions, ggml type and offset.
A tensor's bytes follow from its type's block (``BLOCK``: elements per block, bytes per block, the table of
ggml's ``GGML_QUANT_SIZES``; tests/test_fit.py checks the two agree). Files are untrusted, so every count
and length is bounded before anything is allocated, and each fault is an error naming the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

from diffusiond.daemon.residency.sizes import MAX_HEADER_BYTES, WeightsError

MAGIC: Final = b"GGUF"
MAX_TENSORS: Final = 1_000_000
MAX_KEYS: Final = 1_000_000
MAX_DIMS: Final = 8
DEFAULT_ALIGNMENT: Final = 32

BLOCK: Final[dict[int, tuple[str, int, int]]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}
"""ggml type id -> (name, elements per block, bytes per block)."""

FLOAT_TYPES: Final = frozenset({"F32", "F16", "F64"})
"""Unquantized floats loaded at the model's dtype: diffusers makes F32 and F16 plain tensors, which it casts.
BF16 is not one: diffusers keeps it as stored (a GGUFParameter, dequantized per layer like Q8_0), so it is
counted at 2 bytes whatever the dtype (``STORED_BF16``); quantized types likewise stay as stored."""
STORED_BF16: Final = "GGUF-BF16"
"""The kind ``fit`` gives a GGUF file's BF16 tensors: safetensors' ``BF16`` is cast to the dtype, this one is not,
and it is no approximation (the weights run at the file's precision), unlike the quantized kinds."""

_SCALAR: Final = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
                  12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str  # the ggml type's name: Q8_0, F32, ...
    elements: int
    nbytes: int  # as stored in the file (and as diffusers keeps a quantized tensor on the device)


class _Reader:
    """Reads the header within MAX_HEADER_BYTES; every read is checked, so a short file is one clear error."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path, self.read_bytes = f, path, 0

    def take(self, n: int) -> bytes:
        self.read_bytes += n
        if self.read_bytes > MAX_HEADER_BYTES:
            raise WeightsError(f"{self.path}: its GGUF header is longer than {MAX_HEADER_BYTES} bytes; "
                               "not a diffusion model's file (or a corrupt one)")
        data = self.f.read(n)
        if len(data) != n:
            raise WeightsError(f"{self.path}: truncated inside its GGUF header (at byte {self.read_bytes - n})")
        return data

    def unpack(self, fmt: str) -> int | float:
        value: int | float = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def count(self, what: str, limit: int) -> int:
        n = int(self.unpack("<Q"))
        if n > limit:
            raise WeightsError(f"{self.path}: its GGUF header claims {n} {what}, over the limit of {limit}")
        return n

    def string(self) -> str:
        raw = self.take(self.count("bytes in a string", MAX_HEADER_BYTES))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise WeightsError(f"{self.path}: a string in its GGUF header is not UTF-8") from None

    def value(self, kind: int, depth: int = 0) -> object:
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth == 0:
            inner = int(self.unpack("<I"))
            for _ in range(self.count("array elements", MAX_HEADER_BYTES)):
                self.value(inner, depth + 1)
            return None  # arrays (tokenizer vocabularies in LLM files) are not needed for sizing
        raise WeightsError(f"{self.path}: unknown GGUF value type {kind} in its header")


def read_gguf(path: str | os.PathLike[str]) -> dict[str, GGUFTensor]:
    """Every tensor of a GGUF file, by name, with its bytes; checked against the file's length."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            r = _Reader(f, p)
            if r.take(4) != MAGIC:
                raise WeightsError(f"{p}: not a GGUF file (it does not start with 'GGUF')")
            version = int(r.unpack("<I"))
            if version not in (2, 3):
                raise WeightsError(f"{p}: GGUF version {version}; diffusiond reads versions 2 and 3")
            n_tensors = r.count("tensors", MAX_TENSORS)
            n_keys = r.count("key-values", MAX_KEYS)
            alignment = DEFAULT_ALIGNMENT
            for _ in range(n_keys):
                key = r.string()
                value = r.value(int(r.unpack("<I")))
                if key == "general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            infos = []
            for _ in range(n_tensors):
                name = r.string()
                n_dims = int(r.unpack("<I"))
                if n_dims > MAX_DIMS:
                    raise WeightsError(f"{p}: tensor {name[:200]!r} has {n_dims} dimensions (at most {MAX_DIMS})")
                dims = [int(r.unpack("<Q")) for _ in range(n_dims)]
                kind, offset = int(r.unpack("<I")), int(r.unpack("<Q"))
                infos.append((name, dims, kind, offset))
            data_start = -(-r.read_bytes // alignment) * alignment
    except OSError as e:
        raise WeightsError(f"{p}: cannot be read: {e.strerror or e}") from None
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, kind, offset in infos:
        if kind not in BLOCK:
            raise WeightsError(f"{p}: tensor {name[:200]!r} has ggml type {kind}, which diffusiond cannot size "
                               f"(known: {', '.join(n for n, _, _ in BLOCK.values())})")
        kind_name, block, block_bytes = BLOCK[kind]
        elements = 1
        for d in dims:
            elements *= d
        if elements % block:
            raise WeightsError(f"{p}: tensor {name[:200]!r} ({kind_name}) has {elements} elements, not a whole "
                               f"number of {block}-element blocks; the header is corrupt")
        nbytes = elements // block * block_bytes
        if data_start + offset + nbytes > size:
            raise WeightsError(f"{p}: tensor {name[:200]!r} ends past the end of the file (truncated?)")
        tensors[name] = GGUFTensor(name, kind_name, elements, nbytes)
    return tensors
