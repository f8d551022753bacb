"""Outputs handed to local programs by file descriptor (the output socket), against a real daemon:
the arrays are the model's bytes, they outlive the job's retention while held, their slots come
back when they are dropped or their holder is killed, and nobody can write through the fd."""

from __future__ import annotations

import gc
import io
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, shared_daemon

from conftest import ROOT
from diffusiond.client import DaemonError
from diffusiond.client.zerocopy import OutputMapper, ZeroCopyUnavailable, receive
from diffusiond.ipc.arena import is_sealed

VIDEO = "video=synthetic:task=video,compute_ms=5"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("zerocopy")
    # in memory only: these tests are about outputs in shared memory (with a state dir an output
    # whose slot went back is served again from its file)
    args = ["--model", "tiny", "--model", VIDEO, "--arena-mb", "64", "--no-persist"]
    with shared_daemon(tmp, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d


def call(d: Daemon, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    import http.client
    import json
    import socket

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(str(d.socket))

    c = Conn("diffusiond", timeout=60)
    c.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


def run_job(d: Daemon, **body: Any) -> str:
    import json

    status, data = call(d, "POST", "/v1/jobs", {"prompt": "a lighthouse", "output_format": "npy", **body})
    assert status == 202, data
    job = json.loads(data)["id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = json.loads(call(d, "GET", f"/v1/jobs/{job}")[1])
        if state["status"] in ("succeeded", "failed", "cancelled"):
            assert state["status"] == "succeeded", state
            return str(job)
        time.sleep(0.05)
    raise TimeoutError(job)


def arena_in_use(d: Daemon) -> int:
    import json

    return int(json.loads(call(d, "GET", "/health")[1])["arena_bytes_in_use"])


def wait_for(check: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        gc.collect()
        time.sleep(0.05)


def test_arrays_are_the_models_bytes_read_only_and_without_a_copy(daemon: Daemon) -> None:
    mapped, streamed = run_job(daemon, seed=11, n=2), run_job(daemon, seed=11, n=2)
    with OutputMapper(str(daemon.socket)) as m:
        for k in range(2):
            a = m.array(mapped, k)
            b = np.load(io.BytesIO(call(daemon, "GET", f"/v1/jobs/{streamed}/outputs/{k}")[1]))
            assert a.shape == (128, 128, 3) and a.dtype == np.uint8
            assert np.array_equal(a, b)
            assert not a.flags.writeable and not a.flags.owndata
            with pytest.raises(ValueError, match="read-only"):
                a[0, 0, 0] = 0


def test_float_and_video_outputs_keep_their_dtype_and_shape(daemon: Daemon) -> None:
    job = run_job(daemon, model="video", width=64, height=64, steps=1, num_frames=5, output_dtype="float16")
    with OutputMapper(str(daemon.socket)) as m:
        a = m.array(job, 0)
        assert a.shape == (5, 64, 64, 3) and a.dtype == np.float16
        assert float(a.min()) >= 0.0 and float(a.max()) <= 1.0


def test_the_array_outlives_the_jobs_retention_and_its_slot_returns_when_dropped(
        tmp_path: Path, model_cache: Path) -> None:
    args = ["--model", "tiny", "--retention-s", "2", "--no-persist"]
    with shared_daemon(tmp_path, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d, OutputMapper(str(d.socket)) as m:
        job = run_job(d, seed=5)
        a = m.array(job, 0)
        copy = a.copy()
        view = a[10:20]  # a view keeps the memory as the array does
        del a
        wait_for(lambda: call(d, "GET", f"/v1/jobs/{job}")[0] == 404, "the job's retention to end")
        assert arena_in_use(d) > 0, "the held output still has its slot"
        assert np.array_equal(view, copy[10:20])
        del view
        wait_for(lambda: arena_in_use(d) == 0, "the slot to come back after the last array went")


def test_an_output_is_delivered_once_and_other_errors_are_the_http_ones(daemon: Daemon) -> None:
    job = run_job(daemon)
    with OutputMapper(str(daemon.socket)) as m:
        a = m.array(job, 0)
        del a
        gc.collect()
        wait_for(lambda: call(daemon, "GET", f"/v1/jobs/{job}/outputs/0")[0] == 410, "the output to be released")
        with pytest.raises(DaemonError) as exc:
            m.array(job, 0)
        assert exc.value.status == 410 and exc.value.code == "output_released"
        with pytest.raises(DaemonError) as exc:
            m.array("j_missing", 0)
        assert exc.value.status == 404 and exc.value.code == "job_not_found"
        with pytest.raises(DaemonError) as exc:
            m.array(job, 7)
        assert exc.value.status == 404 and exc.value.code == "output_not_found"
        png = run_job(daemon, output_format="png")
        with pytest.raises(DaemonError) as exc:
            m.array(png, 0)
        assert exc.value.code == "not_shared" and "HTTP" in exc.value.message


def test_no_writable_mapping_can_be_had_from_the_fd(daemon: Daemon) -> None:
    job = run_job(daemon)
    with OutputMapper(str(daemon.socket)) as m:
        from diffusiond.ipc.messages import Fetch, Lease

        with m._lock:  # the raw lease, as a hostile client would hold it
            m._sock.sendall(m._encoder.encode(Fetch(job, 0)))
            msg, fds = receive(m._sock, m._decoder)
        assert isinstance(msg, Lease) and len(fds) == 1
        fd = fds[0]
        try:
            assert is_sealed(fd)
            with pytest.raises(OSError):
                mmap.mmap(fd, msg.map_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.pwrite(fd, b"x", msg.tensor.offset)
            reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # memfd allows the reopen; the seal does not
            try:
                with pytest.raises(OSError):
                    mmap.mmap(reopened, msg.map_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(OSError):
                    os.pwrite(reopened, b"x", msg.tensor.offset)
            finally:
                os.close(reopened)
        finally:
            os.close(fd)


def test_a_client_killed_while_holding_ten_outputs_frees_them_all(daemon: Daemon) -> None:
    wait_for(lambda: arena_in_use(daemon) == 0, "an idle arena")
    job = run_job(daemon, n=10)
    holder = textwrap.dedent(f"""
        import sys, time
        from diffusiond.client.zerocopy import OutputMapper
        m = OutputMapper({str(daemon.socket)!r})
        held = [m.array({job!r}, k) for k in range(10)]
        print(sum(int(a[0, 0, 0]) >= 0 for a in held), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "10"
        assert arena_in_use(daemon) > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_for(lambda: arena_in_use(daemon) == 0, "the killed client's ten slots to come back")


def test_many_clients_at_once(daemon: Daemon) -> None:
    jobs = [run_job(daemon, seed=100 + i, n=2) for i in range(3)]
    errors: list[BaseException] = []

    def client(job: str) -> None:
        try:
            with OutputMapper(str(daemon.socket)) as m:
                arrays = [m.array(job, k) for k in range(2)]
                assert all(a.shape == (128, 128, 3) for a in arrays)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors


def test_no_output_socket_means_fall_back(tmp_path: Path) -> None:
    with pytest.raises(ZeroCopyUnavailable, match="no output socket"):
        OutputMapper(str(tmp_path / "nothing.sock"))


def test_only_the_daemons_user_can_reach_the_output_socket(daemon: Daemon) -> None:
    import stat

    st = os.stat(str(daemon.socket) + ".out")
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()


def test_an_output_spilled_out_of_shared_memory_comes_over_http(tmp_path: Path, model_cache: Path) -> None:
    """Unfetched outputs over half a small arena are copied out of it (spilled): the client takes
    those over HTTP and the rest by fd, and the caller gets its arrays either way."""
    from diffusiond import Client

    args = ["--model", "tiny", "--arena-mb", "1"]
    with shared_daemon(tmp_path, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d, Client(str(d.socket)) as c:
        handles = [c.submit("a lighthouse", n=4, seed=10 * i, output_format="npy") for i in range(4)]
        for h in handles:
            h.wait(timeout=120)
        arrays = [a for h in handles for a in h.outputs("array")]
        assert len(arrays) == 16 and all(a.shape == (128, 128, 3) and a.dtype == np.uint8 for a in arrays)
        assert any(not a.flags.writeable for a in arrays), "the outputs still in the arena came by fd"


def test_a_daemon_that_cannot_make_its_output_socket_still_serves_over_http(tmp_path: Path, model_cache: Path) -> None:
    (tmp_path / "d.sock.out").mkdir()  # the path is taken by something that is not ours to remove
    from diffusiond import Client

    with shared_daemon(tmp_path, ["--model", "tiny"], model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        assert "no output socket at" in d.log()
        with Client(str(d.socket)) as c:
            [a] = c.generate("a lighthouse", seed=1, output="array")
            assert a.shape == (128, 128, 3) and a.flags.writeable, "came over HTTP, into the client's memory"


def _fetch_while_stopped(daemon: Daemon, m: OutputMapper, job: str) -> None:
    """A fetch of ``job`` while the daemon is stopped (SIGSTOP): it times out, and the mapper hangs up."""
    assert daemon.proc is not None
    daemon.signal(signal.SIGSTOP)
    try:
        with pytest.raises(ZeroCopyUnavailable, match="did not answer in time"):
            m.array(job, 0)
    finally:
        daemon.signal(signal.SIGCONT)


def test_a_fetch_that_timed_out_never_hands_its_answer_to_the_next_call(daemon: Daemon) -> None:
    """The engine stopped past the mapper's timeout answers the FETCH late; that answer (job a's
    output) must not be taken for the next call's (job b's). The mapper hangs up instead."""
    a, b, same_as_b = run_job(daemon, seed=11), run_job(daemon, seed=22), run_job(daemon, seed=22)
    expected_b = np.load(io.BytesIO(call(daemon, "GET", f"/v1/jobs/{same_as_b}/outputs/0")[1]))
    with OutputMapper(str(daemon.socket), timeout=1.0) as m:
        _fetch_while_stopped(daemon, m, a)
        time.sleep(0.5)  # the late answer, were the connection still open, would be waiting in it by now
        with pytest.raises(ZeroCopyUnavailable, match=r"closed .*did not answer in time"):
            m.array(b, 0)
    with OutputMapper(str(daemon.socket)) as fresh:
        assert np.array_equal(fresh.array(b, 0), expected_b), "b is still b's, unleased"
    wait_for(lambda: arena_in_use(daemon) == 0, "the late lease of a to be taken back with its connection")


def test_a_job_past_its_retention_is_not_shared_and_the_client_reads_it_over_http(
        tmp_path: Path, model_cache: Path) -> None:
    """A persistent daemon still serves a job's outputs from its state dir once the job has left
    memory; the output socket says not_shared (not job_not_found), so the default client falls back to HTTP.
    Answers keep the order of the FETCHes, the one that waits for the state dir included."""
    import asyncio
    import json

    from diffusiond import AsyncClient
    from diffusiond.ipc.messages import Fetch, Refused

    def in_memory(d: Daemon) -> int:
        return sum(json.loads(call(d, "GET", "/health")[1])["jobs"].values())

    args = ["--model", "tiny", "--retention-s", "3"]  # and a state dir, which keeps the outputs
    with shared_daemon(tmp_path, args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        old = run_job(d, seed=5)
        wait_for(lambda: in_memory(d) == 0, "the job's retention to end")
        assert call(d, "GET", f"/v1/jobs/{old}")[0] == 200, "HTTP still has it"
        recent = run_job(d, seed=6)
        with OutputMapper(str(d.socket)) as m:
            with pytest.raises(DaemonError) as exc:
                m.array(old, 0)
            assert exc.value.status == 409 and exc.value.code == "not_shared" and "HTTP" in exc.value.message
            with pytest.raises(DaemonError) as exc:
                m.array("j_0123456789abcdef", 0)
            assert exc.value.status == 404 and exc.value.code == "job_not_found"
            fetches = [Fetch(old, 0), Fetch("j_0123456789abcdef", 1), Fetch(recent, 9)]  # the last answered at once
            with m._lock:  # pipelined, as the one-at-a-time OutputMapper never sends them
                m._sock.sendall(b"".join(m._encoder.encode(f) for f in fetches))  # its sequence numbers go on
                answers: list[object] = []
                while len(answers) < 3:
                    data = m._sock.recv(65536)
                    assert data, f"the daemon hung up after {answers}"
                    answers += [msg for _kind, _seq, _n, msg in m._decoder.feed(data)]
            assert all(isinstance(r, Refused) for r in answers)
            assert [(r.job_id, r.index, r.code) for r in answers] == [
                (old, 0, "not_shared"), ("j_0123456789abcdef", 1, "job_not_found"), (recent, 9, "output_not_found")]

        async def through_the_client() -> np.ndarray:
            async with AsyncClient(str(d.socket)) as c:  # zero_copy=None, the default
                return await c.array(old, 0)

        got = asyncio.run(through_the_client())
        again = np.load(io.BytesIO(call(d, "GET", f"/v1/jobs/{old}/outputs/0")[1]))
        assert got.shape == (128, 128, 3) and np.array_equal(got, again)


def test_an_unpin_the_daemon_can_no_longer_take_closes_the_connection(tmp_path: Path) -> None:
    """The daemon went away (and took back every lease with the connection): an UNPIN that cannot be sent closes
    the mapper, its socket included, and every later call says why."""
    import socket

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "d.sock.out"))
    server.listen(1)
    with server, OutputMapper(str(tmp_path / "d.sock")) as m:
        peer, _ = server.accept()
        peer.close()  # the daemon's end of the connection
        m._unpin(1)  # as the garbage collector does once an array is dropped
        assert m.closed
        assert m._sock.fileno() == -1, "the socket is closed with the mapper, not left to the garbage collector"
        with pytest.raises(ZeroCopyUnavailable, match=r"closed \(the output socket .* failed: .*Broken pipe"):
            m.array("j_0123456789abcdef", 0)


def _outlives(daemon: Daemon, a: np.ndarray, what: str) -> None:
    """``a`` keeps its bytes while jobs after it take slots (one of them would be its slot, given back)."""
    copy = a.copy()
    for seed in range(40, 46):
        run_job(daemon, seed=seed)
    assert np.array_equal(a, copy), f"the memory under a live array was reused after {what}"


def test_an_array_keeps_its_memory_when_its_mapper_is_collected(daemon: Daemon) -> None:
    """The release held the mapper weakly; collected, it closed its socket, and the daemon took back
    the memory of every array it had handed out."""
    job = run_job(daemon, seed=31)
    a = OutputMapper(str(daemon.socket)).array(job, 0)  # the mapper is kept by no one but its arrays
    gc.collect()
    _outlives(daemon, a, "its mapper was collected")


def test_a_forked_child_dropping_its_copy_of_an_array_leaves_the_parents_alone(daemon: Daemon) -> None:
    """The child inherited the connection, and its copy's finalizer unpinned the parent's lease."""
    job = run_job(daemon, seed=32)
    with OutputMapper(str(daemon.socket)) as m:
        a = m.array(job, 0)
        pid = os.fork()
        if pid == 0:  # the child: drops its copy (a DataLoader worker would), then leaves
            del a
            gc.collect()
            with pytest.raises(ZeroCopyUnavailable, match="does not cross a fork"):
                m.array(job, 0)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        _outlives(daemon, a, "a forked child dropped its copy")


def test_a_failed_fetch_keeps_the_arrays_handed_out_before_it(daemon: Daemon) -> None:
    """A fetch that timed out hung up the connection, and the daemon took back the memory of every
    array the mapper had handed out; it now keeps the connection, for their UNPINs only, until the last is gone."""
    held, late = run_job(daemon, seed=33), run_job(daemon, seed=34)
    m = OutputMapper(str(daemon.socket), timeout=1.0)
    a = m.array(held, 0)
    _fetch_while_stopped(daemon, m, late)
    _outlives(daemon, a, "a later fetch failed")
    del a
    wait_for(lambda: m._live == 0 and not m._sock_open, "the last array's UNPIN, then the connection's end")


def test_closing_the_mapper_leaves_the_arrays_it_handed_out_their_memory(daemon: Daemon) -> None:
    """close() hung up at once, and the daemon gave the memory of every array still held to the next jobs;
    ``Client`` closes its mapper that way when zero-copy turns out not to work (zero_copy=None)."""
    job = run_job(daemon, seed=35)
    m = OutputMapper(str(daemon.socket))
    a = m.array(job, 0)
    m.close()
    with pytest.raises(ZeroCopyUnavailable, match="closed"):
        m.array(job, 0)
    _outlives(daemon, a, "its mapper was closed")
    del a
    wait_for(lambda: m._live == 0 and not m._sock_open, "the last array's UNPIN, then the connection's end")


def test_a_lease_received_but_not_yet_mapped_is_kept_through_another_threads_failed_fetch(daemon: Daemon) -> None:
    """Two threads share a mapper: one has its LEASE and is about to map it when the other's fetch fails and hangs
    up. The lease counted only once mapped, the hang-up saw none live and ended the connection, and the first
    thread's array lay over memory the daemon had taken back. The two steps of the first thread are run here
    around the second's failure, in the order the race takes."""
    from diffusiond.ipc.messages import Fetch

    held, late = run_job(daemon, seed=36), run_job(daemon, seed=37)
    m = OutputMapper(str(daemon.socket), timeout=1.0)
    lease, fd = m._lease(Fetch(held, 0))
    _fetch_while_stopped(daemon, m, late)
    a = m._map(lease, fd)
    _outlives(daemon, a, "another thread's fetch failed between its lease and its mapping")
    del a
    wait_for(lambda: m._live == 0 and not m._sock_open, "the last array's UNPIN, then the connection's end")
