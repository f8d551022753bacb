"""JSON that json.dumps cannot write, for the fuzzing kit (part of tests/fuzzkit.py): ``Raw`` text put
into a document as is (numbers of any length, nesting of any depth), ``Utf8`` strings written
unescaped (lone surrogates as their bytes), the writer for both, and ``nasty_values``, the hostile
values every JSON-carrying family draws from, by kind.

Apart because it is plain data, with no notion of HTTP, a daemon or a surface: the JSON bodies, the
edits form's text fields and the header families all draw from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


@dataclass(frozen=True)
class Raw:
    """JSON text put into a document as is: numbers of any length, nesting of any depth."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''} len={len(self.text)})"


class Utf8(str):
    """A string to be written unescaped as UTF-8 (lone surrogates as their surrogatepass bytes)."""

    __slots__ = ()


def to_json(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Utf8):
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ",".join(f"{to_json(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
    return json.dumps(value)


def json_bytes(value: Any) -> bytes:
    return to_json(value).encode("utf-8", "surrogatepass")


def nested(depth: int, kind: str = "list") -> Raw:
    if kind == "dict":
        return Raw('{"a":' * depth + "1" + "}" * depth)
    if kind == "mixed":
        return Raw('[{"a":' * (depth // 2) + "1" + "}]" * (depth // 2))
    return Raw("[" * depth + "]" * depth)


DIGITS_4301 = "9" * 4301
# by kind, each kind drawn as often as the others: a rare kind is not starved by a long list
NASTY_KINDS: dict[str, list[Any]] = {
    "huge numbers": [Raw(str(10**309)), Raw("-" + str(10**309)), Raw(DIGITS_4301), Raw("-" + DIGITS_4301),
                     Raw("1" + "0" * 5000), Raw("1" * 4300 + ".5"), Raw("0." + "0" * 5000 + "1"), 2**63, 2**64,
                     -(2**63) - 1, 10**30],
    "non-finite": [Raw("1e309"), Raw("-1e309"), Raw("1e-400"), 1e308, -1e308, 5e-324],
    # not JSON at all: the whole body is refused, which hides every other field, so one kind of six
    "not json": [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), math.nan, math.inf, -math.inf],
    "wrong types": [-1, 0, 1, 1.5, -0.0, True, False, None, "", " ", "1", "64", "64x64", "nan", "inf", "1e309",
                    DIGITS_4301, [], {}, [1], {"a": 1}, [[[]]]],
    "deep nesting": [nested(1001), nested(1500, "dict"), nested(3000, "mixed"), nested(100_000),
                     [{"name": nested(1200)}], {"every": nested(1200, "dict")}],
    "unicode": ["\x00", "\ud800", "\udfff", Utf8("\ud800x"), "\u202e", "💥" * 50, "x" * 20_000, Raw('"\\ud800"'),
                Raw('"\\u0000"'), "ﬀ", "\u0301" * 100],
}
NASTY: list[Any] = [v for values in NASTY_KINDS.values() for v in values]
nasty_values = st.one_of([st.sampled_from(values) for values in NASTY_KINDS.values()])
