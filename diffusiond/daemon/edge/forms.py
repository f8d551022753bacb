"""OpenAI's Images request bodies: the JSON of ``/v1/images/generations`` and the multipart form of
``/v1/images/edits``, in OpenAI's field names, read into the fields ``requests.check`` takes.

OpenAI's own fields that have no meaning for a local diffusion model are accepted and ignored, so
the official openai client works unmodified; a form's values are text, typed here, and its
repeated and flattened fields (``loras[][name]``, ``preview[every]``) are read the ways that
client and curl send them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from diffusiond.daemon.edge.controls import ControlBody
from diffusiond.daemon.edge.ip_adapters import IpAdapterBody
from diffusiond.daemon.edge.requests import (
    LoraBody,
    PreviewBody,
    check_int_sizes,
    decode,
    refused,
)
from diffusiond.daemon.edge.sizes import SIZE
from diffusiond.daemon.edge.upscale import HiresBody, UpscaleBody
from diffusiond.daemon.errors import invalid


class ImagesBody(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON of ``/v1/images/generations``; the edits form's text fields are these and more (``EditsForm``).
    A subclass keeps ``forbid_unknown_fields`` and puts its own fields after these."""

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str = "b64_json"
    output_format: str | None = None  # the task's own when left out: png, or mp4 from a video model
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    timeout_s: float | None = None
    scheduler: str | None = None
    preview: PreviewBody | None = None  # extra_body in the openai client; a form's preview[every], or JSON text
    loras: list[LoraBody] | None = None  # see ``form_loras`` for the spellings a form can use
    # /v1/jobs' fields beside the prompt (extra_body in the openai client), through the same ``attach``
    # calls; a form's lists are read by ``form_entries``, its objects as ``preview`` is
    ip_adapter: list[IpAdapterBody] | None = None
    control: list[ControlBody] | None = None
    upscale: UpscaleBody | None = None
    hires: HiresBody | None = None
    # OpenAI's partial images as a stream of events: refused when true (``openai_fields``), never ignored
    stream: bool | None = None
    # OpenAI fields with no meaning for a local diffusion model: accepted, ignored.
    quality: Any = None
    style: Any = None
    user: Any = None
    background: Any = None
    moderation: Any = None
    output_compression: Any = None
    partial_images: Any = None  # partial pictures of a stream; without one, OpenAI ignores it too


class EditsForm(ImagesBody):
    """The text fields of a multipart ``/v1/images/edits`` request (the files are read apart)."""

    strength: float | None = None
    # OpenAI's edit fields with no meaning for a local diffusion model: accepted, ignored.
    input_fidelity: Any = None
    complexity: Any = None
    frame_count: Any = None
    frame_duration_ms: Any = None
    safety_identifier: Any = None
    svg: Any = None


def images_body(body: bytes) -> ImagesBody:
    """The JSON of ``/v1/images/generations``, decoded once: its model is known before the rest is checked."""
    return decode(body, ImagesBody)


def openai_fields(req: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-shaped fields (``size``, ``num_inference_steps``, ``response_format``) in the
    names ``check`` reads."""
    if req.get("stream"):  # ignored, the SDK's stream found no event in the one JSON answer: the picture was lost
        raise invalid("stream is not available here: this endpoint answers once its job has ended, with the whole "
                      "result; leave stream out (stream=False), or send the job to POST /v1/jobs and follow its "
                      "progress and previews on GET /v1/jobs/{id}/events", field="stream")
    if req["response_format"] not in ("b64_json", "url"):
        raise invalid("response_format must be 'b64_json' or 'url'", field="response_format")
    size = req.get("size")
    if size is not None and size != "auto":
        m = SIZE.match(size)
        if not m:
            raise invalid(f"size must look like 512x512, got {size!r}", field="size")
        req["width"], req["height"] = int(m.group(1)), int(m.group(2))
    req["steps"] = req.get("num_inference_steps")
    req["steps_field"] = "num_inference_steps"
    return req


def edits_form(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """The text fields of a multipart edit, typed (form values are text: "0.6" is read as 0.6).

    ``pairs`` keep the form's order and repeats, which ``loras`` needs (see ``form_loras``); any
    other field given twice is refused rather than silently taking one of the two values."""
    fields: dict[str, Any] = {}
    lora_parts: list[tuple[str, str]] = []
    entry_parts: dict[str, list[tuple[str, str]]] = {field: [] for field in ENTRY_KEYS}
    objects: dict[str, dict[str, str]] = {}  # preview[every]=5: the openai client's flattening of an object
    for name, value in pairs:
        entries = name.partition("[")[0]
        if name == "loras" or name.startswith("loras["):
            lora_parts.append((name, value))
        elif entries in ENTRY_KEYS and (name == entries or name.startswith(f"{entries}[")):
            entry_parts[entries].append((name, value))
        elif (key := _object_key(name)) is not None:
            _form_object(fields, objects, key, name, value)
        elif name.startswith("svg["):  # OpenAI's nested options arrive flattened: as ignored as svg itself
            continue
        elif name in fields:
            raise invalid(f"field {name!r} is given twice; send it once", field=name)
        else:
            fields[name] = value
    if lora_parts:
        fields["loras"] = form_loras(lora_parts)
    fields.update(objects)
    for field, parts in entry_parts.items():
        if parts:
            fields[field] = form_entries(parts, field)
    try:
        form = msgspec.convert(fields, EditsForm, strict=False)
    except msgspec.ValidationError as exc:
        raise refused(exc, EditsForm) from None
    check_int_sizes(form)
    return openai_fields(msgspec.structs.asdict(form))


OBJECT_KEYS = {"preview": ("every", "format", "max_side"), "upscale": ("name", "scale"),
               "hires": ("scale", "strength", "steps", "upscaler")}
"""The form fields whose value is one object, and its keys: JSON text in one field, or flattened."""


def _object_key(name: str) -> str | None:
    key = name.partition("[")[0]
    return key if key in OBJECT_KEYS and (name == key or name.startswith(f"{key}[")) else None


def _form_object(fields: dict[str, Any], objects: dict[str, dict[str, str]], key: str, name: str, value: str) -> None:
    """One part of an object field (``preview``, ``upscale``, ``hires``) of a form: the whole object as
    JSON text in a field of its name, or one of its keys as the openai client flattens
    ``extra_body={"upscale": {"name": ...}}`` (``upscale[name]``). Values stay text, typed with the rest."""
    spellings = f'JSON text ({{"{OBJECT_KEYS[key][0]}": ...}}) or the fields ' + ", ".join(
        f"{key}[{k}]" for k in OBJECT_KEYS[key])
    part = name.removeprefix(f"{key}[").removesuffix("]")
    if key in fields or (name == key and key in objects) or part in objects.get(key, {}):
        raise invalid(f"field {name!r} is given twice; send it once", field=key)
    if name != key:
        objects.setdefault(key, {})[part] = value
        return
    try:
        fields[key] = msgspec.json.decode(value)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested over ~1,000 levels
        raise invalid(f"{key} is not valid JSON: {value[:80]!r}; send {spellings}", field=key) from None


def form_loras(parts: list[tuple[str, str]]) -> list[dict[str, str]]:
    """``loras`` of a multipart form, in any of the three spellings clients send:

    - the official openai client's flattening of ``extra_body={"loras": [{"name", "weight"}]}``:
      every ``loras[][name]``, then every ``loras[][weight]`` (the k-th weight is the k-th name's);
    - JSON text in one ``loras`` field, as ``/v1/jobs`` takes it;
    - the CLI's shorthand in one ``loras`` field: ``ink:0.8,dots`` (weight 1 when left out).

    Values stay text here: ``msgspec.convert`` types and checks them with the rest of the form."""
    entries: list[dict[str, str]] = []
    for name, value in parts:
        if name == "loras":
            text = value.strip()
            if text.startswith("["):
                entries.extend(_json_objects(text, "loras", '{"name", "weight"}'))
            else:
                for spec in filter(None, (p.strip() for p in text.split(","))):
                    lname, _, weight = spec.partition(":")
                    entries.append({"name": lname, "weight": weight or "1"})
        elif name in ("loras[][name]", "loras[][weight]"):
            continue  # paired below: httpx sends every name first, then every weight
        else:
            raise invalid(f"unexpected form field {name!r}; send loras as loras[][name] and loras[][weight], "
                          "as JSON text, or as name:weight,name:weight", field="loras")
    names = [v for n, v in parts if n == "loras[][name]"]
    weights = [v for n, v in parts if n == "loras[][weight]"]
    if len(weights) != len(names):
        raise invalid(f"loras has {len(names)} names and {len(weights)} weights; give each adapter both",
                      field="loras")
    entries.extend({"name": n, "weight": w} for n, w in zip(names, weights, strict=True))
    return entries


# the form fields whose value is a list of entries (ip_adapter[][name], ...), and each entry's keys
ENTRY_KEYS = {"ip_adapter": ("name", "image", "image_path", "scale"),
              "control": ("name", "image", "image_path", "scale", "start", "end", "preprocess", "mode")}


def _json_objects(text: str, field: str, shape: str) -> list[dict[str, Any]]:
    """A form field holding JSON text, as ``/v1/jobs`` takes the same field: a list of objects, or a 400."""
    try:
        decoded = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested over ~1,000 levels
        raise invalid(f"{field} is not valid JSON: {text[:80]!r}", field=field) from None
    if not isinstance(decoded, list) or not all(isinstance(e, dict) for e in decoded):
        raise invalid(f"{field} must be a list of {shape} objects", field=field)
    return decoded


def form_entries(parts: list[tuple[str, str]], field: str) -> list[dict[str, str]]:
    """``ip_adapter`` or ``control`` of a multipart form: JSON text in one field of that name, as
    ``/v1/jobs`` takes it, or the openai client's flattening of ``extra_body={"control": [{...}]}``
    (``control[][name]``, ``control[][image]``, ...; the k-th value of each key is the k-th entry's, and
    the client sends each key's values together, so every entry must give the same keys). Their pictures
    are base64 text either way: the form's file fields are the image to edit and its mask."""
    keys = ENTRY_KEYS[field]
    entries: list[dict[str, str]] = []
    flat: dict[str, list[str]] = {}
    for name, value in parts:
        if name == field:
            entries.extend(_json_objects(value, field, "{" + ", ".join(f'"{k}"' for k in keys[:2]) + ", ...}"))
            continue
        key = name.removeprefix(f"{field}[][").removesuffix("]")
        if not name.startswith(f"{field}[][") or key not in keys:
            raise invalid(f"unexpected form field {name[:60]!r}; send {field} as JSON text or as "
                          f"{', '.join(f'{field}[][{k}]' for k in keys)}", field=field)
        flat.setdefault(key, []).append(value)
    if len({len(v) for v in flat.values()}) > 1:  # the client sends each key's values together: no boundaries
        counts = ", ".join(f"{len(v)} {k}" for k, v in flat.items())
        raise invalid(f"{field}'s flattened fields hold {counts}: the k-th value of each key is the k-th entry's, "
                      f"so give every key in every entry, or send {field} as JSON text", field=field)
    count = max((len(v) for v in flat.values()), default=0)
    entries.extend({k: v[i] for k, v in flat.items()} for i in range(count))
    return entries
