"""The worker's start line names every span of a model's load (issue 31: on an H200, 6.5 s of SD 1.5's 7.9 s
"model" phase was in none of its brackets, so no one could say where it went). A fake clock, so the figures are
the ones the spans took."""

from __future__ import annotations

import time

import pytest

from diffusiond.pipelines.phases import Phases
from diffusiond.worker.startup import StartPhases


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def test_the_brackets_name_what_ran_before_the_loads_first_span_and_after_its_last(clock: list[float]) -> None:
    start = StartPhases()
    clock[0] += 0.010
    start.mark("arena")
    clock[0] += 0.400  # spec, reading the saved preset's index, the progress hook
    load = Phases()
    for name, took in (("import", 0.020), ("files", 0.700), ("to cuda", 0.300)):
        clock[0] += took
        load.mark(name)
    clock[0] += 0.050  # nothing marks this: a wrapper, a check
    start.model(load)
    assert str(start).endswith("arena 10 ms, model (spec and cache lookup 400 ms, import 20 ms, files 700 ms, "
                               "to cuda 300 ms, other 50 ms) 1470 ms")


def test_a_loader_that_names_no_file_reading_has_it_counted_before_its_spans(clock: list[float]) -> None:
    """A hub id's or a single file's loader marks no "files" span: they are read before the pipeline's first."""
    start = StartPhases()
    clock[0] += 2.0
    load = Phases()
    clock[0] += 0.030
    load.mark("sibling pipelines")
    start.model(load)
    assert str(start).endswith("model (spec and files 2000 ms, sibling pipelines 30 ms) 2030 ms")


def test_a_model_without_spans_is_one_phase(clock: list[float]) -> None:
    start = StartPhases()
    clock[0] += 0.5
    start.model(None)
    assert str(start).endswith("model 500 ms")
