"""The device budget's default and forms (issue 27 #8), and sizes from the files before the first load (#7).

``--device-memory`` unset means the device's free memory at start less ``--reserve-memory``; ``0.8`` is that share
of its total; both read through the same path on the CPU (``/proc/meminfo``) as NVML gives on a GPU. A folder
model is placed in the budget from its safetensors headers at start, so one larger than the budget is refused
at admission with the numbers, without being loaded to learn its size.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonkit import Daemon, http, shared_daemon

from diffusiond.daemon.config import NO_BUDGET, ConfigError, build_config
from diffusiond.daemon.residency.budget import ACCELERATOR_RESERVE, resolve
from diffusiond.daemon.residency.sizes import model_weights
from diffusiond.daemon.residency.units import format_bytes

G = 1 << 30


def _meminfo(key: str) -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def test_a_share_is_of_the_devices_total_and_the_default_its_free_memory_less_the_reserve() -> None:
    def gpu(device: str) -> tuple[int, int]:
        return 80 * G, 70 * G

    assert resolve("0.5", None, "cuda:0", gpu).nbytes == 40 * G
    assert resolve(None, None, "cuda:0", gpu).nbytes == 70 * G - ACCELERATOR_RESERVE
    assert resolve(None, "4GiB", "cuda:0", gpu).nbytes == 66 * G
    assert resolve(None, None, "cpu", gpu).nbytes == 70 * G  # MemAvailable leaves the kernel its share already
    assert resolve("20GiB", None, "cuda:0", lambda d: "unused").nbytes == 20 * G
    unread = resolve(None, None, "cuda:0", lambda d: "NVML is missing")
    assert unread.nbytes == NO_BUDGET and "NVML is missing" in unread.source
    with pytest.raises(ValueError, match=r"--device-memory '0\.8' is a share of cuda:0's total memory, which "
                                         r"cannot be read: NVML is missing; give a size"):
        resolve("0.8", None, "cuda:0", lambda d: "NVML is missing")


def test_serve_takes_a_share_and_defaults_to_the_cpus_available_memory() -> None:
    config = build_config({}, {"device_memory": "0.5"})  # refused as "not supported yet" before
    assert config.budget_of("cpu").nbytes == _meminfo("MemTotal") // 2
    default = build_config({}, {}).budget_of("cpu")
    assert 0 < default.nbytes <= _meminfo("MemTotal") and "free on cpu at start" in default.source
    with pytest.raises(ConfigError, match=r"host_memory '0\.5': a share is for --device-memory only"):
        build_config({}, {"host_memory": "0.5"})


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    from diffusiond.pipelines.tiny import ensure_tiny

    folder = tmp_path_factory.mktemp("big") / "big"
    shutil.copytree(ensure_tiny(), folder)
    return folder


@pytest.fixture(scope="module")
def small_budget(big: Path, tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    """A budget of 4 MiB for a 6.4 MiB model that is not preloaded: nothing is ever loaded."""
    args = ["--model", f"big={big}", "--device-memory", "4MiB", "--preload", "none", "--no-persist"]
    with shared_daemon(tmp_path_factory.mktemp("budget"), args, model_cache) as d:
        yield d


def test_a_never_seen_folder_larger_than_the_budget_is_refused_at_admission_without_a_load(
        small_budget: Daemon, big: Path) -> None:
    weights = format_bytes(model_weights(big, "float32").bytes_at("float32"))

    async def go() -> None:
        async with http(small_budget.socket) as s:
            async with s.post("/v1/jobs", json={"prompt": "x", "model": "big", "width": 64, "height": 64,
                                                "steps": 1}) as r:
                body = await r.json()
                assert r.status == 400, body
                err = body["error"]
                assert err["code"] == "model_too_large" and err["field"] == "model", err
                assert weights in err["message"] and "4.00 MiB" in err["message"], err["message"]
                assert f"diffusiond fit {big} --device cpu --device-memory SIZE" in err["message"], err["message"]
            async with s.post("/v1/models/big/load") as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["code"] == "model_too_large", body

    asyncio.run(go())
    log = small_budget.log()
    assert "budget on cpu: 4.00 MiB (--device-memory 4MiB)" in log, log
    assert "for the first time" not in log and "loading big" not in log, log


def test_auto_is_the_default_offload_on_a_gpu_with_a_budget(big: Path) -> None:
    from diffusiond.daemon.model_config import ModelConfig, resolve_offload

    gpu = ModelConfig(name="m", spec=str(big), devices=("cuda:0",))
    needs = 2 * model_weights(big, "float32").bytes_at("float32")
    tight = resolve_offload(gpu, 100 * 1024)  # not even resident weights fit: the fastest offload that does, or none
    assert tight.options["offload"] != "none", tight
    assert tight.offload_reason.startswith("offload=auto (the default under a --device-memory budget) chose ")
    roomy = resolve_offload(gpu, needs + 8 * G)
    assert roomy.options["offload"] == "none" and "at float32: needs" in roomy.offload_reason, roomy
    for kept in (resolve_offload(gpu, None), resolve_offload(ModelConfig(name="m", spec=str(big)), 1024),
                 resolve_offload(ModelConfig(name="m", spec=str(big), devices=("cuda:0",), compile="default"), 1024),
                 resolve_offload(ModelConfig(name="m", spec=str(big), devices=("cuda:0",),
                                             options={"offload": "none"}), 1024)):
        assert kept.options.get("offload", "none") == "none" and not kept.nothing_fits, kept


def test_auto_plans_a_model_on_two_gpus_against_the_smaller_of_their_budgets(
        big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27: each device's default budget is its own, and each worker must fit; auto read cuda:0's only."""
    import diffusiond.daemon.config as config_module
    from diffusiond.daemon.residency.budget import Budget

    room = {"cuda:0": 64 * G, "cuda:1": 100 * 1024}  # cuda:1 has almost nothing free
    monkeypatch.setattr(config_module, "resolve_budget",
                        lambda size, reserve, device, *a: Budget(room[device], f"{device}'s free memory"))
    config = build_config({}, {"model": [f"m={big}"], "device": "cuda:0,cuda:1"})
    assert [config.budget_of(d).nbytes for d in ("cuda:0", "cuda:1")] == [64 * G, 100 * 1024]
    assert config.models[0].options["offload"] != "none", config.models[0]
