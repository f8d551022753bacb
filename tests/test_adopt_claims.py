"""The claims on a shared state dir (diffusiond.ray.claims), without Ray: real flocks held by real
processes, killed the way a lost node kills them.

Each scenario runs its contenders as separate Python processes, since a flock is per open file
and a process never conflicts with itself."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT
from diffusiond.daemon.state.rows import SCHEMA
from diffusiond.ray import claims


def python(code: str, *args: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True,
                            stdout=subprocess.PIPE, pass_fds=pass_fds)


HOLD = """
    import sys, time
    from pathlib import Path
    from diffusiond.ray import claims
    root, me = Path(sys.argv[1]), sys.argv[2]
    c = claims.claim_own(root, me)
    print(c.store, flush=True)
    time.sleep(600)
"""


def hold(root: Path, replica: str) -> tuple[subprocess.Popen[str], str]:
    """A process that runs ``replica``'s own store for its life, as a replica does."""
    p = python(HOLD, str(root), replica)
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def free(root: Path, store: str) -> None:
    """The store's lock taken and let go: its owner was here, and is gone."""
    claim = claims.try_claim(root, store)
    assert claim is not None
    claim.release()


def kill(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()


def with_jobs(root: Path, store: str, statuses: list[str]) -> None:
    """A store's database as its daemon leaves it: the daemon's own schema, jobs in those states."""
    (root / store).mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(root / store / claims.DB)
    con.executescript(SCHEMA)
    for i, status in enumerate(statuses):
        con.execute("INSERT INTO jobs (id, created, model, status, stage, request, seeds) VALUES (?,?,?,?,?,?,?)",
                    (f"j_{i:016x}", 0.0, "tiny", status, "queued", "{}", "[]"))
    con.commit()
    con.close()


def test_a_live_owner_keeps_its_store_and_its_death_frees_it(tmp_path: Path) -> None:
    owner, store = hold(tmp_path, "aaaa")
    try:
        assert store == "aaaa"
        assert claims.adopt(tmp_path, "aaaa", "bbbb") is None, "the owner is alive: no one adopts"
        assert claims.read_marker(tmp_path, "aaaa") is None
    finally:
        kill(owner)  # SIGKILL: no goodbye, as when a node is lost
    claim = claims.adopt(tmp_path, "aaaa", "bbbb")
    assert claim is not None, "a flock dies with its process: the store is free"
    marker = claims.read_marker(tmp_path, "aaaa")
    assert marker is not None and marker.by == "bbbb" and marker.failed is None
    claim.release()


def test_the_lock_lives_while_the_daemon_holding_it_lives(tmp_path: Path) -> None:
    """The replica hands its claim to its daemon (pass_fds): a daemon still draining after its
    replica died holds the store, so no adopter starts a second daemon on it."""
    claim = claims.claim_own(tmp_path, "cccc")
    daemon = python("import time; time.sleep(600)", pass_fds=(claim.fd,))
    try:
        claim.release()  # the replica is gone; its daemon is not
        time.sleep(0.2)
        assert claims.adopt(tmp_path, "cccc", "dddd") is None
    finally:
        kill(daemon)
    again = claims.adopt(tmp_path, "cccc", "dddd")
    assert again is not None
    again.release()


def test_a_daemon_still_holding_its_state_lock_keeps_the_store(tmp_path: Path) -> None:
    """A daemon started without the claim (by hand, or an older diffusiond) on a store: its own
    ``lock`` says it still runs, so the store is not adopted under it."""
    (tmp_path / "eeee").mkdir()
    daemon = python("""
        import fcntl, os, sys, time
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
    """, str(tmp_path / "eeee" / claims.DAEMON_LOCK))
    try:
        assert daemon.stdout is not None and daemon.stdout.readline().strip() == "held"
        assert claims.adopt(tmp_path, "eeee", "ffff") is None
        assert claims.try_claim(tmp_path, "eeee") is not None, "adopt let the claim go again"
    finally:
        kill(daemon)


RACE = """
    import json, sys, time
    from pathlib import Path
    from diffusiond.ray import claims
    root, me, start = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    time.sleep(max(0.0, start - time.time()))
    taken = claims.scan(root, me, set())
    print(json.dumps([c.store for c in taken]), flush=True)
    time.sleep(600)
"""


def test_two_replicas_racing_for_gone_stores_adopt_each_exactly_once(tmp_path: Path) -> None:
    gone = [f"g{i:03d}" for i in range(12)]
    for store in gone:
        with_jobs(tmp_path, store, ["queued", "running", "succeeded"])
        free(tmp_path, store)
    start = time.time() + 1.5  # both processes imported and waiting: they scan at the same moment
    racers = {me: python(RACE, str(tmp_path), me, str(start)) for me in ("r1", "r2")}
    try:
        won = {me: set(json.loads(p.stdout.readline())) for me, p in racers.items() if p.stdout is not None}
        assert won["r1"] | won["r2"] == set(gone), won
        assert not won["r1"] & won["r2"], f"stores adopted twice: {won['r1'] & won['r2']}"
        for me, stores in won.items():
            for store in stores:
                marker = claims.read_marker(tmp_path, store)
                assert marker is not None and marker.by == me
        assert all(claims.try_claim(tmp_path, s) is None for s in gone), "each adopter holds what it won"
    finally:
        for p in racers.values():
            kill(p)


def test_a_replica_that_comes_back_does_not_open_its_adopted_store(tmp_path: Path) -> None:
    with_jobs(tmp_path, "hhhh", ["queued"])
    owner, _ = hold(tmp_path, "hhhh")
    kill(owner)
    adopter = claims.scan(tmp_path, "iiii", set())
    assert [c.store for c in adopter] == ["hhhh"]
    back, store = hold(tmp_path, "hhhh")  # the same replica id again, while the adopter lives
    try:
        assert store == "hhhh-2", "its jobs are the adopter's: it runs a new store"
    finally:
        kill(back)
    adopter[0].release()  # the adopter is gone too: the marker still says the jobs were taken
    back, store = hold(tmp_path, "hhhh")
    try:
        assert store == "hhhh-2"
    finally:
        kill(back)
    assert claims.unfinished(tmp_path, "hhhh") == 1, "nothing of the comeback touched the adopted store"


def test_scan_leaves_stores_with_nothing_to_run_and_takes_unreadable_ones(tmp_path: Path) -> None:
    """A store of finished jobs waits for a request that names one; a database that cannot be
    read is adopted, so its daemon says why and its jobs' requests get that reason."""
    with_jobs(tmp_path, "done", ["succeeded", "failed", "cancelled"])
    with_jobs(tmp_path, "live", ["succeeded", "queued"])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / claims.DB).write_bytes(b"not a database" * 100)
    for store in ("done", "live", "junk"):
        free(tmp_path, store)
    assert [claims.unfinished(tmp_path, s) for s in ("done", "live", "junk")] == [0, 1, -1]
    taken = claims.scan(tmp_path, "me", {"live"})
    assert [c.store for c in taken] == ["junk"], "held stores are not scanned again"
    taken += claims.scan(tmp_path, "me", set())
    assert sorted(c.store for c in taken) == ["junk", "live"]


def test_a_marker_is_whole_or_absent(tmp_path: Path) -> None:
    (tmp_path / "kkkk").mkdir()
    assert claims.read_marker(tmp_path, "kkkk") is None
    (tmp_path / "kkkk" / claims.MARKER).write_text("{not json")
    assert claims.read_marker(tmp_path, "kkkk") is None
    claims.write_marker(tmp_path, "kkkk", "llll", failed="its database is not ours")
    marker = claims.read_marker(tmp_path, "kkkk")
    assert marker is not None and (marker.by, marker.failed) == ("llll", "its database is not ours")
    assert [p.name for p in (tmp_path / "kkkk").iterdir()] == [claims.MARKER], "no temporary file left"


@pytest.mark.parametrize("bad", ["", "nodeA", "nodeA=x", "=1", "nodeA=0"])
def test_resources_per_replica_refuses_what_is_not_name_equals_amount(bad: str) -> None:
    from diffusiond.ray.app import Options

    if bad == "":
        assert Options.parse({"resources_per_replica": bad}).resources_per_replica == ()
        return
    with pytest.raises(ValueError, match="resources_per_replica"):
        Options.parse({"resources_per_replica": bad})


def test_builder_arguments_for_a_shared_state_dir() -> None:
    from diffusiond.ray.app import Options

    opts = Options.parse({"shared_state_dir": "/vol/state", "resources_per_replica": "nodeA=1,gpu_slot=0.5"})
    assert opts.shared_state_dir == "/vol/state"
    assert opts.resources_per_replica == (("nodeA", 1.0), ("gpu_slot", 0.5))
    with pytest.raises(ValueError, match=r"shared_state_dir.*--state-dir"):
        Options.parse({"shared_state_dir": "/vol/state", "daemon_args": "--state-dir /other"})
