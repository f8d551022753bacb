"""What the adoption tests share, without Ray: a daemon's command line and environment, its readiness, and the
daemon of a replica that then goes (its store claimed in a shared state dir, the claim's fd passed to it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from daemonkit import http

from conftest import ROOT
from diffusiond.ray import adoption, claims

SERVE_ARGS = ["--model", "tiny", "--device", "cpu", "--max-batch", "1"]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1",
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


async def ready(socket: Path) -> bool:
    try:
        async with http(socket) as s, s.get("/ready") as r:
            return r.status == 200
    except OSError:
        return False


def replicas_daemon(tmp_path: Path) -> tuple[Path, claims.Claim, Path, subprocess.Popen[bytes]]:
    """The shared root, the claim of store ``gone0001`` in it, and the daemon serving that store on its socket."""
    root = tmp_path / "shared"
    owner = claims.claim_own(root, "gone0001")
    sock = tmp_path / "gone.sock"
    proc = adoption.spawn([*SERVE_ARGS, "--state-dir", str(root / "gone0001")], sock, tmp_path / "gone.log",
                          env(), (owner.fd,), None)
    return root, owner, sock, proc
