"""Jobs that outlive their replica, on a real Ray cluster of three nodes on 127.0.0.1
(``ray.cluster_utils.Cluster``): a head for Serve's controller, proxy and gateway, and two nodes
with one ``diffusiond_slot`` each, so each of the two replicas of ``tiny`` (real daemons, real
workers) runs on a node of its own, all keeping their stores in one shared state dir.

A node is killed (its raylet SIGKILLed, its replica with it): the surviving replica adopts the
lost one's store, its daemon there resumes the queued and running jobs, and clients get them
through the gateway under the ids they were given. Then a new node comes, the survivor's node
is killed too, and the new replica serves the finished jobs of both gone replicas on demand.

One cluster for the module; the tests run in file order, each building on the last."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # one-machine cluster: stay on 127.0.0.1 (see test_ray.py)
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'diffusiond[ray]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'diffusiond[ray]')")

import aiohttp  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from raykit import free_port  # noqa: E402

from conftest import ROOT  # noqa: E402
from diffusiond.ray import build, claims  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
JOB = {"model": "tiny", "width": 64, "height": 64}
LONG_STEPS = 40  # a job of tiny that is still queued or running when its node is killed
DAEMON = re.compile(r"--socket \S*/diffusiond-ray-([A-Za-z0-9]+)-[^/ ]*/(d|adopted-[A-Za-z0-9_-]+)\.sock")
TERMINAL = {"succeeded", "failed", "cancelled"}
START_LIMIT_S = 300.0
SLOT = {"diffusiond_slot": 1}
# the GCS declares a killed node dead after a second or two, not Ray's default 15 s
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 3}


def proc_parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def cmdlines() -> Iterator[tuple[int, str]]:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                yield int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def daemons(tmp: str) -> dict[tuple[str, str], int]:
    """(replica id, ``d`` or ``adopted-<store>``) -> pid of each diffusiond daemon of this cluster."""
    out = {}
    for entry, cmd in cmdlines():
        m = DAEMON.search(cmd)
        if m and " serve " in cmd and f"--socket {tmp}/" in cmd:
            out[(m[1], m[2])] = int(entry)
    return out


def node_of(cluster: Cluster, replica: str, tmp: str) -> Any:
    """The Ray node whose raylet started the replica's actor (the daemon's parent's parent)."""
    pid = daemons(tmp)[(replica, "d")]
    worker = proc_parent(pid)
    raylet = proc_parent(worker) if worker else None
    for node in cluster.worker_nodes:
        if node.all_processes["raylet"][0].process.pid == raylet:
            return node
    raise AssertionError(f"replica {replica}: daemon {pid}, worker {worker}, raylet {raylet} on no worker node")


def gateway_on(node: Any) -> bool:
    """Whether the gateway (Serve's ingress replica, no resources of its own: Serve may put it on
    any node) runs on ``node``: then losing the node loses the gateway too, and Serve's proxy
    answers 500 until Serve has started another."""
    raylet = node.all_processes["raylet"][0].process.pid
    return any(proc_parent(pid) == raylet for pid in gateways())


def gateways() -> list[int]:
    return [pid for pid, cmd in cmdlines() if cmd.startswith("ray::ServeReplica:diffusiond:gateway")]


async def lose(cluster: Cluster, replica: str, tmp: str, url: str) -> None:
    """Kill the replica's node (SIGKILL to its raylet: no goodbye) and wait until the replica and
    its daemons are gone (a worker outlives its raylet for a moment, answering still); if the
    gateway was there, wait for Serve's new one, so that what the test sees after is
    diffusiond's doing, not the proxy's."""
    node = node_of(cluster, replica, tmp)
    worker = proc_parent(daemons(tmp)[(replica, "d")])
    had_gateway = gateway_on(node)
    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 60
    while any(r == replica for r, _ in daemons(tmp)) or (worker and alive(worker)):
        assert time.monotonic() < deadline, f"replica {replica} or its daemons outlived their node by 60 s"
        await asyncio.sleep(0.2)
    if not had_gateway:
        return
    deadline = time.monotonic() + 90
    async with aiohttp.ClientSession(base_url=url) as s:
        while True:
            async with s.get("/v1/jobs/nosuchreplica.j_00") as r:
                if r.status != 500:
                    return
            assert time.monotonic() < deadline, "Serve did not replace the gateway lost with its node in 90 s"
            await asyncio.sleep(0.5)


def running_replicas() -> int:
    states = serve.status().applications["diffusiond"].deployments["diffusiond"].replica_states
    return int(states.get("RUNNING", 0))


@pytest.fixture(scope="module")
def app(model_cache: Path) -> Iterator[dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="ra", dir="/tmp")  # short: Ray puts Unix sockets under it
    os.makedirs(f"{tmp}/ray")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = pytest.MonkeyPatch()
    env.setenv("TMPDIR", tmp)  # Ray's files and the replicas' private folders, this run's only
    port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": "127.0.0.1", "num_cpus": 0, "include_dashboard": False, "temp_dir": tmp,
        "_system_config": FAST_NODE_DEATH})
    try:
        for _ in range(2):
            cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, resources=SLOT)
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="warning", log_to_driver=False)
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:"), "the test cluster stays on loopback"
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        shared = Path(tmp) / "shared"
        bound = build({"model": "tiny", "replicas": "2", "cpus_per_replica": "0",
                       "resources_per_replica": "diffusiond_slot=1", "health_check_period_s": "2",
                       "shared_state_dir": str(shared),
                       "daemon_args": "--max-batch 1 --job-timeout 120 --drain-grace-s 0"})
        runner = threading.Thread(target=serve.run, args=(bound,), kwargs={"name": "diffusiond", "route_prefix": "/"},
                                  daemon=True)
        runner.start()
        runner.join(START_LIMIT_S)
        if runner.is_alive():
            pytest.fail(f"the application was not running after {START_LIMIT_S:g}s: {serve.status().applications}")
        yield {"url": f"http://127.0.0.1:{port}", "cluster": cluster, "tmp": tmp, "shared": shared, "state": {}}
    finally:
        with pytest.MonkeyPatch.context():
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()
        env.undo()
        shutil.rmtree(tmp, ignore_errors=True)


def replica_of(job_id: str) -> str:
    return job_id.split(".", 1)[0]


async def submit(s: aiohttp.ClientSession, steps: int, seed: int) -> str:
    async with s.post("/v1/jobs", json={**JOB, "steps": steps, "prompt": f"adopt {seed}", "seed": seed}) as r:
        doc = await r.json()
        assert r.status == 202, doc
        return str(doc["id"])


async def settle(s: aiohttp.ClientSession, job_id: str, timeout: float = 150.0) -> dict[str, Any]:
    """The job's document once it is terminal, through the gateway. While its replica is being
    lost and its store adopted, the gateway answers 503 ``replica_unavailable`` (with a reason)
    and the job may be queued again: anything else fails the test."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        async with s.get(f"/v1/jobs/{job_id}") as r:
            last = (r.status, await r.json() if r.content_type == "application/json" else await r.text())
        if r.status == 200 and last[1]["status"] in TERMINAL:
            return dict(last[1])
        assert r.status in (200, 503), last
        if r.status == 503:
            assert last[1]["error"]["code"] == "replica_unavailable" and last[1]["error"]["message"], last
        await asyncio.sleep(0.5)
    pytest.fail(f"job {job_id} was not terminal after {timeout:g}s: last answer {last}")


async def output(s: aiohttp.ClientSession, job_id: str) -> bytes:
    async with s.get(f"/v1/jobs/{job_id}/outputs/0") as r:
        body = await r.read()
        assert r.status == 200, body[:300]
        return body


async def test_a_lost_nodes_queued_and_running_jobs_are_adopted_and_finish_under_their_ids(app) -> None:
    tmp, state = app["tmp"], app["state"]
    replicas = {r for r, kind in daemons(tmp) if kind == "d"}
    assert len(replicas) == 2
    assert len(gateways()) == 1, "the gateway's process is found (lose() waits for a new one if it goes)"
    assert {node_of(app["cluster"], r, tmp).unique_id for r in replicas} == {
        n.unique_id for n in app["cluster"].worker_nodes}, "one replica on each worker node"
    async with aiohttp.ClientSession(base_url=app["url"]) as s:
        done = await submit(s, 2, 0)
        assert (await settle(s, done))["status"] == "succeeded"
        victim = replica_of(done)
        before = await output(s, done)
        assert before.startswith(PNG)
        # long jobs until the victim holds two (one runs, one waits: --max-batch 1) and the survivor one: the
        # last test names the survivor's own store through that job (a store no request names is not adopted)
        jobs: list[str] = []
        for seed in range(1, 17):
            jobs.append(await submit(s, LONG_STEPS, seed))
            if sum(replica_of(j) == victim for j in jobs) >= 2 and any(replica_of(j) != victim for j in jobs):
                break
        mine = [j for j in jobs if replica_of(j) == victim]
        assert len(mine) >= 2, f"the router sent the victim {victim} {len(mine)} of {jobs}"
        async with s.get(f"/v1/jobs/{mine[-1]}") as r:
            assert (await r.json())["status"] in ("queued", "running"), "still to run when its node goes"
        survivor = (replicas - {victim}).pop()
        assert any(replica_of(j) == survivor for j in jobs), f"the router sent the survivor none of {jobs}"

        await lose(app["cluster"], victim, tmp, app["url"])

        for job in jobs:
            final = await settle(s, job)
            assert final["id"] == job and final["status"] == "succeeded", final
            assert (await output(s, job)).startswith(PNG)
        marker = claims.read_marker(app["shared"], victim)
        assert marker is not None and marker.by == survivor and marker.failed is None
        assert (survivor, f"adopted-{victim}") in daemons(tmp), "the survivor runs a daemon on the victim's store"
        # the finished job of the gone replica: the same bytes, under the same URL
        assert (await output(s, done)) == before
        async with s.get(f"/v1/jobs/{mine[-1]}") as r:
            doc = await r.json()
        assert doc["status"] == "succeeded" and doc["id"] == mine[-1]
    state.update(victim=victim, survivor=survivor, done=done, done_png=before,
                 survivor_jobs=[j for j in jobs if replica_of(j) == survivor], victim_jobs=mine)


async def test_a_gone_replica_without_a_record_and_an_unreadable_store_end_with_their_reasons(app) -> None:
    async with aiohttp.ClientSession(base_url=app["url"]) as s:
        async with s.get("/v1/jobs/nosuchreplica.j_0123456789abcdef") as r:
            doc = await r.json()
        assert r.status == 410 and doc["error"]["code"] == "replica_gone", doc
        assert "no record" in doc["error"]["message"], doc
        # a store whose database is not diffusiond's: its daemon refuses it, and the job's
        # requests get that reason as a 410, not a hang nor a 500
        junk = app["shared"] / "junkstore"
        junk.mkdir()
        (junk / claims.DB).write_bytes(b"not a database, " * 256)
        claim = claims.try_claim(app["shared"], "junkstore")  # its owner was here, and is gone
        assert claim is not None
        claim.release()
        async with s.get("/v1/jobs/junkstore.j_0123456789abcdef") as r:
            doc = await r.json()
        assert r.status == 410 and doc["error"]["code"] == "replica_gone", doc
        assert "not a diffusiond state database" in doc["error"]["message"], doc
        async with s.get("/v1/jobs/junkstore.j_0123456789abcdef/outputs/0") as r:
            assert r.status == 410 and (await r.json())["error"]["message"] == doc["error"]["message"]
        marker = claims.read_marker(app["shared"], "junkstore")
        assert marker is not None and marker.failed == doc["error"]["message"]


async def test_a_new_replica_serves_the_finished_jobs_of_both_gone_replicas(app) -> None:
    """The survivor's node goes too, after a new node has come: the new replica adopts the
    survivor's own store and the one the survivor had adopted (their jobs all finished), on the
    first request that names each, and serves the same outputs; nothing is run again."""
    tmp, state, cluster = app["tmp"], app["state"], app["cluster"]
    cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, resources=SLOT)
    deadline = time.monotonic() + 180
    while running_replicas() < 2:
        assert time.monotonic() < deadline, f"no new replica on the new node: {serve.status().applications}"
        await asyncio.sleep(1)
    newcomer = ({r for r, kind in daemons(tmp) if kind == "d"} - {state["survivor"]}).pop()
    survivor_png = None
    async with aiohttp.ClientSession(base_url=app["url"]) as s:
        if state["survivor_jobs"]:
            survivor_png = await output(s, state["survivor_jobs"][0])
        await lose(cluster, state["survivor"], tmp, app["url"])
        assert (await settle(s, state["done"]))["status"] == "succeeded"
        assert (await output(s, state["done"])) == state["done_png"]
        for job in state["victim_jobs"] + state["survivor_jobs"]:
            final = await settle(s, job)
            assert final["status"] == "succeeded" and final["id"] == job, final
        if survivor_png is not None:
            assert (await output(s, state["survivor_jobs"][0])) == survivor_png
    for store in (state["victim"], state["survivor"]):
        marker = claims.read_marker(app["shared"], store)
        assert marker is not None and marker.by == newcomer, (store, marker)
        assert claims.unfinished(app["shared"], store) == 0


def test_a_replica_that_comes_back_under_an_adopted_id_takes_a_new_store(app) -> None:
    """Serve never reuses a replica id; were one to come back, its adopted store stays the
    adopter's and it runs a store of its own (what ``DaemonReplica`` calls at start)."""
    victim = app["state"]["victim"]
    claim = claims.claim_own(app["shared"], victim)
    try:
        assert claim.store == f"{victim}-2"
    finally:
        claim.release()
