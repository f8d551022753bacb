"""Workers forked from the pre-imported template (issue 27's cold start), on a real daemon with the tiny model.

One daemon for the module (a second model on disk, so each CPU worker's share of the cores is not all of
them), its first worker's copies slowed (a test fault, first workers only) so a job can be
caught mid-copy; the tests run in order: a forked worker serves, one killed mid-job is replaced by a fork, and
with the template killed, workers start as fresh interpreters and jobs go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from daemonkit import Daemon, gone, http, in_stage, shared_daemon, wait_job

from diffusiond.cli import main
from diffusiond.daemon.config import ConfigError, build_config
from diffusiond.daemon.workers.template import enabled
from diffusiond.ipc.template import Exited, Fork, Forked, Status, decode_reply, decode_request, encode

FAST = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("template"),
                       ["--model", "tiny", "--model", "b=tiny", "--preload", "tiny", "--preimport", "on",
                        "--no-persist", "--test-fault", "copy_delay_ms=2000"],
                       model_cache) as d:
        yield d


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


async def _worker(s: Any, other_than: int = 0) -> dict[str, Any]:
    """The ready worker, once it is not ``other_than`` (a replacement after a kill)."""
    while True:
        async with s.get("/health") as r:
            (w,) = (await r.json())["workers"]
        if w["pid"] != other_than and w["state"] == "ready":
            return w  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)


async def _submit(s: Any) -> str:
    async with s.post("/v1/jobs", json=FAST) as r:
        assert r.status == 202, await r.text()
        return (await r.json())["id"]  # type: ignore[no-any-return]


async def test_a_job_runs_on_a_worker_forked_from_the_template(daemon: Daemon) -> None:
    template = daemon.template_pid()
    assert template is not None
    async with http(daemon.socket) as s:
        job = await wait_job(s, await _submit(s), timeout=60)
        assert job["status"] == "succeeded", job
        pid = (await _worker(s))["pid"]
    assert _parent(pid) == template and daemon.worker_pids() == [pid]
    with open(f"/proc/{pid}/comm") as f:  # top and ps tell it from the template, whose command line it shows
        assert f.read().strip() == "diffusiond-wkr"
    if not any(os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")):
        with open(f"/proc/{template}/status") as f:  # numpy's OpenBLAS started no pool of every core
            assert "\nThreads:\t1\n" in f.read()
    log = daemon.log()
    assert f"(pid {pid}, cpu) forked from the worker template" in log
    assert "--device auto (the default): cpu (no NVIDIA GPU on this machine)" in log or \
        os.path.isdir("/proc/driver/nvidia/gpus")  # the start says what the default chose, and why
    # the env override the pool gives a CPU worker (its share of the cores: two models on cpu, b on disk) reached
    # the forked worker's torch, which had read its threads at import, in the template
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    assert re.search(rf"worker\[{pid}\] .* ready in \d+ ms after its fork \(\d+ ms after INIT\): "
                     rf"forked from the template \(imports done there, {threads} math threads\), "
                     r"fork to INIT \d+ ms", log), log


async def test_a_forked_worker_killed_mid_job_fails_it_and_a_new_fork_replaces_it(daemon: Daemon) -> None:
    async with http(daemon.socket) as s:
        pid = (await _worker(s))["pid"]
        job_id = await _submit(s)
        await in_stage(s, job_id, "copying")
        os.kill(pid, signal.SIGKILL)
        job = await wait_job(s, job_id, timeout=60)
        assert job["status"] == "failed", job
        assert f"(pid {pid}, cpu) was killed by signal SIGKILL" in job["error"]["message"], job
        new = (await asyncio.wait_for(_worker(s, other_than=pid), 60))["pid"]
        assert _parent(new) == daemon.template_pid()
        assert (await wait_job(s, await _submit(s), timeout=60))["status"] == "succeeded"


async def test_with_the_template_killed_workers_start_fresh_and_jobs_go_on(daemon: Daemon) -> None:
    template = daemon.template_pid()
    assert template is not None and daemon.proc is not None
    async with http(daemon.socket) as s:
        pid = (await _worker(s))["pid"]
        os.kill(template, signal.SIGKILL)
        while "stopped forking workers: it was killed by signal SIGKILL" not in daemon.log():
            await asyncio.sleep(0.05)
        assert gone(template)  # reaped by the engine
        # its orphaned worker still serves; when it dies its end is seen, its status lost with the template
        assert (await wait_job(s, await _submit(s), timeout=60))["status"] == "succeeded"
        os.kill(pid, signal.SIGKILL)
        new = (await asyncio.wait_for(_worker(s, other_than=pid), 60))["pid"]
        assert _parent(new) == daemon.proc.pid  # a fresh interpreter, spawned by the engine itself
        assert (await wait_job(s, await _submit(s), timeout=60))["status"] == "succeeded"
    # the whole sentence (it read "... (the worker template it was forked from it died)")
    assert re.search(rf"worker \d+ \(pid {pid}, cpu\) ended; its exit status is unknown \(its worker template "
                     r"stopped: it was killed by signal SIGKILL\)", daemon.log()), daemon.log()[-3000:]


# the messages and the flag ----------------------------------------------------------------------------------
def test_messages_round_trip_and_refuse_what_is_not_theirs() -> None:
    fork = Fork(3, {"OMP_NUM_THREADS": "2"}, "DEBUG")
    assert decode_request(encode(fork)) == fork
    for reply in (Forked(3, pid=42), Forked(4, error="fork: no memory"), Exited(42, -9), Status(False, "why", 7)):
        assert decode_reply(encode(reply)) == reply
    with pytest.raises(msgspec.ValidationError):
        decode_request(encode(Exited(1, 0)))  # a reply is not a request
    with pytest.raises(msgspec.ValidationError):
        decode_reply(encode(fork))


def test_preimport_refuses_values_it_does_not_know(capsys: Any) -> None:
    with pytest.raises(ConfigError, match=r"preimport 'maybe' is not one of auto, on, off"):
        build_config({"preimport": "maybe"}, {})
    assert build_config({"preimport": "off"}, {}).preimport == "off"
    assert build_config({}, {}).preimport == "auto"
    # auto forks the device kinds a forked worker has run on (CPU, CUDA); on forks every worker, off none
    assert [enabled(p, d) for p in ("auto", "on", "off") for d in ("cpu", "cuda:0", "cuda", "xpu:0")] == [
        True, True, True, False, True, True, True, True, False, False, False, False]
    assert main(["serve", "--preimport", "maybe"]) == 2
    assert "argument --preimport: invalid choice: 'maybe'" in capsys.readouterr().err


# the imports' device queries ---------------------------------------------------------------------------------

def test_device_queries_answered_from_nvml_during_the_imports_are_put_back_even_when_they_fail(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The template answers torchao's import-time queries from NVML (issue 27); a forked worker must then read the
    device's real properties, whether the imports succeeded or raised."""
    import torch
    from torch._dynamo import device_interface

    from diffusiond.worker import template

    monkeypatch.setattr(template, "_nvml_capabilities", lambda: [(8, 0), (9, 0)])
    real = torch.cuda.get_device_capability
    for fails in (False, True):
        with contextlib.suppress(RuntimeError), template._device_queries_from_nvml():
            assert torch.cuda.get_device_capability() == (8, 0), "the weakest device answers for all"
            assert [p.major for p in device_interface.caching_worker_device_properties["cuda"]] == [8, 9]
            assert device_interface.caching_worker_current_devices["cuda"] == 0
            if fails:
                raise RuntimeError("an import failed")
        assert torch.cuda.get_device_capability is real
        assert "cuda" not in device_interface.caching_worker_device_properties
        assert "cuda" not in device_interface.caching_worker_current_devices


def test_a_compiling_daemons_template_imports_torchs_compiler_and_the_start_line_names_it(
        tmp_path: Path, model_cache: Path) -> None:
    """torch.compile's first call imported inductor inside the model's phase, unnamed, in every worker (issue 31:
    most of 6.5 s no span named in an H200's SD 1.5 load): the template imports it once, and each worker's start
    line names that import, the compile wrapper's set-up and what ran before the load's first span."""
    with shared_daemon(tmp_path, ["--model", "tiny", "--preload", "tiny", "--preimport", "on", "--no-persist",
                                  "--compile", "default"], model_cache) as d:
        async def ready() -> int:
            async with http(d.socket) as s:
                return (await asyncio.wait_for(_worker(s), 120))["pid"]  # type: ignore[no-any-return]

        pid = asyncio.run(ready())
        log = d.log()
    assert "torch's compiler imported); workers are forked from here" in log, log
    assert re.search(rf"worker\[{pid}\] .* ready in .*: forked from the template .*, imports \(torch's compiler\) "
                     r"\d+ ms, model \(spec and cache lookup \d+ ms, import \d+ ms, files \d+ ms, .*, "
                     r"compile set-up \d+ ms(, other \d+ ms)?\) \d+ ms, ", log), log
