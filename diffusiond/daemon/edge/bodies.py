"""Request bodies at the HTTP edge, read without buffering past their limits: a JSON body, the
multipart form of an edit, and an edit's images, decoded and checked in the encode pool.

Apart from ``api.py`` because this is where untrusted bytes are taken in: every size limit and
every malformed-body refusal is here, before a handler sees a field. Refusals are domain errors
(``errors.py``); their status codes are the edge's (``status.STATUS_OF_ERROR``).
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import aiohttp
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from diffusiond.daemon import errors
from diffusiond.daemon.core import inputs
from diffusiond.daemon.core.engine import Engine
from diffusiond.daemon.core.inputs import EditInput
from diffusiond.daemon.edge import edits, pictures, sizes
from diffusiond.daemon.errors import UploadTooLarge

ENCODINGS = ("gzip", "x-gzip", "deflate")
"""The Content-Encodings a body may come in. The server is started with ``auto_decompress=False``
(daemon/server.py): aiohttp's own decoding answers an encoding it lacks a library for (br, zstd)
with a plain-text 400 from its parser and bounds nothing after decompression; here every refusal
is the JSON shape, and the decompressed bytes are held to the same limit as a plain body."""


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it passes ``limit`` bytes (never buffered past it),
    decompressed (and still held to ``limit``) when its Content-Encoding says so."""
    encoding = _encoding(request)
    if request.content_length is not None and request.content_length > limit:
        raise too_large(request.content_length, limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
    except (RequestPayloadError, aiohttp.ClientPayloadError, HttpProcessingError) as exc:
        raise unreadable(request, exc) from None
    body = b"".join(chunks)
    return body if encoding is None else _decompress(request, body, encoding, limit)


def _encoding(request: web.Request) -> str | None:
    """The body's Content-Encoding, one of ``ENCODINGS``, or None for a plain body; any other a 400."""
    raw = request.headers.getall("Content-Encoding", [])
    names = [n.strip().lower() for v in raw for n in v.split(",") if n.strip() and n.strip().lower() != "identity"]
    if not names:
        return None
    if len(names) > 1 or names[0] not in ENCODINGS:
        shown = ", ".join(names)[:60]
        raise errors.invalid(f"Content-Encoding {shown!r} is not accepted; send the body uncompressed, or "
                             f"compressed once with {' or '.join(ENCODINGS[::2])}")
    return names[0]


def _decompress(request: web.Request, body: bytes, encoding: str, limit: int) -> bytes:
    # gzip: the gzip header (wbits 16+); deflate: zlib-wrapped as HTTP says, or raw as some clients send
    tries = (31,) if encoding in ("gzip", "x-gzip") else (15, -15)
    last: Exception | None = None
    for wbits in tries:
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(body, limit + 1)
        except zlib.error as exc:
            last = exc
            continue
        if len(out) > limit or d.unconsumed_tail:
            raise too_large(limit + 1, limit)
        if not d.eof:
            last = zlib.error("the compressed data ends early")
            continue
        return out
    raise unreadable(request, last or zlib.error("not compressed data"))


def unreadable(request: web.Request, exc: BaseException) -> errors.InvalidRequest:
    """A body aiohttp could not take in: most often a ``Content-Encoding`` (gzip, deflate) that the
    bytes are not in, which aiohttp finds only while reading (as ``RequestPayloadError``)."""
    encoding = request.headers.get("Content-Encoding")
    cause = exc.__cause__ or exc
    detail = f"{type(cause).__name__}: {cause}".strip().rstrip(":")[:200]
    if encoding:
        return errors.invalid(f"the request body is not valid {encoding[:40]!r} data, as its Content-Encoding "
                              f"header says ({detail}); send it uncompressed, or compressed as the header says")
    return errors.invalid(f"the request body could not be read ({detail})")


def _surrogates(text: str) -> bool:
    """Whether ``text`` holds lone surrogates: aiohttp decodes bytes that are not UTF-8 into them,
    and they cannot be encoded again (msgspec, logging, a JSON answer would fail on them)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def too_large(size: int, limit: int) -> UploadTooLarge:
    return UploadTooLarge(f"request body is too large: {size} bytes or more, the limit is {limit} "
                          "(limits.max_upload_bytes for requests with images, limits.max_body_bytes for the others)")


async def decode_edit(engine: Engine, fields: dict[str, Any], model: Any, *, image_field: str = "image",
                      mask_field: str = "mask", size_field: str | None = None) -> EditInput | None:
    """An edit's input, decoded and checked in the encode pool (never on the loop); None if
    the request is not an edit."""
    fields, earlier = pictures.plan(fields, model)  # ``images``: its last is the edit's image
    plan = edits.plan_edit(fields, model, engine.config.limits, image_field=image_field, mask_field=mask_field,
                           size_field=size_field)
    if plan is None:
        return None
    image, mask, task, strength = plan
    cfg = engine.config
    work = functools.partial(inputs.decode_edit, image, mask, task=task, strength=strength,
                             width=fields.get("width"), height=fields.get("height"), limits=cfg.limits,
                             input_dir=cfg.input_dir, step=sizes.side_step(model),
                             floor=sizes.side_floor(model, cfg.limits), pictures=earlier)
    edit = await inputs.decode_in_pool(engine.executor, work)  # closed there if the client hangs up meanwhile
    if fields.get("width") is None or fields.get("height") is None:  # a side taken from the picture
        try:
            sizes.check_inherited(edit.width, edit.height, image.field, model, cfg.limits)
        except BaseException:
            edit.close()
            raise
    return edit


async def read_edit_form(
    request: web.Request, limit: int
) -> tuple[list[tuple[str, str]], list[tuple[str, bytes]], bytes | None]:
    """The text fields (in order, repeats kept), the images (field name, bytes) and the mask of a multipart edit, read
    part by part with the whole body held to ``limit`` bytes; a malformed body is a 400."""
    if not request.content_type.startswith("multipart/"):
        raise errors.invalid(f"/v1/images/edits takes multipart/form-data (as OpenAI's does), got "
                             f"{request.content_type or 'no content type'!r}")
    if request.content_length is not None and request.content_length > limit:
        raise too_large(request.content_length, limit)
    if _encoding(request) is not None:
        raise errors.invalid("send the edit's multipart form uncompressed (no Content-Encoding): its images "
                             "are compressed already")
    text: list[tuple[str, str]] = []
    images: list[tuple[str, bytes]] = []
    mask: bytes | None = None
    size = 0
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise errors.invalid("nested multipart bodies are not accepted")
            name = part.name or ""
            if not name.isprintable() or _surrogates(name):
                raise errors.invalid(f"a form field's name {name[:60]!r} is not printable UTF-8 text; name fields "
                                     "as docs/api.md does (prompt, image, mask, ...)")
            chunks: list[bytes] = []
            while piece := await part.read_chunk(1 << 16):
                size += len(piece)
                if size > limit:
                    raise too_large(size, limit)
                chunks.append(piece)
            data = b"".join(chunks)
            if name in ("image", "image[]"):
                images.append((name, data))
            elif name == "mask":
                if mask is not None:
                    raise errors.invalid("send one mask", field="mask")
                mask = data
            elif part.filename is not None:
                raise errors.invalid(f"unexpected file field {name!r}; files go in 'image' and 'mask'", field=name)
            else:
                try:
                    text.append((name, data.decode()))
                except UnicodeDecodeError:
                    raise errors.invalid(f"field {name!r} is not UTF-8 text", field=name) from None
    except RequestPayloadError as exc:
        raise unreadable(request, exc) from None
    except (ValueError, AssertionError, RuntimeError, aiohttp.ClientPayloadError, HttpProcessingError) as exc:
        raise errors.invalid(f"the multipart body is malformed: {exc}") from None
    return text, images, mask
