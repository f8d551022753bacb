"""A request whose client hangs up while its pictures are decoded in the engine's pool leaves nothing open.

aiohttp cancels the handler of a connection that is lost (``handler_cancellation``), but a decode already
running in a pool thread cannot be stopped: it goes on and returns the pictures in a sealed memfd. Nobody
owned that memfd any more, so each hang-up at that moment kept an fd and the pictures' memory for the
daemon's life (a busy pool, where decodes wait behind encodes, made it common: clients time out there).
Each image-carrying field is decoded at its own call site (an edit's image, control images, IP-Adapter
references); each must close what its cancelled decode returns. In process, with the decode held on an
event, so the cancel lands inside it every time; against a real daemon: tests/test_edge_contract.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from diffusiond.daemon.config import Limits
from diffusiond.daemon.core import inputs
from diffusiond.daemon.edge import bodies, controls, ip_adapters
from diffusiond.daemon.edge.controls import ControlBody
from diffusiond.daemon.edge.ip_adapters import IpAdapterBody
from diffusiond.ipc.messages import Capabilities

MODEL = SimpleNamespace(name="m", capabilities=Capabilities(width=64, height=64, edits=("image-to-image",)))


class Decoded:
    """What a decode returns: pictures in a memfd, here only whether it was closed."""

    def __init__(self) -> None:
        self.closed = False
        self.width = self.height = 64

    def close(self) -> None:
        self.closed = True


def _engine(pool: ThreadPoolExecutor) -> Any:
    return SimpleNamespace(executor=pool, config=SimpleNamespace(limits=Limits(), input_dir=None),
                           check_controls=lambda *_: None, check_ip_adapters=lambda *_: None,
                           controls=SimpleNamespace(modes={}, mode_names={}, classes={}))


CALLS: dict[str, tuple[ModuleType, str, Callable[[Any], Awaitable[Any]]]] = {
    "image": (inputs, "decode_edit",
              lambda engine: bodies.decode_edit(engine, {"prompt": "a", "image": "eA=="}, MODEL)),
    "control": (controls, "decode_controls",
                lambda engine: controls.attach(engine, {"control": [ControlBody(name="c", image="eA==")]}, MODEL,
                                               SimpleNamespace(edit=None, width=64, height=64))),
    "ip_adapter": (ip_adapters, "decode_references",
                   lambda engine: ip_adapters.attach(engine, {"ip_adapter": [IpAdapterBody(name="s", image="eA==")]},
                                                     MODEL, SimpleNamespace(buffer=None))),
}


@pytest.mark.parametrize("field", list(CALLS))
async def test_a_decode_whose_handler_is_cancelled_is_closed_when_it_ends(
        monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    module, name, call = CALLS[field]
    started, release = threading.Event(), threading.Event()
    made: list[Decoded] = []

    def decode(*_: Any, **__: Any) -> Decoded:
        started.set()
        release.wait(30)
        made.append(Decoded())
        return made[-1]

    monkeypatch.setattr(module, name, decode)
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1) as pool:
        handler = asyncio.ensure_future(call(_engine(pool)))
        assert await loop.run_in_executor(None, started.wait, 30)
        handler.cancel()  # the client hung up while its pictures were being decoded
        with pytest.raises(asyncio.CancelledError):
            await handler
        release.set()
    # the pool has shut down: the decode has returned, and what it made reaches the loop in a callback
    for _ in range(500):
        if made and made[0].closed:
            break
        await asyncio.sleep(0.01)
    assert made and made[0].closed, f"the {field} decoded for a request whose client left was never closed"
