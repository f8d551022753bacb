"""Who may use the gateway: the daemon's bearer-token rule (``protocol.bearer_authorized``), and
the refusal to put an open generator on a network.

Serve's proxy has no authentication of its own, and a ``serve deploy`` config that binds it to
``0.0.0.0`` makes every machine that reaches the port a user of the GPUs. So the gateway takes a
token (``token_file`` or ``token_env``, read where the gateway runs: a mounted Secret or an
environment variable set from one), and without one it refuses to start behind a proxy bound
beyond loopback unless ``allow_unauthenticated=true`` says that something in front of it (an
authenticating ingress, a VPN) does the job.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffusiond.protocol import MIN_TOKEN_CHARS

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def read_token(token_file: str | None, token_env: str | None) -> str | None:
    """The gateway's token, or None without one; ValueError naming the argument when it cannot be used."""
    if token_file is not None and token_env is not None:
        raise ValueError("token_file and token_env: give one of them, not both")
    if token_file is not None:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"token_file={token_file!r}: cannot read it ({exc.strerror}) where the gateway "
                             "runs; the file must exist on every node (a mounted Secret, say)") from None
        where = f"token_file={token_file!r}"
    elif token_env is not None:
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise ValueError(f"token_env={token_env!r}: the environment variable is unset or empty where the "
                             "gateway runs; set it on every node (from a Secret, say)")
        where = f"token_env={token_env!r}"
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters; use a long random "
                         "token (python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def exposure_refusal(host: str | None, has_token: bool, allow_unauthenticated: bool) -> str | None:
    """Why the gateway must not start behind a proxy bound to ``host``, or None when it may."""
    if has_token or allow_unauthenticated or host is None or host in LOOPBACK_HOSTS:
        return None
    return (f"Serve's proxy is bound to {host}, beyond loopback, and the gateway has no token: anyone who "
            "reaches the port could generate. Give token_file=FILE or token_env=VAR (clients then send "
            "'Authorization: Bearer <token>'), or allow_unauthenticated=true if an authenticating proxy or "
            "VPN stands in front")
