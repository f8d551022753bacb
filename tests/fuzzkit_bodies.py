"""The fuzzing kit's families for what a request carries (part of tests/fuzzkit.py): JSON jobs and
generations with one to three fields changed (each field's own hostile values), an edit's image as
base64 in the body or as an ``image_path`` under ``--input-dir``, the multipart edits form, and
``POST /v1/loras`` with crafted files.

Apart from tests/fuzzkit_envelope.py (the request line, headers and credentials around a body)
because these reach the daemon's decoders and range checks, and those reach its HTTP parser and access
rules; the two halves of the families would not fit one module under 500 lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fuzzkit_env import Ctx
from fuzzkit_images import as_base64, image_bytes, image_corpus
from fuzzkit_json import DIGITS_4301, Raw, json_bytes, nasty_values, nested
from fuzzkit_wire import Req
from hypothesis import strategies as st

BOUNDARY = "fzkB0undary7"

JOB_BASE = {"prompt": "a fox", "model": "tiny", "width": 64, "height": 64, "steps": 1}
GEN_BASE = {"prompt": "a fox", "model": "tiny", "size": "64x64", "num_inference_steps": 1}
JOB_FIELDS = ["prompt", "model", "n", "width", "height", "steps", "guidance_scale", "negative_prompt", "seed",
              "output_format", "output_dtype", "num_frames", "fps", "timeout_s", "scheduler", "image", "image_path",
              "mask", "mask_path", "strength", "loras", "preview", "keep_alive", "noise_level", "eta",
              "control", "ip_adapter", "trajectory", "upscale", "hires", "audio", "images"]
GEN_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
              "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "loras", "preview",
              "quality", "style", "user", "background", "moderation", "output_compression", "stream",
              "partial_images", "control", "ip_adapter", "upscale", "hires"]
EDIT_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
               "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "strength", "quality",
               "background", "input_fidelity", "user", "loras", "preview", "ip_adapter", "control", "upscale",
               "hires"]
NUMERIC_FIELDS = {"n", "width", "height", "steps", "num_inference_steps", "guidance_scale", "seed", "num_frames", "fps",
                  "timeout_s", "strength", "output_compression", "partial_images", "noise_level", "eta"}
# the scheduler a field belongs to (issue 29): sent with it half the time, so the value's own range check is reached
NOISE_SCHEDULERS = {"noise_level": "flow-sde", "eta": "ddim"}
UNKNOWN_FIELDS = ["zz", "", "\x00", "\ud800", "prompt ", "PROMPT", "__proto__", "x" * 300]


def listener(ctx: Ctx) -> st.SearchStrategy[str]:
    return st.sampled_from(ctx.listeners)


def lora_values(ctx: Ctx) -> st.SearchStrategy[Any]:
    names = st.sampled_from([*ctx.loras, "nope", "", "../x", "x" * 65]) | nasty_values
    entry = st.fixed_dictionaries({"name": names}, optional={"weight": nasty_values | st.floats(-5, 5)})
    return st.lists(entry, max_size=3) | nasty_values


def control_values(ctx: Ctx) -> st.SearchStrategy[Any]:
    """ControlNet entries: names none of these daemons serve, images and numbers nasty or plausible."""
    entry = st.fixed_dictionaries({"name": st.sampled_from(["edges", "", "../x", "x" * 65]) | nasty_values},
                                  optional={"image": st.builds(as_base64, image_bytes(), st.integers(0, 5))
                                            | nasty_values,
                                            "image_path": path_values(ctx) | nasty_values,
                                            "scale": nasty_values | st.floats(-1, 5),
                                            "start": nasty_values | st.floats(-1, 2),
                                            "end": nasty_values | st.floats(-1, 2),
                                            "preprocess": nasty_values | st.sampled_from(["none", "canny"]),
                                            "mode": nasty_values | st.integers(-2, 8)
                                            | st.sampled_from(["canny", "depth", "", "Tile", "x" * 65])})
    return st.lists(entry, max_size=5) | nasty_values


def ip_adapter_values(ctx: Ctx) -> st.SearchStrategy[Any]:
    """IP-Adapter entries: names none of these daemons serve, images and scales nasty or plausible."""
    entry = st.fixed_dictionaries({"name": st.sampled_from(["style", "", "../x", "x" * 65]) | nasty_values},
                                  optional={"image": st.builds(as_base64, image_bytes(), st.integers(0, 5))
                                            | nasty_values,
                                            "image_path": path_values(ctx) | nasty_values,
                                            "scale": nasty_values | st.floats(-1, 5)})
    return st.lists(entry, max_size=6) | nasty_values  # past the cap of 4 entries


def images_values(ctx: Ctx) -> st.SearchStrategy[Any]:
    """An edit's several pictures (issue 30): bare base64, entries with image or image_path, nasty ones; past
    the cap of 3, empty, on models that take one picture an edit (all of the fuzzing daemons')."""
    picture = st.builds(as_base64, image_bytes(), st.integers(0, 5))
    entry = picture | nasty_values | st.fixed_dictionaries({}, optional={
        "image": picture | nasty_values, "image_path": path_values(ctx) | nasty_values, "zz": nasty_values})
    return st.lists(entry, max_size=5) | nasty_values


preview_values = st.fixed_dictionaries({}, optional={"every": nasty_values | st.integers(-1, 5),
                                                     "format": nasty_values | st.sampled_from(["jpeg", "png", "x"]),
                                                     "max_side": nasty_values | st.integers(0, 2000)}) | nasty_values


trajectory_values = st.fixed_dictionaries({}, optional={
    "latents": st.booleans() | nasty_values, "log_probs": st.booleans() | nasty_values,
    "dtype": st.sampled_from(["float32", "bfloat16", "float16", "float64", ""]) | nasty_values}) | nasty_values


upscale_values = st.fixed_dictionaries({"name": st.sampled_from(["esr", "", "../x", "x" * 65]) | nasty_values},
                                       optional={"scale": nasty_values | st.floats(-1, 10)}) | nasty_values
hires_values = st.fixed_dictionaries({}, optional={
    "scale": nasty_values | st.floats(0, 5), "strength": nasty_values | st.floats(-1, 2),
    "steps": nasty_values | st.integers(-1, 9), "upscaler": nasty_values | st.sampled_from(["esr", ""])}) | nasty_values


def field_value(ctx: Ctx, name: str) -> st.SearchStrategy[Any]:
    """Nasty values for any field; for some, ones of the field's own kind too."""
    if name in ("upscale", "hires"):
        return upscale_values if name == "upscale" else hires_values
    if name == "loras":
        return lora_values(ctx)
    if name == "preview":
        return preview_values
    if name == "control":
        return control_values(ctx)
    if name == "ip_adapter":
        return ip_adapter_values(ctx)
    if name == "images":
        return images_values(ctx)
    if name in ("image", "mask"):
        return st.builds(as_base64, image_bytes(), st.integers(0, 5)) | nasty_values
    if name in ("image_path", "mask_path"):
        return path_values(ctx) | nasty_values
    if name in NOISE_SCHEDULERS:
        return st.floats(-1, 3) | st.sampled_from([0, 1, 2, 1e-300, -0.0]) | nasty_values
    if name == "trajectory":
        return trajectory_values
    if name == "audio":  # issue 30: true is refused on these silent models, false is taken, the rest is no bool
        return st.booleans() | nasty_values
    return nasty_values


@st.composite
def json_body(draw: st.DrawFn, ctx: Ctx, base: dict[str, Any], fields: list[str]) -> Any:
    """A valid body with one to three fields changed or added (a real field or an unknown one)."""
    body = dict(base)
    numeric = [f for f in fields if f in NUMERIC_FIELDS]
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):  # one change mostly, so no other masks it
        # the numbers get half the draws: their range checks are where conversions overflow
        name = draw(st.sampled_from(numeric) | st.sampled_from(fields) | st.sampled_from(UNKNOWN_FIELDS))
        body[name] = draw(field_value(ctx, name))
        if name in NOISE_SCHEDULERS and draw(st.booleans()):
            body["scheduler"] = NOISE_SCHEDULERS[name]
        if name == "trajectory" and draw(st.booleans()):  # with its sampler, so its own checks are reached
            body.update(scheduler="ddim", eta=1.0)
    if draw(st.integers(0, 9)) == 0:
        return draw(nasty_values)  # a document that is not an object at all
    return body


def _json_req(surface: str, where: str, method: str, path: str, body: Any) -> Req:
    return Req(surface, where, method, path.encode(), [(b"Content-Type", b"application/json")], json_bytes(body))


def jobs_json(ctx: Ctx) -> st.SearchStrategy[Req]:
    return st.builds(lambda w, b: _json_req("jobs_json", w, "POST", "/v1/jobs", b), listener(ctx),
                     json_body(ctx, JOB_BASE, JOB_FIELDS))


def generations_json(ctx: Ctx) -> st.SearchStrategy[Req]:
    return st.builds(lambda w, b: _json_req("generations_json", w, "POST", "/v1/images/generations", b),
                     listener(ctx), json_body(ctx, GEN_BASE, GEN_FIELDS))


@st.composite
def images_base64(draw: st.DrawFn, ctx: Ctx) -> Req:
    """An edit on /v1/jobs with the image (and maybe a mask) in the JSON body, as base64 or a data URL."""
    body: dict[str, Any] = {**JOB_BASE, "strength": 1.0}
    del body["width"], body["height"]  # the image's own size
    body["image"] = as_base64(draw(image_bytes()), draw(st.integers(0, 5)))
    if draw(st.booleans()):
        body["mask"] = as_base64(draw(image_bytes()), draw(st.integers(0, 5)))
    if draw(st.integers(0, 3)) == 0:  # an edit's trajectory (refused on inpainting), with its sampler
        body.update(trajectory=draw(trajectory_values), scheduler="ddim", eta=1.0)
    if draw(st.integers(0, 3)) == 0:
        body["size"] = "64x64"  # only generations know size: an unknown field on jobs
        body["width"] = body["height"] = 64
    return _json_req("images_base64", draw(listener(ctx)), "POST", "/v1/jobs", body)


def path_values(ctx: Ctx) -> st.SearchStrategy[str]:
    names = list(ctx.input_names) or ["png-rgb"]
    root = ctx.input_dir or "/nonexistent"
    tricky = ["", ".", "..", "../", "../etc/passwd", "/etc/passwd", "/dev/zero", "sub/../../x", "sub/", "png-rgb\x00",
              "\x00", "png\x00-rgb", "a" * 256, "a/" * 3000, "n" * 250 + ".png/x", "%2e%2e/x", "\ud800", "png-rgb ",
              "~", "~/x", "loop/x", "./loop", root, root + "/png-rgb", root + "/../x", root + "/loop",
              "sub/in.png/..", "file:///etc/passwd", "\\..\\x", "png-rgb/"]
    return st.sampled_from(names) | st.sampled_from(tricky)


@st.composite
def image_path(draw: st.DrawFn, ctx: Ctx) -> Req:
    body: dict[str, Any] = {"prompt": "a fox", "model": "tiny", "steps": 1, "strength": 1.0,
                            "image_path": draw(path_values(ctx))}
    if draw(st.booleans()):
        body["mask_path"] = draw(path_values(ctx))
    if draw(st.integers(0, 3)) == 0:
        body["image"] = as_base64(image_corpus()["png-rgb"], 0)  # both ways at once
    return _json_req("image_path", draw(listener(ctx)), "POST", "/v1/jobs", body)


BAD_NAMES = [b"pro\xffmpt", b"\xc3\x28", b"image\x80", b"\xff", b"", b"prompt\x00", b"loras[][name]\xfe",
             b'pr"ompt', b"prompt; x", "ünïcode".encode(), b"\xed\xa0\x80"]


def _part(name: bytes, value: bytes, filename: bytes | None = None, ctype: bytes | None = None) -> bytes:
    head = b'Content-Disposition: form-data; name="' + name + b'"'
    if filename is not None:
        head += b'; filename="' + filename + b'"'
    if ctype is not None:
        head += b"\r\nContent-Type: " + ctype
    return head + b"\r\n\r\n" + value


def _text(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json_bytes(value)


@st.composite
def edits_multipart(draw: st.DrawFn, ctx: Ctx) -> Req:
    """The edits form with one to three fields mutated: names that are not UTF-8, values that are
    huge, deeply nested JSON in ``loras``/``preview``, the flattened spellings, images of every
    format and their mutations, fields twice, several image files."""
    fields: dict[bytes, bytes] = {b"prompt": b"a fox", b"model": b"tiny", b"num_inference_steps": b"1",
                                  b"strength": b"1"}
    extra: list[bytes] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 6))
        if kind == 0:
            extra.append(_part(draw(st.sampled_from(BAD_NAMES)), b"1"))
        elif kind == 1:
            name = draw(st.sampled_from(["loras", "preview", "ip_adapter", "control", "upscale", "hires"]))
            value = draw(st.sampled_from([nested(1001), nested(1500, "dict"), nested(100_000), nested(3000, "mixed"),
                                          Raw('[{"name": "ink", "weight": ' + DIGITS_4301 + "}]"),
                                          Raw('{"every": ' + str(10**309) + "}")]) | field_value(ctx, name))
            fields[name.encode()] = _text(value)
        elif kind == 2:
            extra.append(_part(b"loras[][name]", _text(draw(st.sampled_from([*ctx.loras, "nope", ""])))))
            extra.append(_part(b"loras[][weight]", _text(draw(nasty_values))))
        elif kind == 3:
            for flat in draw(st.lists(st.sampled_from([b"preview[every]", b"preview[format]", b"preview[max_side]",
                                                       b"preview[zz]", b"ip_adapter[][name]", b"ip_adapter[][image]",
                                                       b"ip_adapter[][scale]", b"ip_adapter[][zz]",
                                                       b"control[][name]", b"control[][image]", b"control[][mode]",
                                                       b"control[][end]", b"control[zz]", b"upscale[name]",
                                                       b"upscale[scale]", b"upscale[zz]", b"hires[scale]",
                                                       b"hires[steps]", b"hires[upscaler]", b"hires"]),
                                      min_size=1, max_size=3)):
                extra.append(_part(flat, _text(draw(nasty_values))))
        elif kind == 4:
            fields[draw(st.sampled_from(EDIT_FIELDS)).encode()] = _text(draw(nasty_values))
        elif kind == 5:
            name = draw(st.sampled_from([b"prompt", b"negative_prompt", b"user", b"zz"]))
            fields[name] = b"x" * draw(st.sampled_from([10_001, 1 << 20, 3 << 20]))
        else:
            extra.append(_part(draw(st.sampled_from([b"prompt", b"model", b"size", b"n"])), b"2"))  # twice
    parts = [_part(k, v) for k, v in fields.items()] + extra
    # mostly one picture; else several image[] (one edit's pictures), which tiny refuses, up to
    # hundreds of files (a form that used to admit a job per file), the last ones copies of the first
    pictures = draw(st.sampled_from([1, 1, 1, 2, 3, 4, 300]))
    drawn = [_part(draw(st.sampled_from([b"image", b"image[]", b"image\xff"])), draw(image_bytes()),
                   draw(st.sampled_from([b"f.png", b"\xff.png", b"", b"../../x"])),
                   draw(st.sampled_from([b"image/png", b"application/octet-stream", b"text/plain\xff"])))
             for _ in range(min(pictures, 4))]
    parts += [drawn[min(k, 3)] for k in range(pictures)]
    if draw(st.booleans()):
        parts.append(_part(b"mask", draw(image_bytes()), b"m.png", b"image/png"))
    body = b"".join(b"--" + BOUNDARY.encode() + b"\r\n" + p + b"\r\n" for p in parts) + f"--{BOUNDARY}--\r\n".encode()
    ctype = f"multipart/form-data; boundary={BOUNDARY}".encode()
    return Req("edits_multipart", draw(listener(ctx)), "POST", b"/v1/images/edits", [(b"Content-Type", ctype)], body)


@st.composite
def loras_post(draw: st.DrawFn, ctx: Ctx) -> Req:
    """``POST /v1/loras`` with paths over the file-name limit, crafted safetensors files, and
    names of every kind. New valid registrations are few (four names), so the registry stays small."""
    long_component = "/tmp/" + "a" * 300 + ".safetensors"
    long_path = "/tmp/" + "a/" * 3000 + "x.safetensors"
    others = [long_component, long_path, "", "relative.safetensors", "/nonexistent.safetensors", "/etc/passwd",
              "/tmp/x\x00.safetensors", "\ud800.safetensors", "/dev/zero", "/proc/self/environ", "~/x.safetensors",
              *([ctx.valid_lora] if ctx.valid_lora else [])]
    path = draw(st.sampled_from(ctx.lora_paths or ["/nonexistent"]) | st.sampled_from(others) | nasty_values)
    crafted = [p for p in ctx.lora_paths if Path(p).name.split(".")[0] in ("deep100k", "deeplist", "digits", "offsets",
                                                                             "float", "huge-shape", "loop")]
    if draw(st.booleans()):  # half: a name that would register, with a crafted file or an over-long path
        name: Any = draw(st.sampled_from(["fz0", "fz1", "fz2", "fz3"]))
        path = draw(st.sampled_from([*crafted, long_component, long_path]))
    else:
        name = draw(st.sampled_from([*ctx.loras, "fz0", "", "x" * 65, "a b", "../x", "é", "\x00", "\ud800"])
                    | nasty_values)
    body: Any = {"name": name, "path": path}
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.sampled_from(UNKNOWN_FIELDS))] = draw(nasty_values)
    if draw(st.integers(0, 9)) == 0:
        body = draw(nasty_values)
    return _json_req("loras_post", draw(listener(ctx)), "POST", "/v1/loras", body)
