"""A job's ``stage`` as clients read it, once the job has ended: the stage it ended in, which its ``error.stage``
names too. A job cancelled while residency held it back read ``waiting_for_memory`` on top and ``queued`` in its
error. The engine runs with fake workers (tests/test_residency_turns.py's two models, of which the
budget holds one), since a real daemon on a CPU holds a job back only under a crafted budget; what is checked is
the JSON ``views.job`` renders for every endpoint that shows a job."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
from enginekit import Harness
from test_residency_turns import harness, submit

from diffusiond.daemon.edge import views
from diffusiond.daemon.residency.turns import Turns

G = 1 << 30


@pytest.fixture
async def two(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    h = await harness(monkeypatch, 4 * G, 4 * G)
    yield h
    await h.close()


async def test_a_job_cancelled_while_held_back_shows_one_stage_on_top_and_in_its_error(two: Harness) -> None:
    h = two
    h.engine.keeper.turns = Turns(math.inf)  # b waits for memory while a holds the device, however long
    submit(h, "a")
    b = submit(h, "b")
    assert views.job(b)["stage"] == "waiting_for_memory", views.job(b)
    h.engine.cancel(b.id)
    shown = views.job(b)
    assert shown["status"] == "cancelled" and shown["stage"] == shown["error"]["stage"], shown
