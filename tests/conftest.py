"""Shared fixtures. Everything here runs real processes and real sockets; nothing is mocked."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def shm_entries() -> set[str]:
    """Names in /dev/shm: memfd-backed memory must never appear here."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def memfd_maps(pid: int | str = "self") -> list[str]:
    """memfd mappings of a process, from /proc/PID/maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line for line in f if "memfd:" in line]
    except FileNotFoundError:
        return []


# `make test` spreads the suite over processes (pytest-xdist, `--dist loadfile`: each file stays on one, so its
# module-scoped daemons start once). These files watch or start what the whole machine shares (names in /dev/shm, a
# Ray cluster, Chromium), so each holds a lock that all the processes share while it runs: they never run beside
# each other. (xdist's own groups, `--dist loadgroup`, silently group nothing with pytest 9.2: xdist issue 1386.)
MACHINE_WIDE = {"test_daemon_lifecycle.py", "test_faults.py", "test_hardening_shutdown.py", "test_ipc_arena.py",
                "test_ipc_channel.py", "test_worker.py", "test_ray.py", "test_ray_adopt.py", "test_web_page.py",
                "test_ray_deploy.py"}


@pytest.fixture(scope="module", autouse=True)
def machine_wide(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Autouse, so it is set up before the module's own fixtures (its cluster, its browser) and torn down after."""
    if request.path.name not in MACHINE_WIDE:
        yield
        return
    # the run's folder: every xdist process's basetemp (popen-gwN) lies in it; without xdist it is the user's
    with open(tmp_path_factory.getbasetemp().parent / "machine-wide.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C is Python's in every test process from its start: a run started in the background of a shell without
    job control (``make test > log &``) inherits SIGINT ignored, as POSIX has such a shell do, and Python keeps an
    inherited SIG_IGN; the tests that interrupt themselves (test_client_api's Ctrl-C) then wait out their deadline.
    Only an ignored SIGINT is taken back: a handler installed on purpose is left alone."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def sigint_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Ctrl-C stays Python's in every test process: a test that left SIGINT ignored or taken (a handler a library
    installs and does not give back) would make a later test's KeyboardInterrupt never come, and that test run to
    its job's deadline. Put back, and named. (A process that started with it ignored is ``pytest_configure``'s.)"""
    yield
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler and \
            threading.current_thread() is threading.main_thread():
        changed = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"SIGINT's handler was {changed!r} after {request.node.nodeid} (or the teardown of the module "
                      "this process ran before it); put back", stacklevel=1)


@pytest.fixture(scope="session", autouse=True)
def state_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Daemons that tests start without a --state-dir keep their jobs here, never in the
    user's real ~/.local/state (tests/daemonkit.py gives each daemon its own)."""
    path = tmp_path_factory.mktemp("state-home")
    os.environ["XDG_STATE_HOME"] = str(path)
    os.environ.pop("STATE_DIRECTORY", None)
    return path


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the embedded models for the whole run (tiny is built once)."""
    path = Path(os.environ.get("DIFFUSIOND_TEST_CACHE") or tmp_path_factory.mktemp("model-cache"))
    os.environ["DIFFUSIOND_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def controlnet_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """A ControlNet for tiny built in code, once per session (controlkit.py): a diffusers folder."""
    from controlkit import build_controlnet

    return build_controlnet(tmp_path_factory.mktemp("controlnets") / "edges", seed=1)


@pytest.fixture(scope="session")
def ip_adapter_file(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """An IP-Adapter for tiny built in code, once per session (ipadapterkit.py): its weights file,
    with ``image_encoder/`` beside it."""
    from ipadapterkit import build_ip_adapter

    return build_ip_adapter(tmp_path_factory.mktemp("ip-adapters") / "style", seed=1)


@pytest.fixture(scope="session")
def fuzz_adapters(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> dict[str, Path]:
    """What the fuzz daemons (fuzzhttpkit.py) serve beside ``edges`` and ``style``, built in code once per
    session: a second ControlNet for tiny (``blobs``), tiny-flux's ControlNet and union ControlNet (3 modes),
    a second SD IP-Adapter with an encoder of its own width (``style2``) and tiny-flux's IP-Adapter."""
    from controlkit import build_controlnet, build_flux_controlnet
    from ipadapterkit import build_flux_ip_adapter, build_ip_adapter

    root = tmp_path_factory.mktemp("fuzz-adapters")
    return {"blobs": build_controlnet(root / "blobs", seed=2),
            "flux-lines": build_flux_controlnet(root / "flux-lines", seed=5),
            "flux-union": build_flux_controlnet(root / "flux-union", seed=8, num_mode=3),
            "style2": build_ip_adapter(root / "style2", seed=2, projection_dim=24),
            "flux-style": build_flux_ip_adapter(root / "flux-style", seed=3)}


@pytest.fixture(scope="session")
def upscaler_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ESRGAN upscaler (scale 2, random weights) built in code, once per session (upscalekit.py)."""
    from upscalekit import build_upscaler, require_spandrel

    require_spandrel()

    return build_upscaler(tmp_path_factory.mktemp("upscalers") / "esr.safetensors", seed=1)


@pytest.fixture(scope="session")
def lora_files(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> dict[str, Path]:
    """LoRA adapters built in code on tiny, once per session (see lorakit.py): ``ink`` (UNet and
    text encoder), ``dots`` (UNet only), ``ink-kohya`` (ink in the kohya layout), ``misfit`` (ink
    with one matrix of a shape tiny lacks), and two files that are no LoRA at all."""
    import torch
    from lorakit import build_lora, to_kohya
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("loras")
    ink = build_lora(root / "ink", seed=1)
    dots = build_lora(root / "dots", seed=2, text_encoder=False)
    kohya = to_kohya(ink, root / "ink-kohya.safetensors")
    weights = load_file(str(ink / "pytorch_lora_weights.safetensors"))
    key = next(k for k in sorted(weights) if k.startswith("unet.") and ".lora_A." in k)
    weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] + 8)  # in-features tiny lacks
    (root / "misfit").mkdir()
    save_file(weights, str(root / "misfit" / "pytorch_lora_weights.safetensors"))
    save_file({"encoder.weight": torch.zeros(4, 4)}, str(root / "not-a-lora.safetensors"))
    (root / "text.safetensors").write_text("hello")
    return {"ink": ink, "dots": dots, "ink-kohya": kohya, "misfit": root / "misfit",
            "not-a-lora": root / "not-a-lora.safetensors", "text": root / "text.safetensors"}


@pytest.fixture(scope="module")
def live_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
                lora_files: dict[str, Path]) -> Iterator[Any]:
    """A daemon on tiny for a module of live-update tests (test_lora_live, test_update_parts): one worker, and
    the file LoRA ``dots`` to compare a trainer's copy of it against."""
    from daemonkit import shared_daemon

    args = ["--model", "tiny", "--workers", "1", "--max-loras", "3", "--job-timeout", "300",
            "--lora", f"dots={lora_files['dots']}"]
    with shared_daemon(tmp_path_factory.mktemp("live-updates"), args, model_cache) as d:
        yield d


@pytest.fixture(scope="module")
def dots_state(lora_files: dict[str, Path]) -> dict[str, Any]:
    """The ``dots`` adapter's tensors as a trainer holds them (torch tensors, PEFT naming)."""
    from safetensors.torch import load_file

    return load_file(str(lora_files["dots"] / "pytorch_lora_weights.safetensors"))


def pytest_asyncio_loop_factories(config, item):  # type: ignore[no-untyped-def]
    """The daemon runs on uvloop; so do the async tests."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def daemon_factory(tmp_path: Path, model_cache: Path):  # type: ignore[no-untyped-def]
    """Start real daemons: ``daemon_factory("--model", "tiny", ...)``; all stopped at teardown."""
    from daemonkit import Daemon

    started: list[Daemon] = []

    def make(*args: str, env: dict[str, str] | None = None, start: bool = True,
             socket_dir: Path | None = None) -> Daemon:
        n = len(started)
        d = Daemon((socket_dir or tmp_path) / f"d{n}.sock", list(args), tmp_path / f"d{n}.log",
                   env={"DIFFUSIOND_CACHE": str(model_cache), **(env or {})})
        started.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory):  # type: ignore[no-untyped-def]
    """A daemon on tiny with two CPU workers, batching up to 4."""
    return daemon_factory("--model", "tiny", "--workers", "2", "--max-batch", "4", "--job-timeout", "120")
