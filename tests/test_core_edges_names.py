"""A request's ControlNet and IP-Adapter names at admission: one check for both, so their refusals read alike."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from diffusiond.daemon.core.controls import ControlRegistry
from diffusiond.daemon.core.ip_adapters import IpAdapterRegistry
from diffusiond.daemon.errors import InvalidRequest


@dataclass
class _Model:
    name: str = "m"
    controlnet_errors: dict[str, str] = field(default_factory=dict)
    ip_adapter_errors: dict[str, str] = field(default_factory=dict)


@pytest.mark.parametrize(("registry", "what", "where"), [
    (ControlRegistry({}), "ControlNet", "control[0].name"),
    (IpAdapterRegistry({}), "IP-Adapter", "ip_adapter[0].name"),
])
def test_an_unknown_name_is_refused_naming_what_is_served_and_echoed_at_most_64_characters(
        registry: ControlRegistry | IpAdapterRegistry, what: str, where: str) -> None:
    """The request chose the name's length: a ControlNet's refusal echoed all of it, an IP-Adapter's 64."""
    with pytest.raises(InvalidRequest) as refused:
        registry.resolve(_Model(), ["x" * 500])  # type: ignore[arg-type]
    message = refused.value.message
    assert message.startswith(f"no {what} named '{'x' * 64}';") and "x" * 65 not in message, message
    assert "none are served (serve --" in message and refused.value.field == where
