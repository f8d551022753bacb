"""The examples in examples/ run as a user runs them: a subprocess against a real daemon on ``tiny`` (and
``tiny-flux``, the flow-matching model the GRPO example trains on)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonkit import Daemon, shared_daemon

import diffusiond
from conftest import ROOT

ENV = {"OMP_NUM_THREADS": "1"}  # see test_daemon_lifecycle.py


@pytest.fixture(scope="module")
def example_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("examples"), ["--model", "tiny", "--model", "tiny-flux"],
                       model_cache, ENV) as d:
        yield d


def test_train_loop_streams_batches_and_gives_the_memory_back(example_daemon: Daemon) -> None:
    sock = str(example_daemon.socket)
    args = ["--socket", sock, "--batches", "3", "--batch", "2", "--size", "64x64", "--steps", "2", "--in-flight", "2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_loop.py"), *args],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{example_daemon.log()}"
    steps = re.findall(r"^step (\d+)  loss \S+  images \(2, 3, 64, 64\)", done.stdout, re.M)
    assert steps == ["1", "2", "3"], done.stdout
    assert re.search(r"^3 steps in \S+ s: \S+ steps/s", done.stdout, re.M), done.stdout

    # Every output was taken (zero-copy lease or HTTP stream) and the example has exited, so no
    # slot may stay held: a lease ends at UNPIN or when the dead client's connection closes.
    with diffusiond.Client(sock, timeout=10) as client:
        deadline = time.monotonic() + 15
        while (health := client.health())["arena_bytes_in_use"] != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health["arena_bytes_in_use"] == 0, health
        assert health["jobs"].get("succeeded") == 3, health


@pytest.mark.parametrize("model", ["tiny-flux", "tiny"])  # flow-sde (the default), and ddim with eta
def test_grpo_rollout_trains_a_lora_the_daemon_samples_with_and_agrees_on_log_probs(example_daemon: Daemon,
                                                                                    model: str) -> None:
    args = ["--socket", str(example_daemon.socket), "--iterations", "2", "--group", "2", "--steps", "3",
            "--adapter", f"policy-{model}"]
    if model != "tiny-flux":
        args += ["--model", model]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_rollout.py"), *args],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{example_daemon.log()}"
    assert f"on {model}:" in done.stdout, done.stdout
    line = r"^iteration (\d+)  reward (\S+)  max \|ratio-1\| (\S+)  loss \S+  ran with (\S+)  version (\d+)"
    its = re.findall(line, done.stdout, re.M)
    assert [i for i, *_ in its] == ["1", "2"], done.stdout
    # on-policy: the daemon sampled with the adapter the trainer holds, so the ratio is 1 up to float noise
    assert all(float(dev) < 1e-3 for _, _, dev, _, _ in its), done.stdout
    versions = [(ran, int(v)) for *_, ran, v in its]
    # each iteration's rollouts ran with the version the previous one pushed, and each pushed a new one
    assert versions == [("1", 2), ("2", 3)], done.stdout
