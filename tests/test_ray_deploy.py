"""Deploying diffusiond on a real local Ray cluster bound to 127.0.0.1 (one replica of ``tiny``): what a team's
deployment arguments do. A ``config=FILE`` is served with its own models; a daemon command line the builder can
tell is wrong is refused before any replica starts; a replica whose daemon cannot start fails the deployment with
the daemon's reason and leaves no private directory behind on its node; a replica actor that is killed lets its
daemon drain and take its sockets away.

One cluster for the module (its start is most of the time); each test deploys and deletes its own application."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # one-machine cluster: stay on 127.0.0.1 (see test_ray.py)
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'diffusiond[ray]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'diffusiond[ray]')")

import aiohttp  # noqa: E402
from raykit import cmdline, free_port  # noqa: E402

from conftest import ROOT  # noqa: E402
from diffusiond.ray import build  # noqa: E402

ONE = {"replicas": "1", "cpus_per_replica": "0", "health_check_period_s": "2", "start_timeout_s": "120"}


@pytest.fixture(scope="module")
def cluster(model_cache: Path) -> Iterator[dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray puts Unix sockets under it
    env = pytest.MonkeyPatch()
    env.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setenv("TMPDIR", tmp)  # inherited by Ray's processes: the replicas' private directories go there
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, _temp_dir=tmp,
             logging_level="warning", log_to_driver=False)
    try:
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:"), "the test cluster stays on loopback"
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield {"url": f"http://127.0.0.1:{port}", "tmp": Path(tmp)}
    finally:
        serve.shutdown()
        ray.shutdown()
        env.undo()
        shutil.rmtree(tmp, ignore_errors=True)


def private_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("diffusiond-ray-*"))


def daemon_pids(tmp: Path) -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit()
            and f"--socket {tmp}/diffusiond-ray-" in cmdline(e) and " serve " in cmdline(e)}


async def test_a_config_files_models_are_served_through_the_proxy(cluster: dict[str, Any], tmp_path: Path) -> None:
    """The builder added ``--model tiny`` to every replica's daemon whatever the config file said, and the flag
    replaces the file's ``[[models]]``: the application came up serving tiny, and ``pic`` was model_not_found."""
    toml = tmp_path / "daemon.toml"
    toml.write_text('max_batch = 2\n\n[[models]]\nname = "pic"\nspec = "tiny"\n')
    serve.run(build({**ONE, "config": str(toml), "daemon_args": "--preload none"}), name="configured",
              route_prefix="/")
    try:
        async with aiohttp.ClientSession(base_url=cluster["url"]) as s, s.get("/v1/models") as r:
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["pic"]
    finally:
        serve.delete("configured")


def test_a_daemon_flag_with_a_typo_is_refused_before_any_replica_starts(cluster: dict[str, Any]) -> None:
    """Every replica's daemon exited 2 on it, and Serve started and retried replicas until the deployment failed."""
    with pytest.raises(ValueError, match=r"daemon_args='--max-bach 4'.*did you mean .*--max-batch"):
        build({**ONE, "daemon_args": "--max-bach 4"})
    assert not daemon_pids(cluster["tmp"]) and not private_dirs(cluster["tmp"])


def test_a_replica_whose_daemon_cannot_start_fails_with_its_reason_and_leaves_no_private_directory(
        cluster: dict[str, Any]) -> None:
    """A model folder missing on the replica's node (the builder does not look: models are on the replicas'
    nodes): each replica Serve starts and retries fails with the daemon's own line, which ``serve status`` shows,
    and no directory of its (daemon log, pid file, state) is left in the node's temporary folder: no healthy
    replica would ever run there to sweep it."""
    missing = cluster["tmp"] / "no-such-model.safetensors"
    with pytest.raises(RuntimeError, match="Deploying application broken failed"):
        serve.run(build({**ONE, "model": f"sd={missing}"}), name="broken", route_prefix="/broken")
    try:
        message = serve.status().applications["broken"].deployments["diffusiond"].message
        assert f"{missing} does not exist" in message, message[-2000:]
        assert not daemon_pids(cluster["tmp"])
        assert private_dirs(cluster["tmp"]) == []
    finally:
        serve.delete("broken")


def test_a_killed_replica_actor_lets_its_daemon_drain_and_take_its_socket_away(cluster: dict[str, Any]) -> None:
    """Serve kills a replica whose stop outlasts graceful_shutdown_timeout_s (a client still following a job's
    events, say), as ``ray.kill`` does here. Ray then SIGKILLs the processes the replica started
    (``kill_child_processes_on_worker_exit``) before the kernel's SIGTERM (``PR_SET_PDEATHSIG``) can reach the
    daemon: it never drained, and its socket and output socket stayed in the node's temporary folder."""
    # no health check within the test: a replacement's check would sweep the old replica's directory away
    serve.run(build({**ONE, "health_check_period_s": "300", "daemon_args": "--preload none --drain-grace-s 1"}),
              name="killed", route_prefix="/killed")
    try:
        [home] = [cluster["tmp"] / name for name in private_dirs(cluster["tmp"])]
        replica = home.name.split("-")[2]
        daemon = int((home / "daemon.pid").read_text())
        ray.kill(ray.get_actor(f"SERVE_REPLICA::killed#diffusiond#{replica}", namespace="serve"))
        deadline = time.monotonic() + 60
        while Path(f"/proc/{daemon}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{daemon}").exists(), "the daemon of a killed replica exits"
        log = (home / "daemon.log").read_text()
        assert "received SIGTERM; draining" in log and log.rstrip().endswith("stopped"), log[-1500:]
        assert not list(home.glob("*.sock*")), "the daemon took its sockets away as it stopped"
    finally:
        serve.delete("killed")
