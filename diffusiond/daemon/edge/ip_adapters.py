"""A job's ``ip_adapter`` field: its shape checked here, its IP-Adapters against the registry, its images in the pool.

Runs after ``requests.check`` and ``controls.attach``, on the request they built. Every mistake is a
400 naming the entry and field (``ip_adapter[0].scale``). Several entries act together (up to
``MAX_IP_ADAPTERS``, the same adapter twice with two pictures too), in the request's order, which the
batch key keeps. References combine with an edit (image-to-image, inpainting) or with ControlNets, as
ComfyUI and Forge users combine them: the worker runs the edit's or the ControlNets' sibling pipeline
with the adapters in the shared denoiser. A job sends one input buffer, so the references join the
edit's or control's arrays in a new one, and the old one is closed at once (its arrays are copied,
not kept twice for the job's life).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import msgspec

from diffusiond.daemon.core.inputs import decode_in_pool
from diffusiond.daemon.core.ip_adapters import MAX_IP_ADAPTERS, MAX_SCALE, IpAdapterEntry, decode_references
from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.edge.controls import check_scale, image_source
from diffusiond.daemon.errors import invalid
from diffusiond.protocol import Task

if TYPE_CHECKING:
    from diffusiond.daemon.core.engine import Engine


class IpAdapterBody(msgspec.Struct, forbid_unknown_fields=True):
    """One entry of ``ip_adapter``: a served IP-Adapter, its reference picture, how strongly it steers."""

    name: str
    image: str | None = None  # base64 or a data URL
    image_path: str | None = None  # a file under --input-dir
    scale: float = 1.0


def plan(raw: list[Any]) -> list[IpAdapterEntry]:
    """The entries' shape: a count the pipeline can run, an image each, a scale in bounds."""
    if len(raw) > MAX_IP_ADAPTERS:
        raise invalid(f"ip_adapter has {len(raw)} entries; at most {MAX_IP_ADAPTERS} IP-Adapters act at once: "
                      "send fewer entries", field="ip_adapter")
    entries: list[IpAdapterEntry] = []
    for i, body in enumerate(raw):
        b = body if isinstance(body, IpAdapterBody) else msgspec.convert(body, IpAdapterBody)
        at = f"ip_adapter[{i}]"
        source = image_source(at, b.image, b.image_path)
        check_scale(at, b.scale, MAX_SCALE)
        entries.append(IpAdapterEntry(name=b.name, source=source, scale=b.scale))
    return entries


async def attach(engine: Engine, fields: dict[str, Any], model: Any, req: JobRequest) -> JobRequest:
    """``req`` with its decoded reference images (unchanged when it has none)."""
    raw = fields.get("ip_adapter")
    if not raw:
        return req
    entries = plan(list(raw))
    if model.capabilities.task != Task.TEXT_TO_IMAGE.value:
        raise invalid(f"model {model.name!r} does {model.capabilities.task}; IP-Adapters steer text-to-image "
                      "models", field="ip_adapter")
    engine.check_ip_adapters(model.name, [e.name for e in entries])
    cfg = engine.config
    joined = req.buffer  # an edit's image and mask, or control images: they travel in the new buffer
    work = functools.partial(decode_references, entries, limits=cfg.limits, input_dir=cfg.input_dir, joined=joined)
    decoded = await decode_in_pool(engine.executor, work)
    if joined is not None:
        joined.close()  # its owner's close() is then a no-op; the job closes the new one with the rest
    return dataclasses.replace(req, ip_adapter=decoded,
                               ip_adapters=tuple((r.name, r.scale, r.digest) for r in decoded.refs))
