"""A replica's adopted stores (diffusiond.ray.adoption) without Ray: real daemons on ``tiny``.

A daemon runs on a store of a shared state dir holding its claim, as a replica's daemon does,
finishes a job and is stopped; then an ``Adoption`` (what a replica keeps) is asked for that
store by a request: it adopts it then, starts a daemon on it that serves the finished output,
stops that daemon when it idles, and starts it again for the next request."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from adoptkit import SERVE_ARGS, env, ready, replicas_daemon
from daemonkit import http, until

from diffusiond.protocol import ErrorCode
from diffusiond.ray import adoption, claims

JOB = {"model": "tiny", "width": 64, "height": 64, "steps": 2, "prompt": "kept", "seed": 3}


async def test_a_finished_store_is_adopted_on_demand_served_stopped_when_idle_and_started_again(
        model_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, owner, sock, proc = replicas_daemon(tmp_path)
    try:
        await until(lambda: ready(sock), timeout=120, what="the first daemon ready")
        async with http(sock) as s:
            async with s.post("/v1/jobs", json=JOB) as r:
                job = (await r.json())["id"]
            async def finished() -> bool:
                async with s.get(f"/v1/jobs/{job}") as r:
                    return (await r.json())["status"] == "succeeded"

            await until(finished, timeout=120, what="the job finished")
            async with s.get(f"/v1/jobs/{job}/outputs/0") as r:
                png = await r.read()
                assert r.status == 200, png[:200]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        owner.release()  # the replica and its daemon are gone

    a = adoption.Adoption(root, "adopter1", "adopter1", SERVE_ARGS, tmp_path, env(), lambda: (lambda: None), 120.0)
    assert a.scan() == [], "finished jobs only: not adopted before a request names them"
    d = await a.daemon_for("gone0001")
    marker = claims.read_marker(root, "gone0001")
    assert marker is not None and marker.by == "adopter1"
    assert "--preload" in d.args and d.args[d.args.index("--preload") + 1] == "none"

    async def fetch() -> bytes:
        async with d.http().get(f"/v1/jobs/{job}/outputs/0") as r:
            body = await r.read()
            assert r.status == 200, body[:200]
            return body

    assert await fetch() == png, "the finished output, from the gone daemon's files"
    # another replica that asks meanwhile is told who has it, and to retry
    other = adoption.Adoption(root, "adopter2", "adopter2", SERVE_ARGS, tmp_path / "o", env(),
                              lambda: (lambda: None), 120.0)
    with pytest.raises(adoption.Refusal) as refused:
        await other.daemon_for("gone0001")
    assert refused.value.status == 503 and refused.value.code == ErrorCode.REPLICA_UNAVAILABLE
    assert "adopted by replica adopter1" in str(refused.value)

    monkeypatch.setattr(adoption, "IDLE_STOP_S", 0.0)
    assert await a.tick() == 0
    assert d.stopped and d.exited() is not None, "idle with nothing to run: its daemon is stopped"
    assert claims.try_claim(root, "gone0001") is None, "the claim stays with the adopter"
    monkeypatch.setattr(adoption, "IDLE_STOP_S", 60.0)
    assert await a.daemon_for("gone0001") is d and d.exited() is None
    assert await fetch() == png, "started again for the next request"
    a.stop_all(30.0)
    assert d.exited() is not None
    assert claims.try_claim(root, "gone0001") is not None, "the adopter gone: the store is free again"


async def test_a_store_its_daemon_cannot_open_ends_its_requests_with_the_reason(
        model_cache: Path, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    (root / "junk0001").mkdir(parents=True)
    (root / "junk0001" / claims.DB).write_bytes(b"not a database, " * 256)
    claims.claim_own(root, "junk0001").release()
    a = adoption.Adoption(root, "adopter1", "adopter1", SERVE_ARGS, tmp_path, env(), lambda: (lambda: None), 120.0)
    taken = a.scan()
    assert [d.store for d in taken] == ["junk0001"], "an unreadable database may hold jobs: adopted"
    a.start(taken)
    for _ in range(2):  # the first request learns it, the next is told the same
        with pytest.raises(adoption.Refusal) as refused:
            await a.daemon_for("junk0001")
        assert refused.value.status == 410 and refused.value.code == ErrorCode.REPLICA_GONE
        assert "not a diffusiond state database" in str(refused.value)
    marker = claims.read_marker(root, "junk0001")
    assert marker is not None and marker.failed == str(refused.value)
    a.stop_all(10.0)
