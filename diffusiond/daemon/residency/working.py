"""Working memory: what a forward needs on top of the weights, per shape, measured and remembered.

A model's weights are known from its files; what one forward needs besides (activations, the VAE's decode,
the allocator's slack) depends on width, height, batch and frames, and only a run can tell. Workers
report each shape's peak after it runs; the engine keeps them in its state dir (``to_dict``/``from_dict``)
so a restarted daemon plans with measurements, not guesses. Until a model has run, a conservative
default stands in.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

log = logging.getLogger(__name__)

DEFAULT_PER_MEGAPIXEL: Final = 3 * 1024**3
"""Default working bytes per million output pixels (per frame, per batch item): above SDXL's and FLUX's
measured peaks at 1024x1024 in bf16 with the VAE's decode, so the default errs towards evicting more."""
DEFAULT_WEIGHT_SHARE: Final = 0.25
"""Plus this share of the weights, for what grows with the model (its text encoders' activations, buffers)."""
EXTRAPOLATION_MARGIN: Final = 1.25
"""A shape larger than any measured one: linear in pixels, plus this margin for what grows faster."""
FORMAT_VERSION: Final = 1

_KEY: Final = re.compile(r"(\d{1,6})x(\d{1,6})x(\d{1,4})x(\d{1,5})")


@dataclass(frozen=True, order=True)
class Shape:
    """What a forward's working memory depends on: output size, batch and frames (1 for an image)."""

    width: int
    height: int
    batch: int = 1
    frames: int = 1

    def __post_init__(self) -> None:
        for name in ("width", "height", "batch", "frames"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"shape {name} must be a positive integer, got {v!r}")

    @property
    def elements(self) -> int:
        return self.width * self.height * self.batch * self.frames

    def within(self, other: Shape) -> bool:
        """No larger than ``other`` in any dimension: a run of this shape needs no more than one of ``other``."""
        return (self.width <= other.width and self.height <= other.height and self.batch <= other.batch
                and self.frames <= other.frames)

    @property
    def key(self) -> str:
        """The shape as it is stored in the state dir: ``WxHxBATCHxFRAMES``."""
        return f"{self.width}x{self.height}x{self.batch}x{self.frames}"

    @classmethod
    def from_key(cls, key: str) -> Shape:
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"shape key {key[:60]!r} is not WIDTHxHEIGHTxBATCHxFRAMES (e.g. 1024x1024x1x1)")
        w, h, b, f = (int(g) for g in m.groups())
        return cls(w, h, b, f)

    def halves(self) -> tuple[Shape, Shape]:
        """The two batches an out-of-memory batch is retried as (the first takes the odd one)."""
        if self.batch < 2:
            raise ValueError(f"a batch of {self.batch} cannot be split")
        first = (self.batch + 1) // 2
        return (Shape(self.width, self.height, first, self.frames),
                Shape(self.width, self.height, self.batch - first, self.frames))

    def __str__(self) -> str:
        frames = f", {self.frames} frames" if self.frames > 1 else ""
        return f"{self.width}x{self.height}, batch {self.batch}{frames}"


@dataclass(frozen=True)
class Estimate:
    """Working bytes for one shape (what a plan makes room for), and what a measurement proves: ``measured`` when
    any run of the model informs ``nbytes`` (never below ``floor``); ``floor`` the bytes a job of the shape needs at
    least: this shape's own peak when it ran, else the largest peak of a run no larger in any of width, height, batch
    and frames (working memory grows with each) capped by the smallest of one no smaller in any (``_floor``), named
    by ``floor_how``. Only the floor refuses or fails a job: a larger shape's peak bounds
    the job from above and an extrapolation overestimates (a small shape's peak is mostly fixed costs), so both plan
    a job and neither refuses one."""

    nbytes: int
    measured: bool
    how: str
    floor: int = 0
    floor_how: str = ""


def default_working(weight_bytes: int, shape: Shape) -> int:
    """The guess before a model's first run: generous, since a low guess ends in an out-of-memory retry."""
    return int(weight_bytes * DEFAULT_WEIGHT_SHARE + DEFAULT_PER_MEGAPIXEL * shape.elements / 1e6)


def _floor(peaks: Mapping[Shape, int], shape: Shape) -> tuple[int, str]:
    """What an unmeasured ``shape`` needs at least, and where that was measured: the largest peak of a shape no
    larger in any way, but never more than the smallest peak of one no smaller in any way, which ran in that
    much. A run's peak covers what rode with it (an upscaler's tiles at the upscaled size, a ControlNet, an
    IP-Adapter), so a small shape may have peaked higher than a larger one without them."""
    below = [(peak, s) for s, peak in peaks.items() if s.within(shape)]
    if not below:
        return 0, ""
    floor, under = max(below)
    how = f"measured at {under}, no larger in any way"
    above = [(peak, s) for s, peak in peaks.items() if shape.within(s)]
    if above and min(above)[0] < floor:
        floor, over = min(above)
        how += f", capped at what {over} took, no smaller in any way"
    return floor, how


class Measurements:
    """Peak working bytes per model and shape; stale ones (the weights changed) are not used."""

    def __init__(self) -> None:
        self._models: dict[str, tuple[int, dict[Shape, int]]] = {}

    def record(self, model: str, weight_bytes: int, shape: Shape, peak_bytes: int) -> bool:
        """Keep the largest peak seen for the shape: a plan built on it should not fail the next run. True where
        that changed the model's ``entry`` (a new shape, a larger peak), so a steady stream of runs writes nothing."""
        if peak_bytes < 0:
            raise ValueError(f"{model}: a peak of {peak_bytes} working bytes for {shape} is negative")
        known, peaks = self._models.get(model, (weight_bytes, {}))
        if known != weight_bytes:
            peaks = {}  # another model under the same name: its measurements say nothing about this one
        before = peaks.get(shape)
        peaks[shape] = max(peak_bytes, peaks.get(shape, 0))
        self._models[model] = (weight_bytes, peaks)
        return peaks[shape] != before

    def peaks(self, model: str, weight_bytes: int) -> Mapping[Shape, int]:
        known, peaks = self._models.get(model, (weight_bytes, {}))
        return peaks if known == weight_bytes else {}

    def keyed(self, model: str, weight_bytes: int) -> dict[str, int]:
        """The peaks by shape key (``WxHxBATCHxFRAMES``), for the weights now: what ``GET /v1/models`` shows."""
        return {s.key: p for s, p in sorted(self.peaks(model, weight_bytes).items())}

    def estimate(self, model: str, weight_bytes: int, shape: Shape) -> Estimate:
        """From this shape's peak; else the smallest peak of a larger shape (working memory grows with
        the pixels); else the largest measured shape's, scaled linearly with a margin; else
        ``default_working``."""
        peaks = self.peaks(model, weight_bytes)
        if shape in peaks:  # its own run proves what it needs, whatever a smaller shape's peak held
            return Estimate(peaks[shape], True, f"measured at {shape}", peaks[shape], f"measured at {shape}")
        floor, how = _floor(peaks, shape)
        larger = [(peak, s) for s, peak in peaks.items() if s.elements >= shape.elements]
        if larger:
            peak, s = min(larger)
            return Estimate(max(peak, floor), True, f"measured at the larger {s}", floor, how)
        if peaks:
            # from the largest one measured: a small shape's peak is mostly fixed costs, which do not scale
            peak, s = max((p, s) for s, p in peaks.items() if s.elements == max(t.elements for t in peaks))
            scaled = int(peak * shape.elements / s.elements * EXTRAPOLATION_MARGIN)
            return Estimate(max(scaled, floor), True, f"estimated from {s}, the largest measured", floor, how)
        return Estimate(default_working(weight_bytes, shape), False, "default estimate (not measured yet)")

    def entry(self, model: str) -> dict[str, Any] | None:
        """One model's measurements as the state dir keeps them (``load`` reads it back), or None."""
        if model not in self._models:
            return None
        wb, peaks = self._models[model]
        return {"weight_bytes": wb, "peaks": {s.key: p for s, p in sorted(peaks.items())}}

    def load(self, model: str, entry: Any) -> None:
        """What ``entry`` wrote, checked: the state dir is a file anyone could have edited. A bad entry
        raises ValueError naming the model and adds nothing of it."""
        where = "working-memory measurements"
        wb = entry.get("weight_bytes") if isinstance(entry, dict) else None
        peaks = entry.get("peaks") if isinstance(entry, dict) else None
        if not isinstance(wb, int) or not _count(wb) or not isinstance(peaks, dict):
            raise ValueError(f"{where}: model {str(model)[:80]!r} needs \"weight_bytes\" (a non-negative "
                             "integer) and \"peaks\" (an object of shape key -> bytes)")
        checked = []
        for key, peak in peaks.items():
            if not _count(peak):
                raise ValueError(f"{where}: model {model!r} shape {str(key)[:60]!r}: peak must be a "
                                 f"non-negative integer, got {str(peak)[:40]}")
            try:
                checked.append((Shape.from_key(str(key)), peak))
            except ValueError as exc:
                raise ValueError(f"{where}: model {model!r}: {exc}") from None
        for shape, peak in checked:
            self.record(model, wb, shape, peak)

    def remember(self, entries: Mapping[str, Any]) -> None:
        """At start, the entries the last run kept (model name -> ``entry``), so the first plans use them. One that
        does not read is logged and left out: the model's runs measure it again, which a start must not fail for."""
        for name, entry in entries.items():
            try:
                self.load(name, entry)
            except ValueError as exc:
                log.warning("%s; it is measured again as it runs", exc)

    def to_dict(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION,
                "models": {name: self.entry(name) for name in sorted(self._models)}}

    @classmethod
    def from_dict(cls, data: Any) -> Measurements:
        """What ``to_dict`` wrote, checked (``load`` for each model)."""
        where = "working-memory measurements"
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{where}: expected an object with \"version\": {FORMAT_VERSION}")
        models = data.get("models")
        if not isinstance(models, dict):
            raise ValueError(f"{where}: expected \"models\" to be an object of model name -> measurements")
        out = cls()
        for name, entry in models.items():
            out.load(str(name), entry)
        return out


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63
