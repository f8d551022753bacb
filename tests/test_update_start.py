"""A trainer's first call is often an update, sent as soon as it started the daemon (issue 29): the update goes
on the output socket, which a starting daemon binds just after its own socket. The client waits for it as a
submit waits for the daemon's own socket (``transport.SOCKET_WAIT_S``), so the update lands instead of failing
with "no such file". A real daemon, started after the call began.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon

import diffusiond.client.weights as client_weights
from diffusiond.client import Client
from diffusiond.client.errors import DaemonUnreachable
from diffusiond.pipelines import load_pipeline


def test_an_update_sent_before_the_daemon_listens_waits_for_it_and_lands(tmp_path: Path, model_cache: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_weights, "SOCKET_WAIT_S", 120.0)  # the start's speed on a loaded box is not the point
    unet = load_pipeline("tiny", device="cpu", dtype="float32").pipe.components["unet"]
    state = {k: np.zeros(tuple(v.shape), dtype=np.float32) for k, v in unet.state_dict().items()}
    sock = tmp_path / "d.sock"
    got: dict[str, Any] = {}

    def update() -> None:
        try:
            got["version"] = Client(str(sock), timeout=300).update_weights("tiny", "unet", state)
        except BaseException as exc:  # reported by the assertion below
            got["error"] = exc

    caller = threading.Thread(target=update)
    caller.start()  # before the daemon exists: its socket and the output socket are not there yet
    daemon = Daemon(sock, ["--model", "tiny", "--workers", "1"], tmp_path / "d.log",
                    env={"DIFFUSIOND_CACHE": str(model_cache)})
    try:
        daemon.start()
        caller.join(300)
    finally:
        daemon.stop()
    assert "error" not in got, got.get("error")
    assert got["version"] == 1


def test_an_update_for_a_daemon_that_never_comes_names_the_output_socket(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_weights, "SOCKET_WAIT_S", 0.3)
    with pytest.raises(DaemonUnreachable, match=r"d\.sock\.out"):
        Client(str(tmp_path / "d.sock")).update_weights("tiny", "unet", {"w": np.zeros(3, dtype=np.float32)})
