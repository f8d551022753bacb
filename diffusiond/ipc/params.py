"""A loaded model's parameters as live updates address them (issue 29): PARAM_TABLE, worker -> engine.

A live update for a model that runs no worker is checked by the engine, which has no torch and no model.
Its files' headers tell much but not all (``daemon/core/file_checks.py``); what a worker held the last time
it loaded the model tells exactly what a worker's own check would (``worker/weights.py``), whatever the
model's files, options or loader. So each worker sends it once per load, before READY, and the engine
remembers it in the state dir (``daemon/state/params.py``). Tens of thousands of rows for a large model:
the table travels as zlib-compressed msgpack (names repeat long prefixes), and is kept on disk as it came.
"""

from __future__ import annotations

import zlib

import msgspec


class ParamRow(msgspec.Struct, frozen=True, array_like=True):
    """One entry of a component's ``state_dict`` as ``update_weights`` names it (a LoRA-wrapped layer's under
    its base name); ``keeps``: the dtype it is kept in when that is not updated in place, else ''."""

    name: str
    shape: tuple[int, ...]
    keeps: str = ""


class LayerRow(msgspec.Struct, frozen=True, array_like=True):
    """One module a LoRA key can name (``pipelines/live_checks.Layer``'s fields: a Linear, a Conv2d with its
    kernel, or ``other``: the class of a module that takes no LoRA)."""

    path: str
    in_features: int = 0
    out_features: int = 0
    kernel: tuple[int, ...] = ()
    other: str = ""


class ComponentTable(msgspec.Struct, frozen=True, array_like=True):
    name: str
    params: list[ParamRow]
    layers: list[LayerRow]
    # its parameters are on the meta device (offload=sequential): ``update_weights`` cannot write them
    #. Last and defaulted, so a table kept before it was added still reads.
    out_of_reach: bool = False


class ParamTable(msgspec.Struct, frozen=True):
    components: list[ComponentTable]  # the pipeline's torch modules; none for a model that is no diffusers pipeline
    no_lora: str = ""  # why the model takes no LoRA adapter at all ('' when it takes them)
    name: str = ""  # the model's name in the worker's LoRA refusals (a random-weights model's says so)


class ParamTableFrame(msgspec.Struct, frozen=True):
    """PARAM_TABLE: ``table`` is ``pack(ParamTable)``, the bytes the engine keeps."""

    model_name: str
    table: bytes


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ParamTable)
MAX_TABLE = 64 << 20  # unpacked: far above any real model's (SDXL's is a few MB); a bound for bytes read from disk


def pack(table: ParamTable) -> bytes:
    return zlib.compress(_ENCODER.encode(table), 6)


def unpack(data: bytes) -> ParamTable:
    """The table, checked against its type; ValueError (msgspec's errors are ValueErrors too) if it is not one."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, MAX_TABLE)
    except zlib.error as exc:
        raise ValueError(f"not a packed parameter table: {exc}") from None
    if inflater.unconsumed_tail:
        raise ValueError(f"a parameter table over {MAX_TABLE} bytes unpacked")
    return _DECODER.decode(raw)
