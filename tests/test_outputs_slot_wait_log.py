"""A copy that waits for arena room asks again every second until --slot-timeout-s: the first ask of a request is
news worth INFO, the repeats are not (one INFO line a second per waiting copy would flood the log)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
from enginekit import ARENA, Harness

from diffusiond.ipc.messages import SlotWait

ENGINE_LOG = "diffusiond.daemon.core.engine"


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness()
    await harness.engine.start()
    yield harness
    await harness.close()


def waits(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == ENGINE_LOG and r.levelno == level and "waits for" in r.getMessage()]


async def test_the_first_ask_of_a_request_is_info_its_repeats_debug(h: Harness,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=ENGINE_LOG)
    for _ in range(3):
        h.worker.send(SlotWait("r1", ARENA // 2, ARENA // 2, ARENA))
    assert len(waits(caplog, logging.INFO)) == 1
    assert len(waits(caplog, logging.DEBUG)) == 2
    h.worker.send(SlotWait("r2", ARENA // 2, ARENA // 2, ARENA))  # the next copy that waits is news again
    assert len(waits(caplog, logging.INFO)) == 2
