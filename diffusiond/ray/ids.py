"""Job ids that carry their replica, and the routes that need one.

A daemon's job lives in that daemon's memory (its outputs in its workers' shared memory), so a
request about a job must reach the replica that runs that daemon. The id a client gets is the
daemon's id with the replica's Serve id in front (``"k3x9q2ab.j_0123456789abcdef"``): the
gateway reads the replica from the path alone, with no table to keep in step and nothing lost
when a gateway restarts. Pure functions, no Ray, so they are tested without a cluster.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode

from diffusiond.protocol import ErrorCode

SEP = "."
_DAEMON_ID = re.compile(r"j_[0-9a-f]+")
_REPLICA = re.compile(r"[A-Za-z0-9_-]+")
_JOB_PATH = re.compile(
    r"/v1/jobs/(?P<job>[^/]+)(?P<rest>(?:/events|/outputs/[^/]+(?:/trajectory/[^/]+|/audio)?|/preview/[^/]+)?)")

# Routes the gateway forwards; the admin routes (sleep, wake, trace) and a model's load/unload act on one
# daemon and stay on its socket.
UNBOUND_ROUTES = frozenset({
    ("POST", "/v1/images/generations"), ("POST", "/v1/images/edits"), ("GET", "/v1/models"),
    ("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/loras"), ("GET", "/health"), ("GET", "/ready"),
    ("GET", "/metrics"), ("GET", "/v1/controlnets"), ("GET", "/v1/ip-adapters"),
    ("GET", "/v1/upscalers"),  # missing since upscalers came (3e1227d), so no client could list them
})
_MODEL_RESIDENCY = re.compile(r"/v1/models/[^/]+/(?:load|unload)")
BOUND_METHODS = {"": ("GET", "DELETE"), "/events": ("GET",), "/outputs": ("GET",), "/preview": ("GET",)}


class RouteError(ValueError):
    """A request the gateway answers itself: ``status`` and ``code`` for the error body."""

    def __init__(self, status: int, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.field = field


def bind(replica: str, daemon_id: str) -> str:
    return f"{replica}{SEP}{daemon_id}"


def split(job_id: str) -> tuple[str, str] | None:
    """(replica, daemon's id) of a job id as the gateway gives them out, None for anything else."""
    replica, sep, daemon_id = job_id.partition(SEP)
    if not sep or not _REPLICA.fullmatch(replica) or not _DAEMON_ID.fullmatch(daemon_id):
        return None
    return replica, daemon_id


def unbind(job_id: str) -> tuple[str, str]:
    """(replica, daemon's id) of a client's job id, or RouteError 404 naming the id."""
    parts = split(job_id)
    if parts is None:
        raise RouteError(404, ErrorCode.JOB_NOT_FOUND,
                         f"no job {job_id!r}: job ids here look like REPLICA.j_HEX, as POST /v1/jobs returned them")
    return parts


def route(method: str, path: str) -> tuple[str | None, str]:
    """(replica the request must reach or None for any, the path to send to that daemon)."""
    if method == "HEAD":  # the daemon answers HEAD on every GET route, and so does the gateway
        with contextlib.suppress(RouteError):  # not a GET route: refused below, naming HEAD
            return route("GET", path)
    m = _JOB_PATH.fullmatch(path)
    if m is not None:
        rest = m["rest"]
        allowed = BOUND_METHODS[next((p for p in ("/outputs", "/preview") if rest.startswith(p)), rest)]
        if method not in allowed:
            raise RouteError(405, ErrorCode.METHOD_NOT_ALLOWED, f"{method} {path}: allowed are {', '.join(allowed)}")
        replica, daemon_id = unbind(m["job"])
        return replica, f"/v1/jobs/{daemon_id}{rest}"
    if (method, path) in UNBOUND_ROUTES:
        return None, path
    if any(path == p for _, p in UNBOUND_ROUTES):
        methods = sorted(mm for mm, p in UNBOUND_ROUTES if p == path)
        raise RouteError(405, ErrorCode.METHOD_NOT_ALLOWED, f"{method} {path}: allowed are {', '.join(methods)}")
    if _MODEL_RESIDENCY.fullmatch(path):
        # not an admin route, so the old message misled; through Ray the router places
        # models by where the daemons hold them, and a load here would reach one replica picked by load
        raise RouteError(404, ErrorCode.NOT_FOUND,
                         f"{method} {path} is not forwarded through Ray Serve: it moves a model in one daemon's "
                         "memory, and here the router decides where models load (model_affinity, docs/scaling.md); "
                         "send the request and the replica loads its model, or use one daemon's socket")
    raise RouteError(404, ErrorCode.NOT_FOUND,
                     f"{method} {path} is not forwarded through Ray Serve: no such route, or an admin route or the "
                     "web page, which act on one daemon (use its socket)")


def route_query(method: str, path: str, query: str) -> tuple[str | None, str]:
    """(replica, query to send) for a job list's page: ``before=REPLICA.j_HEX`` (the ``next_before``
    a page through the gateway gave) names the replica whose list it continues, and the
    daemon is sent its own id. Any other request keeps its query and goes where ``route`` sends it."""
    if method not in ("GET", "HEAD") or path != "/v1/jobs" or "before" not in query:
        return None, query
    pairs = parse_qsl(query, keep_blank_values=True)
    befores = [v for k, v in pairs if k == "before"]
    if not befores or not befores[0]:  # the daemon reads the first, and an empty one as none
        return None, query
    parts = split(befores[0])
    if parts is None:
        raise RouteError(400, ErrorCode.INVALID_REQUEST,
                         f"before={befores[0][:60]!r}: through Ray Serve it is a job id REPLICA.j_HEX, as a page's "
                         "next_before gave it (a list continues on the replica that listed it)", field="before")
    replica, daemon_id = parts
    return replica, urlencode([(k, daemon_id if k == "before" else v) for k, v in pairs])


def bind_document(doc: Any, replica: str, prefix: str = "") -> Any:
    """The daemon's JSON with every job id and job URL it names bound to ``replica``, the URLs under
    ``prefix`` (the application's ``route_prefix``, where the client reaches them).

    Only the fields that hold ids are touched (``id``/``job_id`` values that are job ids, job
    ``url``s), so a prompt that happens to contain ``j_...`` goes through as written."""
    if isinstance(doc, list):
        return [bind_document(v, replica, prefix) for v in doc]
    if not isinstance(doc, dict):
        return doc
    out: dict[str, Any] = {}
    # an ``id`` is a job's unless the object says it is something else: a model may be named j_1
    id_keys = ("id", "job_id", "next_before") if doc.get("object", "job") == "job" else ("job_id", "next_before")
    for key, value in doc.items():
        # next_before: the cursor of a job list's page, bound so the next page reaches that replica
        if key in id_keys and isinstance(value, str) and _DAEMON_ID.fullmatch(value):
            out[key] = bind(replica, value)
        elif key == "url" and isinstance(value, str) and value.startswith("/v1/jobs/j_"):
            out[key] = prefix + "/v1/jobs/" + bind(replica, value.removeprefix("/v1/jobs/"))
        elif key == "request":  # what the client sent: kept as it was
            out[key] = value
        else:
            out[key] = bind_document(value, replica, prefix)
    return out


def bind_header(value: str, replica: str, prefix: str = "") -> str:
    """``Location`` and ``Content-Disposition`` name the daemon's id: bind it there too, and put a
    path (``Location``'s) under ``prefix``."""
    bound = _DAEMON_ID.sub(lambda m: bind(replica, m[0]), value, count=1)
    return prefix + bound if bound.startswith("/v1/") else bound


def url_prefix(root_path: str) -> str:
    """What goes before the daemon's paths in the URLs a client is given: the application's
    ``route_prefix`` as Serve passes it (``root_path``; empty, or ``/`` as some servers give it, for none)."""
    return root_path.rstrip("/")


def batch_key(body: Any) -> str | None:
    """The part of a generation request that decides whether two requests can share a forward
    pass (the daemon's own batching key, as far as the body shows it). None for a body that is not
    a generation request. ``keep_alive`` is not in it: the daemon batches jobs that ask different ones
    (the batch keeps its model for the longest), and the body reaches it as sent; nor is ``audio``: a batch decodes
    a sound track once when any request wants it, and only its delivery is per request; nor is ``fps``: only LTX-2
    is conditioned on it, which the body does not show, and the daemon keeps LTX-2's fps apart itself (a hint, not
    a rule, here); nor are an edit's pictures (``image``, ``images``): the daemon batches edits whatever their
    pictures (a model that edits from several runs a call a request inside its batch, issue 30)."""
    if not isinstance(body, dict) or "prompt" not in body:
        return None
    parts = [body.get(k) for k in ("model", "size", "width", "height", "steps", "num_inference_steps",
                                   "guidance_scale", "scheduler", "noise_level", "eta", "output_dtype", "num_frames",
                                   "loras", "strength", "trajectory", "control", "ip_adapter", "upscale",
                                   "hires")]
    return repr(_digested(parts))


def _digested(value: Any) -> Any:
    """``value`` with every long string (a control's or a reference's picture in base64) as its digest: the key
    keeps requests with different pictures apart, as the daemon does, without carrying megabytes of them across
    Ray a second time and in each of the router's remembered keys."""
    if isinstance(value, str) and len(value) > 256:
        return "sha256:" + hashlib.sha256(value.encode(errors="surrogatepass")).hexdigest()
    if isinstance(value, dict):
        return {k: _digested(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_digested(v) for v in value]
    return value


def model_of(body: Any) -> str | None:
    """The model a generation request names, for the router's residency preference (None: the
    daemon's default model, or not a generation)."""
    if not isinstance(body, dict) or "prompt" not in body or not isinstance(body.get("model"), str):
        return None
    return str(body["model"])


def error_body(code: ErrorCode, message: str, field: str | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code.value, "message": message}
    if field is not None:
        err["field"] = field
    return {"error": err}
