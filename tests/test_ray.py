"""diffusiond on Ray Serve, on a real local Ray cluster bound to 127.0.0.1: two replicas of
``tiny``, each a real daemon with a real worker, reached through Serve's HTTP proxy.

One cluster and one application for the module (starting Ray and two daemons is most of the
time); the tests run in file order and the last one shuts Serve down. The helpers are raykit.py's:
the tests stay in one module so that the cluster starts once."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# On Linux Ray swaps 127.0.0.1 for the host's reachable address (and listens on every interface)
# unless told this is a one-machine cluster, as it assumes on macOS and Windows. Ray reads this
# when it is imported, so it is set before; the fixture checks that it took.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'diffusiond[ray]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'diffusiond[ray]')")

import aiohttp  # noqa: E402
from daemonkit import http, sse, until  # noqa: E402
from raykit import (  # noqa: E402
    GEN,
    LONG_STEPS,
    children,
    cmdline,
    daemon_socket,
    free_port,
    generate,
    idle,
    load_until,
    model_loads,
    replica_of,
)

from conftest import ROOT, shm_entries  # noqa: E402
from diffusiond.ray import build, ids  # noqa: E402
from diffusiond.ray.app import ROUTING_STATS_PERIOD_S  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
DAEMON_SOCKET = re.compile(r"diffusiond-ray-([A-Za-z0-9]+)-[^/]*/d\.sock")
JOB = {"model": "tiny", "width": 64, "height": 64, "steps": 2}  # the jobs API
TOKEN = "ray-gateway-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# The test cluster's temporary folder: Ray's, and (through TMPDIR) where its replicas put their
# daemons' folders, so the tests find this cluster's daemons and not another run's on the machine.
CLUSTER_TMP = ""


def daemons() -> dict[str, int]:
    """Replica id -> pid of the diffusiond daemon it runs (found by its private socket's path)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cmd = cmdline(entry)
            m = DAEMON_SOCKET.search(cmd)
            if m and " serve " in cmd and f"--socket {CLUSTER_TMP}/" in cmd:
                out[m[1]] = int(entry)
    return out


def serve_running() -> int:
    """Replicas Serve counts as running (a replacement's daemon exists before its model is loaded)."""
    states = serve.status().applications["diffusiond"].deployments["diffusiond"].replica_states
    return int(states.get("RUNNING", 0)) if set(states) == {"RUNNING"} else 0


START_LIMIT_S = 600.0  # two replicas loading tiny on the 2-core CI box take well under a minute


@pytest.fixture(scope="module")
def cluster(model_cache: Path) -> Iterator[dict[str, Any]]:
    shm_before = shm_entries()
    port = free_port()
    global CLUSTER_TMP
    tmp = CLUSTER_TMP = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray puts Unix sockets under it
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = pytest.MonkeyPatch()
    env.setenv("TMPDIR", tmp)  # inherited by Ray's processes, so the replicas' daemon folders go there
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, _temp_dir=tmp,
             logging_level="warning", log_to_driver=False)
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:"), "the test cluster stays on loopback"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN + "\n")
        app = build({"model": "tiny", "replicas": "2", "cpus_per_replica": "0", "health_check_period_s": "2",
                     "daemon_args": "--max-batch 4 --job-timeout 120 --drain-grace-s 10",
                     "token_file": str(token_file)})
        # serve.run waits for every replica to be healthy, and Serve retries a replica that fails
        # to start for ever: bounded here, so a replica that cannot start fails the tests with
        # Serve's own message instead of hanging the suite
        runner = threading.Thread(target=serve.run, args=(app,), kwargs={"name": "diffusiond", "route_prefix": "/"},
                                  daemon=True)
        runner.start()
        runner.join(START_LIMIT_S)
        if runner.is_alive():
            pytest.fail(f"the application was not running after {START_LIMIT_S:g}s: {serve.status().applications}")
        pids = set(daemons().values())
        yield {"url": f"http://127.0.0.1:{port}", "shm_before": shm_before, "pids": pids | children(pids),
               "token_file": str(token_file)}
    finally:
        serve.shutdown()
        ray.shutdown()
        env.undo()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_32_concurrent_requests_through_the_proxy_all_succeed_and_both_replicas_serve(cluster) -> None:
    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        answers = await asyncio.wait_for(asyncio.gather(*(generate(s, i) for i in range(32))), 300)
    assert [st for st, _ in answers] == [200] * 32, [b for st, b in answers if st != 200][:2]
    for _, body in answers:
        assert base64.b64decode(body["data"][0]["b64_json"]).startswith(PNG)
    served = {replica_of(b["job_id"]) for _, b in answers}
    assert served == set(daemons()), "every answer names one of the two running replicas, and both served some"


async def test_a_burst_of_batchable_jobs_spreads_over_both_replicas(cluster) -> None:
    """Jobs answer 202 at once, so Serve's count of calls in flight never sees them queue: the
    router weighs replicas by what their daemons hold, and batch affinity lets go at 4."""
    running = daemons()
    # the router sees a daemon's load as of its last report: let the reports catch up with the
    # earlier tests' work (both daemons idle) first, as a user's burst after a quiet spell would
    await until(lambda: idle(running), timeout=60, what="both daemons idle")
    await asyncio.sleep(2.5 * ROUTING_STATS_PERIOD_S)
    ids: list[str] = []
    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        try:
            for i in range(12):  # one after another: each has its 202 before the next is sent
                # 500 steps: the daemons still hold the first jobs while the last are sent (each
                # is cancelled at its next step at the end)
                body = {**JOB, "steps": 500, "prompt": f"a burst {i}", "seed": i}
                async with s.post("/v1/jobs", json=body) as r:
                    job = await r.json()
                    assert r.status == 202, job
                    ids.append(job["id"])
            by_replica = Counter(replica_of(j) for j in ids)
            assert set(by_replica) == set(running), f"the 12 jobs went {dict(by_replica)}"
        finally:
            for j in ids:
                async with s.delete(f"/v1/jobs/{j}") as r:
                    await r.read()


async def test_a_jobs_events_output_and_cancel_reach_the_replica_that_holds_it(cluster) -> None:
    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        async with s.post("/v1/jobs", json={**JOB, "prompt": "a lighthouse", "n": 2, "seed": 3}) as r:
            job = await r.json()
            assert r.status == 202, job
            assert r.headers["Location"] == f"/v1/jobs/{job['id']}"
        assert replica_of(job["id"]) in daemons()
        events = await sse(s, job["id"])
        assert events[-1][0] == "done", events[-1]
        final = events[-1][1]
        assert final["id"] == job["id"] and final["status"] == "succeeded"
        assert [o["url"] for o in final["outputs"]] == [f"/v1/jobs/{job['id']}/outputs/{k}" for k in (0, 1)]
        for out in final["outputs"]:
            async with s.get(out["url"]) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "image/png"
                assert (await r.read()).startswith(PNG)
        async with s.get(f"/v1/jobs/{job['id']}") as r:
            assert (await r.json())["id"] == job["id"]
        # a client's cancel that comes too late (?finished=keep) keeps the result; a plain DELETE of a
        # finished job deletes it on its replica, record and files
        async with s.delete(f"/v1/jobs/{job['id']}", params={"finished": "keep"}) as r:
            assert r.status == 409 and (await r.json())["error"]["code"] == "job_finished"
        async with s.delete(f"/v1/jobs/{job['id']}") as r:
            body = await r.json()
            assert r.status == 200 and body["deleted"] is True and body["id"] == job["id"], body
        async with s.get(f"/v1/jobs/{job['id']}") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "job_not_found"


async def test_ids_of_replicas_that_never_were_and_routes_not_served_get_clear_errors(cluster) -> None:
    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        async with s.get("/v1/jobs/zz9zz9zz.j_0123456789abcdef") as r:
            err = (await r.json())["error"]
            assert r.status == 410 and err["code"] == "replica_gone" and "zz9zz9zz" in err["message"]
        async with s.get("/v1/jobs/j_0123456789abcdef") as r:
            err = (await r.json())["error"]
            assert r.status == 404 and "REPLICA.j_HEX" in err["message"]
        async with s.post("/v1/admin/sleep") as r:
            assert r.status == 404 and "its socket" in (await r.json())["error"]["message"]
        async with s.get("/v1/models") as r:
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["tiny"]
        async with s.post("/v1/images/generations", json={**GEN, "prompt": "x", "n": 99}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["field"] == "n"


def test_the_official_openai_client_generates_and_edits_through_the_proxy(cluster) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{cluster['url']}/v1", api_key=TOKEN, timeout=120)
    extra = {"seed": 5, "num_inference_steps": 2}
    made = client.images.generate(model="tiny", prompt="a barn", size="64x64", response_format="b64_json",
                                  extra_body=extra)
    png = base64.b64decode(made.data[0].b64_json or "")
    assert png.startswith(PNG)
    edited = client.images.edit(model="tiny", image=("in.png", png, "image/png"), prompt="a red barn", n=1,
                                size="64x64", response_format="b64_json", extra_body=extra)
    assert base64.b64decode(edited.data[0].b64_json or "").startswith(PNG)


async def test_without_the_token_every_route_through_the_proxy_is_401_and_says_nothing_of_the_job(cluster) -> None:
    async with aiohttp.ClientSession(base_url=cluster["url"]) as s:
        async with s.post("/v1/jobs", json={**JOB, "prompt": "a secret"}, headers=AUTH) as r:
            job = (await r.json())["id"]
        routes = [*sorted(ids.UNBOUND_ROUTES), ("GET", f"/v1/jobs/{job}"), ("DELETE", f"/v1/jobs/{job}"),
                  ("GET", f"/v1/jobs/{job}/events"), ("GET", f"/v1/jobs/{job}/outputs/0"),
                  ("GET", "/v1/jobs/zz9zz9zz.j_0123456789abcdef"), ("POST", "/v1/admin/sleep"), ("GET", "/nope")]
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token-xx"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            for method, path in routes:
                async with s.request(method, path, json={**GEN, "prompt": "x"}, headers=headers) as r:
                    body = await r.json()
                    assert r.status == 401, (method, path, headers, body)
                    assert body["error"]["code"] == "unauthorized" and r.headers["WWW-Authenticate"] == "Bearer"
                    assert job.split(".")[1] not in str(body) and "secret" not in str(body)
        async with s.get(f"/v1/jobs/{job}", headers=AUTH) as r:
            assert r.status == 200 and (await r.json())["status"] != "cancelled", "nothing unauthorized reached it"


def test_the_openai_client_without_the_token_is_refused(cluster) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{cluster['url']}/v1", api_key="not-the-token", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.images.generate(model="tiny", prompt="a barn", size="64x64", response_format="b64_json")


async def test_a_sleeping_replica_takes_no_new_work_until_it_wakes(cluster) -> None:
    running = daemons()
    asleep, awake = sorted(running)
    async with http(Path(daemon_socket(running[asleep]))) as d, d.post("/v1/admin/sleep") as r:
        assert r.status == 200
    try:
        # the router learns it from the replicas' routing stats, sent every ROUTING_STATS_PERIOD_S
        await asyncio.sleep(3 * ROUTING_STATS_PERIOD_S)
        async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
            answers = await asyncio.wait_for(asyncio.gather(*(generate(s, 50 + i) for i in range(8))), 120)
        assert [st for st, _ in answers] == [200] * 8
        assert {replica_of(b["job_id"]) for _, b in answers} == {awake}
    finally:
        async with http(Path(daemon_socket(running[asleep]))) as d, d.post("/v1/admin/wake") as r:
            assert r.status == 200
    await asyncio.sleep(3 * ROUTING_STATS_PERIOD_S)


async def test_a_replica_whose_daemon_is_killed_mid_load_fails_its_jobs_with_a_reason_and_is_replaced(cluster) -> None:
    before = daemons()
    assert len(before) == 2
    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        async with s.post("/v1/jobs", json={**JOB, "prompt": "held", "steps": LONG_STEPS}) as r:
            held = (await r.json())["id"]
        victim = replica_of(held)
        victim_workers = children({before[victim]})
        # kill it while it is computing some of the load and the other replica some more, not after
        # the load finished: requests go on until both replicas hold some of it
        load, _ = await load_until(
            s, before, "mid-load", 100,
            lambda jobs: jobs[victim] >= 1 and any(n for r, n in jobs.items() if r != victim),
            f"the load to reach both the victim {victim} and the other replica")
        os.kill(before[victim], signal.SIGKILL)
        answers = await asyncio.wait_for(asyncio.gather(*load), 300)  # none hangs
        failed = [body for status, body in answers if status != 200]
        for body in failed:
            assert body["error"]["code"] == "replica_unavailable", body
            assert victim in body["error"]["message"] and "killed by signal 9" in body["error"]["message"]
        assert failed, "the victim's jobs failed with a reason"
        assert len(failed) < len(answers), "the other replica kept serving"
        served = {replica_of(b["job_id"]) for st, b in answers if st == 200}
        assert victim not in served or len(served) == 2

        async def held_job_status() -> tuple[int, dict[str, Any]]:
            async with s.get(f"/v1/jobs/{held}") as r:
                return r.status, await r.json()

        deadline = time.monotonic() + 180
        status, body = await held_job_status()
        while status != 410 and time.monotonic() < deadline:  # 503 naming the replica until Serve replaces it
            assert status == 503 and victim in body["error"]["message"], body
            await asyncio.sleep(1)
            status, body = await held_job_status()
        assert status == 410 and body["error"]["code"] == "replica_gone" and victim in body["error"]["message"]

        async def replaced() -> bool:
            now = daemons()
            return len(now) == 2 and victim not in now and serve_running() == 2
        while not await replaced() and time.monotonic() < deadline:
            await asyncio.sleep(1)
        assert await replaced(), f"Serve did not start a new replica in place of {victim}: {daemons()}"
        async def workers_gone() -> bool:
            return not {p for p in victim_workers if cmdline(p)}

        await until(workers_gone, 60, "the killed daemon's workers to exit")
        answers = await asyncio.wait_for(asyncio.gather(*(generate(s, 200 + i) for i in range(8))), 180)
        assert [st for st, _ in answers] == [200] * 8


async def test_a_client_that_goes_away_cancels_its_synchronous_job_in_the_daemon(cluster) -> None:
    running = daemons()
    body = {**GEN, "prompt": "nobody waits for this", "num_inference_steps": 500}

    async def running_job() -> tuple[int, str] | None:
        for pid in running.values():
            async with http(Path(daemon_socket(pid))) as d, d.get("/v1/jobs") as r:
                for job in (await r.json())["data"]:
                    if job["request"]["prompt"] == body["prompt"] and job["status"] == "running":
                        return pid, job["id"]
        return None

    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        request = asyncio.create_task(s.post("/v1/images/generations", json=body))
        pid, job_id = await until(running_job, 120, "the job to run in a daemon")
        request.cancel()  # the client hangs up: proxy -> gateway -> replica -> daemon
        with contextlib.suppress(asyncio.CancelledError):
            await request

    async def ended() -> dict[str, Any] | None:
        async with http(Path(daemon_socket(pid))) as d, d.get(f"/v1/jobs/{job_id}") as r:
            job = dict(await r.json())
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    job = await until(ended, 60, "the daemon to end the job")
    assert job["status"] == "cancelled" and job["progress"]["step"] < 500


async def test_a_killed_replica_actor_takes_its_daemon_and_workers_with_it(cluster) -> None:
    running = daemons()
    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        # the victim is a replica that holds some of the load: the router may send all of it to one. The jobs are
        # long enough (480 steps, under max_steps) that none ends between the count and the kill landing (at 60
        # steps, on a loaded 2-core box, a victim's 2 jobs once finished first); the rest are cancelled once the
        # victim's have failed
        load, jobs = await load_until(s, running, "actor-kill", 400, lambda jobs: any(jobs.values()),
                                      "a replica to take some of the load", steps=8 * LONG_STEPS)
        victim = max(sorted(jobs), key=jobs.__getitem__)
        gone = {running[victim]} | children({running[victim]})
        actor = ray.get_actor(f"SERVE_REPLICA::diffusiond#diffusiond#{victim}", namespace="serve")
        ray.kill(actor)  # no __del__: the replica's process just ends

        async def failures() -> list[dict[str, Any]] | None:
            answered = [t.result() for t in load if t.done() and not t.cancelled() and t.exception() is None]
            return [body for status, body in answered if status != 200] or None

        try:
            failed = await until(failures, 120, f"the requests {victim} held ({jobs[victim]}) to fail")
        finally:
            for t in load:
                t.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    assert all(b["error"]["code"] == "replica_unavailable" for b in failed), failed
    assert "ended before it answered" in failed[0]["error"]["message"]

    async def all_gone() -> bool:
        return not {p for p in gone if cmdline(p)}

    await until(all_gone, 60, "the daemon and workers of the killed replica to exit")

    async def replaced() -> bool:
        now = daemons()
        return len(now) == 2 and victim not in now and serve_running() == 2

    await until(replaced, 180, f"Serve to start a replica in place of {victim}")
    async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
        answers = await asyncio.wait_for(asyncio.gather(*(generate(s, 300 + i) for i in range(8))), 180)
    assert [st for st, _ in answers] == [200] * 8


def test_with_room_for_one_model_per_replica_each_of_two_models_settles_on_one_replica(cluster) -> None:
    """Two models loaded on demand, a device budget that holds one: alternating requests go where
    their model is (the replicas' residency reports), so each replica loads one model once
    instead of both swapping at every request. The application is deployed again for this (the
    last test before shutdown), with the budget and the second model."""
    from diffusiond.daemon.residency.sizes import model_weights
    from diffusiond.daemon.residency.working import Shape, default_working
    from diffusiond.pipelines.tiny import ensure_tiny

    weights = model_weights(ensure_tiny()).bytes_at("float32")
    budget = weights + default_working(weights, Shape(64, 64)) + weights // 2  # one model, not two
    app = build({"model": "tiny,tiny2=tiny", "replicas": "2", "cpus_per_replica": "0",
                 "health_check_period_s": "2", "token_file": cluster["token_file"],
                 "daemon_args": f"--max-batch 1 --device-memory {budget} --keep-alive -1 --preload tiny "
                                "--test-fault no_working_measure"})  # the budget is sized for the estimate
    old = set(daemons())
    serve.run(app, name="diffusiond", route_prefix="/")

    def settled() -> bool:
        now = daemons()
        return len(now) == 2 and not set(now) & old and serve_running() == 2
    deadline = time.monotonic() + 180
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert settled(), daemons()
    running = daemons()
    went: list[tuple[str, str]] = []

    async def alternate(n: int, pause: float) -> None:
        async with aiohttp.ClientSession(base_url=cluster["url"], headers=AUTH) as s:
            for i in range(n):
                model = ("tiny", "tiny2")[i % 2]
                async with s.post("/v1/images/generations", json={**GEN, "model": model, "prompt": f"p {i}"}) as r:
                    body = await r.json()
                    assert r.status == 200, body
                went.append((model, replica_of(body["job_id"])))
                await asyncio.sleep(pause)

    time.sleep(2.5 * ROUTING_STATS_PERIOD_S)  # the router has both replicas' first reports
    asyncio.run(alternate(4, 1.5 * ROUTING_STATS_PERIOD_S))  # tiny2's first load, on one replica
    before = {r: model_loads(pid) for r, pid in running.items()}
    went.clear()
    asyncio.run(alternate(10, 0.0))
    after = {r: model_loads(pid) for r, pid in running.items()}
    homes = {m: {r for mm, r in went if mm == m} for m in ("tiny", "tiny2")}
    assert all(len(h) == 1 for h in homes.values()) and homes["tiny"] != homes["tiny2"], (homes, went)
    assert after == before, f"no model was loaded again: {before} -> {after}"
    assert sum(c["tiny2"] for c in after.values()) == 1, f"tiny2 was loaded on one replica once: {after}"


def test_serve_shutdown_leaves_no_daemon_no_worker_and_nothing_in_dev_shm(cluster) -> None:
    pids = set(daemons().values())
    workers = children(pids)
    assert pids and workers, "each replica runs a daemon with a worker"
    serve.shutdown()
    deadline = time.monotonic() + 60
    alive = lambda: {p for p in pids | workers | cluster["pids"] if cmdline(p)}  # noqa: E731
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), [cmdline(p) for p in alive()]
    assert not daemons()
    leftover = {n for n in shm_entries() - cluster["shm_before"] if "diffusiond" in n or n.startswith("torch_")}
    assert not leftover
    assert not list(Path(tempfile.gettempdir()).glob("diffusiond-ray-*"))
