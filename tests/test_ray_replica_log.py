"""A replica whose daemon does not come up, without a cluster: the replica (``DaemonReplica``) is built as Serve
builds it, with Serve's replica context and Ray's GPU ids stood in for, and a real daemon behind it."""

from __future__ import annotations

import os
import tempfile
import types
from pathlib import Path

import pytest

# Ray reads this when it is imported, and this module may be collected before test_ray_deploy.py, whose
# cluster must stay on 127.0.0.1 (see test_ray.py)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'diffusiond[ray]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'diffusiond[ray]')")

from diffusiond.ray.replica import DaemonReplica  # noqa: E402


def test_a_daemon_not_ready_in_time_is_reported_with_its_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              model_cache: Path) -> None:
    """The replica stopped the daemon, which removes its private directory and the log in it, and read the log
    after: Serve's message said "not ready after 8s:" and nothing of why. Here the daemon listens on another
    socket than the replica's (what a --socket of a config given past the builder does), and the message must
    carry what the daemon said."""
    context = types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id="r54"))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    elsewhere = tmp_path / "elsewhere.sock"
    with pytest.raises(RuntimeError) as err:
        DaemonReplica(["--model", "tiny", "--preload", "none", "--socket", str(elsewhere)], start_timeout_s=8)
    assert "not ready after 8s" in str(err.value)
    assert f"listening on {elsewhere}" in str(err.value), str(err.value)
    assert not list(tmp_path.glob("diffusiond-ray-*")), "the replica's private directory is removed"
