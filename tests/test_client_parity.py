"""The blocking ``Client`` takes what ``AsyncClient`` takes, method by method (its ``create_job``
had none of the keywords docs/api.md names, so a sync caller could not shorten the wait for a starting daemon)."""

from __future__ import annotations

import inspect

from diffusiond.client.aio import AsyncClient
from diffusiond.client.sync import Client


def test_every_method_of_both_clients_takes_the_same_parameters() -> None:
    shared = [name for name, _ in inspect.getmembers(AsyncClient, inspect.isfunction)
              if not name.startswith("_") and hasattr(Client, name)]
    assert "create_job" in shared and "generate" in shared
    for name in shared:
        want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(AsyncClient, name)).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(Client, name)).parameters.values()]
        assert got == want, name
