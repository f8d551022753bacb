"""Fuzzing every HTTP surface of a real daemon (issue 26): Hypothesis strategies that build whole
requests, a raw HTTP/1.1 sender, and the one oracle every answer is held to.

Shared by tests/test_fuzz_surfaces.py (a bounded number of examples per family, in `make test`)
and scripts/fuzz.py (the long mode, hundreds of thousands of inputs). Everything goes over HTTP,
to the Unix socket or the ``--web`` listener on 127.0.0.1, never anywhere else: a fuzzer that
imports the daemon's modules would test what they promise instead of what a client gets.

Requests are sent as raw bytes on a fresh connection each (``Connection: close``), because many
inputs are ones a well-behaved client library refuses to send: two ``Origin`` headers, bytes that
are not UTF-8 in ``Authorization``, a ``Content-Encoding`` the body does not have, form field
names that are not text, numbers JSON libraries cannot print.

The oracle (``problems``): never a 5xx (but a documented 503 or a synchronous 504); every 4xx and
5xx in the documented JSON shape ``{"error": {"code", "message", "field"?, "stage"?}}`` with
``Content-Type: application/json``; on the web listener, no request without the token, with a
foreign ``Origin`` or a ``Host`` that is not the listener's gets anything but 401/403; and the
daemon answers ``GET /health`` with ``ok`` afterwards.

The kit is in parts, each a module of its own (this one holds the table of families, ``strategies``
and ``cleanup``, and re-exports what the tests and the script use, so ``import fuzzkit`` is all they
need): tests/fuzzkit_wire.py (requests, answers, the oracle), tests/fuzzkit_json.py (JSON that
json.dumps cannot write, the nasty values), tests/fuzzkit_images.py (the image corpus and its
mutations), tests/fuzzkit_env.py (the daemon to fuzz, its files, ``Ctx``), tests/fuzzkit_bodies.py
(the families for what a request carries) and tests/fuzzkit_envelope.py (the families for the request
around it).
"""

from __future__ import annotations

from collections.abc import Callable

from fuzzkit_bodies import (
    BOUNDARY,
    _json_req,
    _part,
    edits_multipart,
    generations_json,
    image_path,
    images_base64,
    jobs_json,
    loras_post,
)
from fuzzkit_env import FUZZ_TOKEN, Ctx, daemon_args, finished_job, make_ctx, web_port_of
from fuzzkit_envelope import PARSER_BREAKERS, headers_family, parser_family, urls, web_auth
from fuzzkit_images import as_base64, image_corpus
from fuzzkit_wire import Answer, Req, Target, check, health_problem, problems, request, send
from hypothesis import strategies as st

__all__ = [
    "BOUNDARY",
    "FAMILIES",
    "FUZZ_TOKEN",
    "PARSER_BREAKERS",
    "Answer",
    "Ctx",
    "Req",
    "Target",
    "_json_req",
    "_part",
    "as_base64",
    "check",
    "cleanup",
    "daemon_args",
    "finished_job",
    "health_problem",
    "image_corpus",
    "make_ctx",
    "problems",
    "request",
    "send",
    "strategies",
    "web_port_of",
]


FAMILIES: dict[str, Callable[[Ctx], st.SearchStrategy[Req]]] = {
    "jobs_json": jobs_json,
    "generations_json": generations_json,
    "images_base64": images_base64,
    "image_path": image_path,
    "edits_multipart": edits_multipart,
    "headers": headers_family,
    "web_auth": web_auth,
    "urls": urls,
    "loras_post": loras_post,
    "parser": parser_family,
}


def strategies(ctx: Ctx) -> dict[str, st.SearchStrategy[Req]]:
    """Every family that applies to this daemon (``web_auth`` needs the web listener)."""
    return {name: make(ctx) for name, make in FAMILIES.items() if name != "web_auth" or ctx.target.web_port}


def cleanup(target: Target, req: Req, ans: Answer) -> None:
    """Accepted jobs are cancelled at once: the fuzzing must not pile up work."""
    if ans.status == 202 and req.path.startswith(b"/v1/jobs"):
        try:
            job_id = ans.json()["id"]
        except (ValueError, KeyError, TypeError):
            return
        request(target, "DELETE", f"/v1/jobs/{job_id}?finished=keep")
