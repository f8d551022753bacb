"""The Hypothesis strategies of tests/test_fuzz_http.py: JSON bodies built from the real field names
with plausible or wild values (``PLAUSIBLE`` per field, ``values`` for anything), Content-Types and
header values, bodies with a reference image and control or an edit, multipart edit forms, paths
under /v1/ and the methods HTTP knows, mutated images of the accepted formats, and bodies that combine
what each model is served with (``running_bodies``: run to the end, not cancelled).

Apart from the test module because they are most of its length and none of its tests, and from
tests/fuzzhttpkit.py because they only draw: what is sent and checked is there.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any
from urllib.parse import quote, unquote

from fuzzhttpkit import IMAGE_BYTES, LORAS, MASK_64, MODELS, PNG_64, _png, bomb, picture
from hypothesis import assume
from hypothesis import strategies as st

INTERESTING: list[Any] = [
    "", " ", "64", "64x64", "128x128", "auto", "npy", "png", "jpeg", "webp", "mp4", "gif", "float32", "float16",
    "uint8", "bfloat16", "euler", "flow-match", "../../etc/passwd", "/etc/passwd", "tiny/../x", "\x00", "\u202e",
    "ﬀ", "💥", "%s%n", "${jndi:x}", 0, -1, 1, 7, 8, 64, 65, 128, 136, 4096, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63),
    10**30, 0.5, -0.0, 1e-300, 1e308, math.inf, -math.inf, math.nan, True, False, None,
]
scalars = st.one_of(
    st.sampled_from(INTERESTING),
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),
    st.text(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=8)

JOB_FIELDS = ["prompt", "model", "n", "width", "height", "size", "steps", "guidance_scale", "negative_prompt", "seed",
              "output_format", "output_dtype", "num_frames", "fps", "timeout_s", "scheduler", "noise_level", "eta",
              "image", "image_path", "mask", "mask_path", "strength", "loras",
              "preview", "keep_alive", "control", "ip_adapter", "trajectory", "upscale", "hires"]
EDIT_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
               "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "strength", "quality",
               "background", "input_fidelity", "user", "ip_adapter", "control", "upscale", "hires"]
IMAGE_FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format", "negative_prompt",
                "num_inference_steps", "guidance_scale", "seed", "timeout_s", "scheduler", "quality", "style",
                "user", "background", "moderation", "output_compression", "stream", "partial_images", "loras",
                "preview", "control", "ip_adapter", "upscale", "hires"]


# plausible values per field, so that many bodies get past decoding into the range checks
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.text(max_size=30) | st.sampled_from(["a fox", " ", "x" * 10_001]),
    "model": st.sampled_from([*MODELS, None, "../../etc/passwd", "/etc/passwd", "tiny/../x", "TINY", ""]),
    "n": st.integers(min_value=-1, max_value=6),
    "width": st.sampled_from([56, 63, 64, 72, 128, 129, 136, 0, -64]),
    "height": st.sampled_from([56, 64, 72, 128, 136]),
    "size": st.sampled_from(["64x64", "128x72", "72x128", "136x64", "64x", "x64", "64X64", "auto", "0x0",
                             "64x64x64", " 64x64"]),
    "steps": st.integers(min_value=-1, max_value=9),
    "num_inference_steps": st.integers(min_value=-1, max_value=9),
    "guidance_scale": st.floats(min_value=-1, max_value=101) | st.sampled_from([math.nan, math.inf]),
    "seed": st.integers(min_value=-1, max_value=2**64),
    "output_format": st.sampled_from(["png", "jpeg", "webp", "npy", "mp4", "gif", "bmp", "PNG", ""]),
    "output_dtype": st.sampled_from(["uint8", "float16", "float32", "bfloat16", "int64"]),
    "num_frames": st.integers(min_value=-1, max_value=9),
    "fps": st.integers(min_value=-1, max_value=241),
    "timeout_s": st.sampled_from([0, 0.0001, 0.001, 0.01, 5.0, -1.0, 1e9, math.nan]),
    "scheduler": st.sampled_from(["euler", "euler-a", "dpm++", "ddim", "unipc", "flow-match", "flow-sde", "bogus", ""]),
    # issue 29: the stochastic samplers' noise, in and out of range, with and without their scheduler
    "noise_level": st.floats(min_value=-1, max_value=3) | st.sampled_from([0, 2, 1e-9, math.nan, math.inf, -0.0]),
    "eta": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, math.nan, math.inf, -0.0]),
    "response_format": st.sampled_from(["b64_json", "url", "file", ""]),
    "loras": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from([*LORAS, "nope", "", "../ink", "INK"])},
        optional={"weight": st.floats(min_value=-5, max_value=5) | st.sampled_from([0, 4, -4, math.nan, math.inf])},
    ), max_size=3),
    # ControlNets: known and unknown names, images good and bad, scales and step ranges in and out of range
    "control": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["edges", "blobs", "flux-lines", "flux-union", "nope", "", "EDGES", "../edges"])},
        optional={"image": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode())
                  | st.sampled_from(["", "%%%"]) | values,
                  "image_path": st.sampled_from(["in.png", "../in.png", "/dev/zero", ""]),
                  "scale": st.floats(min_value=-1, max_value=5) | st.sampled_from([0, 4, math.nan, math.inf]),
                  "start": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, math.nan]),
                  "end": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, math.inf]),
                  "preprocess": st.sampled_from(["none", "canny", "depth", ""]) | values,
                  "mode": st.integers(min_value=-1, max_value=3) | st.sampled_from([2**64, "canny"]) | values},
    ), max_size=3) | values,
    # IP-Adapters: the served one and others, reference images good and bad, scales in and out of range;
    # several at once, the same one twice, past the cap of 4
    "ip_adapter": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["style", "style2", "flux-style", "nope", "", "STYLE"])},
        optional={"image": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode())
                  | st.sampled_from(["", "%%%"]) | values,
                  "image_path": st.sampled_from(["in.png", "../in.png", "/dev/zero", ""]),
                  "scale": st.floats(min_value=-1, max_value=5) | st.sampled_from([0, 4, math.nan, math.inf])},
    ), max_size=6) | values,
    # issue 30: an upscaler known or not at scales in and out of range; a hires pass on models with and without
    # image-to-image, its sizes past the limits
    "upscale": st.fixed_dictionaries({"name": st.sampled_from(["esr", "nope", "", "ESR"]) | values}, optional={
        "scale": st.floats(min_value=-1, max_value=10) | st.sampled_from([1, 2, 8, 9, math.nan, math.inf]) | values,
    }) | values,
    "hires": st.fixed_dictionaries({}, optional={
        "scale": st.floats(min_value=0, max_value=5) | st.sampled_from([1, 1.5, 2, 4, math.nan, math.inf]) | values,
        "strength": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, 1e-9, math.nan]) | values,
        "steps": st.integers(min_value=-1, max_value=9) | values,
        "upscaler": st.sampled_from(["esr", "nope", ""]) | values,
    }) | values,
    "preview": st.fixed_dictionaries({}, optional={
        "every": st.integers(min_value=-1, max_value=10) | values,
        "format": st.sampled_from(["jpeg", "webp", "png", "gif", "JPEG", ""]) | values,
        "max_side": st.sampled_from([0, 15, 16, 64, 256, 1024, 1025, -1]) | values,
    }) | values,
    "image": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode())
    | st.sampled_from(["", "%%%", "data:image/png;base64," + base64.b64encode(PNG_64).decode(), "AAAA"]),
    "mask": st.sampled_from(IMAGE_BYTES).map(lambda b: base64.b64encode(b).decode()),
    "image_path": st.sampled_from(["in.png", "../in.png", "/etc/passwd", "", ".", "/dev/zero", "in.png\x00"]),
    "mask_path": st.sampled_from(["in.png", "/etc/shadow", "..", "x/../../y"]),
    "keep_alive": st.sampled_from(["10m", "0", "-1", "1h30m", "250ms", "5 m", "m5", "", "1e400s", "9" * 5000,
                                   0, -1, 2.5, 1e309, True, None, [], {"s": 1},
                                   # past the 100-year horizon: forever (issue 27: `ps` died on these)
                                   1e12, 1e17, 1e20, 1e308, 10**30, "99999999999h", "9" * 60]),
    "strength": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, 0.5, math.nan, 1e-9]),
    # issue 29: what of the run each output carries back; only under a stochastic sampler
    "trajectory": st.fixed_dictionaries({}, optional={
        "latents": st.booleans() | values, "log_probs": st.booleans() | values,
        "dtype": st.sampled_from(["float32", "bfloat16", "float16", "float64", "uint8", ""]) | values,
    }) | values,
}


def valid_base(fields: list[str], model: str) -> dict[str, Any]:
    """A body the daemon accepts, for the endpoint whose fields are ``fields``."""
    if "num_inference_steps" in fields:  # OpenAI's bodies (/v1/jobs takes size too, beside width and height)
        return {"prompt": "a fox", "model": model, "size": "64x64", "num_inference_steps": 2,
                **({"output_format": "webp"} if model == "fv" else {})}
    return {"prompt": "a fox", "model": model, "width": 64, "height": 64, "steps": 2,
            **({"num_frames": 4} if model == "fv" else {})}


@st.composite
def bodies(draw: st.DrawFn, fields: list[str]) -> Any:
    """A third: a valid body with a field or two changed (plausible or wild values); a half: an
    object built from the real field names with plausible or wild values; the rest: any JSON."""
    mode = draw(st.integers(0, 5))
    if mode == 0:
        return draw(values)
    if mode <= 2:
        body = valid_base(fields, draw(st.sampled_from(MODELS)))
        names = draw(st.lists(st.sampled_from(fields), unique=True, max_size=2))
    else:
        body = {}
        names = draw(st.lists(st.sampled_from(fields), unique=True, max_size=len(fields)))
    for name in names:
        plausible = PLAUSIBLE.get(name)
        body[name] = draw(plausible if plausible is not None and draw(st.booleans()) else values)
    if mode > 2 and draw(st.booleans()):
        body["prompt"] = draw(PLAUSIBLE["prompt"])
    if draw(st.integers(0, 5)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=10), values, max_size=2)))
    return body


header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
content_types = st.one_of(
    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                     "application/json; charset=utf-16", "application/json; charset=latin-1", "*/*", ""]),
    header_values,
)


@st.composite
def combined_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with a reference image (``ip_adapter``) and control images or an edit's image and
    mask, or both (refused): plausible values, so many get past decoding into the pairing rules."""
    png64, mask64 = base64.b64encode(PNG_64).decode(), base64.b64encode(MASK_64).decode()
    twice = draw(st.integers(1, 2))  # the served adapter once, or twice (two references at once)
    valid: dict[str, Any] = {"ip_adapter": [{"name": "style", "image": png64, "scale": 0.5}] * twice,
                             "control": [{"name": "edges", "image": png64}], "image": png64, "mask": mask64,
                             "strength": 0.5, "hires": {"scale": 1.5, "steps": 1}}
    body = valid_base(JOB_FIELDS, "tiny")
    for name in ["ip_adapter", *draw(st.lists(st.sampled_from(list(valid)[1:]), min_size=1, unique=True))]:
        body[name] = valid[name] if draw(st.booleans()) else draw(PLAUSIBLE[name])
    return body


@st.composite
def edit_forms(draw: st.DrawFn) -> tuple[bytes, str, Any]:
    """A multipart body for /v1/images/edits: text fields from the real names with plausible or
    wild values (as text, as a form sends them), image and mask parts that are images, images of
    the wrong size, or junk; now and then a part without a name, a broken boundary or a cut body."""
    boundary = draw(st.sampled_from(["b0und", "x" * 70, "--", "a b"]))
    parts: list[bytes] = []
    fields: dict[str, Any] = {}
    base = {"prompt": "a fox", "model": "tiny", "size": "64x64", "num_inference_steps": "4", "strength": "0.5"}
    names = draw(st.lists(st.sampled_from(EDIT_FIELDS), unique=True, max_size=3))
    if draw(st.booleans()):
        fields.update(base)
    for name in names:
        plausible = PLAUSIBLE.get(name)
        fields[name] = draw(plausible if plausible is not None and draw(st.booleans()) else values)
    for name, value in fields.items():
        text = value if isinstance(value, str) else json.dumps(value)
        parts.append(f'Content-Disposition: form-data; name="{name}"\r\n\r\n{text}'.encode(errors="replace"))
    files = draw(st.lists(st.sampled_from(["image", "image[]", "mask", "other", ""]), max_size=3))
    if "prompt" in fields and draw(st.booleans()):  # a valid start: an image that fits
        parts.append(b'Content-Disposition: form-data; name="image"; filename="f.png"\r\n\r\n' + PNG_64)
    for name in files:
        data = draw(st.sampled_from(IMAGE_BYTES))
        parts.append(f'Content-Disposition: form-data; name="{name}"; filename="f.png"\r\n'
                     f"Content-Type: image/png\r\n\r\n".encode() + data)
    body = b"".join(b"--" + boundary.encode() + b"\r\n" + p + b"\r\n" for p in parts) + f"--{boundary}--\r\n".encode()
    cut = draw(st.sampled_from([None, None, None, 0, 10, len(body) // 2, len(body) - 3]))
    if cut is not None:
        body = body[:cut]
    ctype = draw(st.sampled_from([f"multipart/form-data; boundary={boundary}",
                                  f'multipart/form-data; boundary="{boundary}"', "multipart/form-data",
                                  "multipart/mixed; boundary=zz", "application/json"]))
    return body, ctype, fields


SEGMENTS = ["v1", "jobs", "images", "generations", "models", "outputs", "events", "preview", "admin", "health",
            "metrics", "0", "1", "-1", "99999999999999999999", "..", ".", "%2e%2e", "..%2F..%2Fetc", "%2F", "%00",
            "etc", "passwd", "j_0000000000000000", "", "~", "%", "%zz", "%ff", "?", "#", ";", "*"]


ROUTES = ["/v1/jobs", "/v1/jobs/{id}", "/v1/jobs/{id}/events", "/v1/jobs/{id}/outputs/{k}",
          "/v1/jobs/{id}/outputs/{k}/trajectory/{k}", "/v1/jobs/{id}/outputs/0/trajectory/{k}",
          "/v1/jobs/{id}/preview/{k}", "/v1/models",
          "/v1/images/generations", "/v1/images/edits", "/v1/admin/{k}", "/v1/loras",
          "/v1/controlnets", "/v1/ip-adapters", "/v1/upscalers"]


@st.composite
def paths(draw: st.DrawFn, job_id: str) -> str:
    """Half: a real route with its ids replaced (the real job, traversal, junk); half: any segments."""
    segment = st.sampled_from([*SEGMENTS, job_id]) | st.text(max_size=12).map(quote)
    if draw(st.booleans()):
        path = draw(st.sampled_from(ROUTES)).format(id=draw(segment), k=draw(segment))
    else:
        path = "/v1/" + "/".join(draw(st.lists(segment, max_size=5)))
    if draw(st.booleans()):
        path += "?" + quote(draw(st.text(max_size=20)), safe="=&")
    low = unquote(path).lower()
    assume("sleep" not in low and "wake" not in low)  # admin power commands are tested elsewhere
    return path


# Methods HTTP knows. A token the HTTP parser does not know ("FOO") is refused by aiohttp's parser
# before any routing, with a plain-text 400: see test_unknown_method_is_refused_by_the_parser
# (tests/test_fuzz_http_targeted.py).
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "PROPFIND", "SEARCH", "PURGE"]


@st.composite
def mutated_images(draw: st.DrawFn) -> bytes:
    """A real file of an accepted format (some modes each, a bomb header now and then), with bytes
    flipped, cut or inserted: what a decoder meets from a broken upload or a hostile one."""
    fmt, mode = draw(st.sampled_from([("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "I;16"), ("JPEG", "RGB"),
                                      ("JPEG", "CMYK"), ("WEBP", "RGB"), ("GIF", "P"), ("BMP", "RGB"),
                                      ("TIFF", "LAB"), ("TIFF", "RGB"), ("BOMB", "")]))
    data = bytearray(bomb(draw(st.sampled_from(["png", "bmp", "gif", "jpeg", "tiff"]))) if fmt == "BOMB"
                     else _SEEDS[(fmt, mode)])
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        op = draw(st.integers(0, 2))
        if op == 0:
            data[at] = draw(st.integers(0, 255))
        elif op == 1:
            del data[at:at + draw(st.integers(1, 64))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


_SEEDS = {(f, m): picture(f, m, (64, 64)) for f, m in [
    ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "I;16"), ("JPEG", "RGB"), ("JPEG", "CMYK"), ("WEBP", "RGB"),
    ("GIF", "P"), ("BMP", "RGB"), ("TIFF", "LAB"), ("TIFF", "RGB")]}


# Requests that run to the end: the served features together --------------------------------------
# What the fuzz daemon serves each model with (tests/fuzzhttpkit.py's SERVED): every combination drawn
# here is mostly valid, so most are accepted and run, and a job failing in the worker (a pipeline that
# takes no such argument, a shape that does not fit) is found, where the families above cancel at once.
def _pngs() -> tuple[dict[str, str], dict[str, str]]:
    """Pictures by name (their size, or their mode at 64x64), and a greyscale mask of each size."""
    sizes = {"64": (64, 64), "72x64": (72, 64), "128": (128, 128), "96x64": (96, 64), "1": (1, 1)}
    pictures = {k: _png(v) for k, v in sizes.items()}
    pictures.update({"L": _png((64, 64), "L"), "RGBA": MASK_64, "I;16": picture("PNG", "I;16")})
    masks = {k: _png(v, "L") for k, v in sizes.items()}
    masks.update({k: masks["64"] for k in ("L", "RGBA", "I;16")})
    b64 = lambda d: {k: base64.b64encode(v).decode() for k, v in d.items()}  # noqa: E731
    return b64(pictures), b64(masks)


PICTURES, MASKS = _pngs()
# the samplers a family takes, and now and then one it does not
rarely = st.sampled_from([False] * 5 + [True])
SAMPLERS = {"flux": ["flow-match", "flow-sde"], "unet": ["euler", "ddim", "dpm++", "euler-a", "unipc"]}


@st.composite
def running_bodies(draw: st.DrawFn, served: dict[str, dict[str, tuple[str, ...]]],
                   modes: dict[str, int]) -> dict[str, Any]:
    """A body for /v1/jobs combining what ``served`` gives each model (its ControlNets, its IP-Adapters; a
    union ControlNet's mode count in ``modes``) with an edit, a hires pass, an upscale, LoRAs, a sampler:
    names now and then another model's, sizes and numbers at and past their bounds."""
    model = draw(st.sampled_from(sorted(served)))
    mine = served[model]
    every = sorted({n for m in served.values() for n in m["control"]})
    body: dict[str, Any] = {"prompt": "a fox", "model": model, "steps": draw(st.integers(1, 3)),
                            "seed": draw(st.integers(0, 3))}
    side = st.sampled_from([64, 64, 64, 80, 72, 128])
    if draw(st.booleans()):
        body["width"], body["height"] = draw(side), draw(side)
    if draw(st.integers(0, 3)) == 0:
        body["n"] = draw(st.integers(1, 2))
    edit = draw(st.sampled_from([None, None, "image-to-image", "inpainting"]))
    if "inpaint" in model:  # a dedicated inpainting model: the other two now and then
        edit = draw(st.sampled_from(["inpainting"] * 6 + [None, "image-to-image"]))
    if edit is not None:
        shape = draw(st.sampled_from(["64", "72x64", "128", "96x64", "L", "RGBA", "I;16"]) if not draw(rarely)
                     else st.just("1"))
        body["image"] = PICTURES[shape]
        if edit == "inpainting":
            body["mask"] = MASKS[shape] if draw(st.integers(0, 5)) else PICTURES[draw(st.sampled_from(["RGBA", "1"]))]
        if edit == "image-to-image" or draw(st.booleans()):
            body["strength"] = draw(st.sampled_from([1.0, 0.7, 0.5]) if not draw(rarely) else st.just(1e-3))
    names = st.sampled_from(list(mine["control"])) if mine["control"] and draw(st.integers(0, 5)) else \
        st.sampled_from(every)
    control = []
    for name in draw(st.lists(names, max_size=3, unique=True)):
        entry: dict[str, Any] = {"name": name, "image": PICTURES[draw(st.sampled_from(sorted(PICTURES)))]}
        if draw(st.booleans()):
            entry["scale"] = draw(st.sampled_from([0.0, 0.5, 1.0, 4.0, 4.5]))
        if draw(st.booleans()):
            entry["start"], entry["end"] = draw(st.sampled_from([(0.0, 1.0), (0.5, 1.0), (0.0, 0.3), (0.9, 1.0),
                                                                 (0.0, 1e-6), (0.7, 0.2)]))
        count = modes.get(name, 0)
        if count or draw(st.integers(0, 9)) == 0:
            entry["mode"] = draw(st.integers(0, count - 1) if count and draw(st.integers(0, 5)) else
                                 st.sampled_from([-1, count, 2**64, "canny"]))
        control.append(entry)
    if control:
        body["control"] = control
    ip_names = list(mine["ip"]) or sorted({n for m in served.values() for n in m["ip"]})
    refs = draw(st.lists(st.sampled_from(ip_names), max_size=4 if not draw(rarely) else 5)) if draw(st.booleans()) \
        else []
    if refs:
        body["ip_adapter"] = [{"name": n, "image": PICTURES[draw(st.sampled_from(["64", "1", "128", "L", "RGBA"]))],
                               "scale": draw(st.sampled_from([0.0, 0.5, 1.0, 4.0]))} for n in refs]
    if draw(rarely) and (edit is None or draw(rarely)):
        body["hires"] = draw(st.fixed_dictionaries({"scale": st.sampled_from([1.25, 1.5, 2.0])}, optional={
            "strength": st.sampled_from([0.3, 0.5, 1.0]), "steps": st.integers(1, 2),
            "upscaler": st.sampled_from(["esr", None])}))
    if draw(st.integers(0, 4)) == 0:
        body["upscale"] = draw(st.fixed_dictionaries({"name": st.just("esr")},
                                                     optional={"scale": st.sampled_from([1.0, 1.5, 2.0, 3.0])}))
    if draw(st.integers(0, 5)) == 0 and (model == "tiny" or draw(st.integers(0, 5)) == 0):
        body["loras"] = [{"name": draw(st.sampled_from(LORAS)), "weight": draw(st.sampled_from([0.0, 1.0, -2.0]))}]
    family = SAMPLERS["flux" if "flux" in model else "unet"]
    sampler = draw(st.sampled_from([None, None, *family]) if not draw(rarely) else
                   st.sampled_from(SAMPLERS["flux"] + SAMPLERS["unet"]))
    if sampler is not None:
        body["scheduler"] = sampler
        if sampler in ("ddim", "flow-sde") and draw(st.booleans()):
            body["eta" if sampler == "ddim" else "noise_level"] = 0.5
            if draw(st.booleans()):
                body["trajectory"] = {}
    if draw(st.integers(0, 5)) == 0:
        body["preview"] = {"every": 1}
    if draw(st.integers(0, 5)) == 0:
        body["guidance_scale"] = draw(st.sampled_from([0.0, 1.0, 100.0]))
    if draw(st.integers(0, 5)) == 0:
        body["output_format"], body["output_dtype"] = "npy", draw(st.sampled_from(["float32", "uint8"]))
    return body
