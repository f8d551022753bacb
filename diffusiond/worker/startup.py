"""A worker's start before its model: the imports it needs and the log line that says where the time went.

Apart from ``process`` so that the template (``template.py``, issue 27) runs the same imports before it forks
workers, and a forked worker's start line tells its own story (no interpreter, no imports of its own).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from diffusiond.pipelines.phases import Phases

log = logging.getLogger("diffusiond.worker")

_MAIN_AGE: float | None = None  # the age at ``main``: the interpreter and this module's imports (torch) were done
_FORKED = False  # forked from the template (``template.py``): the imports were done there, before the fork


def at_main() -> None:
    """Called first thing in the worker's ``main``: what came before it was the interpreter and the imports."""
    global _MAIN_AGE
    _MAIN_AGE = _age_s()


def forked() -> None:
    """Called by the template in a child it forked, before the worker's ``main``: its process started at the fork."""
    global _FORKED
    _FORKED = True


def _age_s() -> float | None:
    """This process's age (Linux: its start in clock ticks after boot), None where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartPhases(Phases):
    """The worker's start: the process's own start first (the interpreter and its imports, torch's CUDA libraries
    among them, then the wait for INIT), then each step of ``_start``; a diffusers model's load is broken down in
    brackets (``load_phases``). A cold start's seconds must be named to be cut (issue 27's cold start)."""

    def __init__(self) -> None:
        super().__init__()
        age = _age_s()
        if age is not None and _FORKED:  # the child's start time is the fork's
            import torch  # imported by the template; its threads are the OMP_NUM_THREADS the engine gave this worker

            self.parts.append(f"forked from the template (imports done there, {torch.get_num_threads()} math "
                              f"threads), fork to INIT {age * 1000:.0f} ms")
        elif age is not None and _MAIN_AGE is not None:
            waited = (age - _MAIN_AGE) * 1000
            self.parts.append(f"interpreter and imports (torch) {_MAIN_AGE * 1000:.0f} ms, "
                              f"diffusers' utilities and INIT {waited:.0f} ms")
        elif age is not None:
            self.parts.append(f"spawn to init {age * 1000:.0f} ms")

    def model(self, load: Phases | None) -> None:
        """The model's phase, its load's own spans in brackets, with what ran before the first of them and after
        the last named too: on an H200, 6.5 s of SD 1.5's 7.9 s compiled load was in none (issue 31). On a CPU
        host those seconds were imports: diffusers' pipeline modules, by the load's progress hook, before the
        first span (~0.5 s), and torch's compiler, by ``torch.compile``, after the last (~1 s); both are done
        before the load now (``import_libraries``, ``import_compiler``), in the template where there is one."""
        if load is None or not load.parts:
            self.mark("model")
            return
        # a loader that names its file reading (a folder's, the models built in code) leaves the spec and the
        # cache lookup before it; the others (a hub id, a single file, a GGUF) read their files there too
        lead = "spec and cache lookup" if any(p.startswith("files ") for p in load.parts) else "spec and files"
        parts = [f"{lead} {(load.t0 - self.last) * 1000:.0f} ms", *load.parts]
        rest = (time.perf_counter() - load.last) * 1000
        if rest >= 1:  # so the brackets add up to the phase whatever comes to run there unnamed
            parts.append(f"other {rest:.0f} ms")
        self.mark(f"model ({', '.join(parts)})")

    def report(self, model: str) -> None:
        """The headline is the whole start, the process's own included, which the parts list first: the time
        since INIT alone read smaller than the parts it headed."""
        self.mark("warm-up")
        age = _age_s()
        since = "its fork" if _FORKED else "its spawn"
        whole = f"{age * 1000:.0f} ms after {since} ({self.total_ms():.0f} ms after INIT)" if age is not None \
            else f"{self.total_ms():.0f} ms after INIT"
        log.info("%s ready in %s: %s", model, whole, self)


def quiet_libraries() -> None:
    """Progress bars and deprecation chatter from the model libraries would flood the daemon's
    log (the journal, under systemd) at every worker start; keep them for --log-level debug."""
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    except ImportError:
        pass


def import_libraries() -> None:
    """diffusers' and transformers' model modules, imported as a phase of their own: on a GPU host they were most of
    a cold start's unnamed seconds (with torchao installed, diffusers imports it too). Any load needs them, and
    diffusers' pipeline modules (``from_pretrained``'s, which import every model class diffusers has, and peft):
    the load's progress hook imported them inside the model's phase, unnamed (~0.5 s on a CPU host; issue 31), in
    every forked worker instead of once in the template."""
    import diffusers.models.modeling_utils
    import diffusers.pipelines.pipeline_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401


def import_compiler() -> None:
    """What ``torch.compile``'s first call imports (inductor's ``compile_fx``: ~1 s on a CPU host, more with
    triton on a GPU one), for a worker that compiles its model: a phase of its own rather than unnamed seconds
    inside the model's (issue 31), and done once in the template when the daemon compiles any model."""
    import torch._inductor.compile_fx  # noqa: F401


def bind_thread(device: Any) -> None:
    """Make ``device`` (a ``torch.device``) this thread's current CUDA device. torch keeps the current device per
    thread, and the worker's main thread sets it; without this, a ``cuda:1`` worker's compute and copy threads
    recorded their events on cuda:0's stream, where the work they were to wait for does not run, and made a
    context on cuda:0."""
    import torch

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)


def device_executor(device: Any) -> Any:
    """The worker loop's default executor (``asyncio.to_thread``): threads bound to ``device`` when they start.
    The model's load, its adapters', ControlNets' and upscalers' run there, and a ``cuda:1`` worker's load
    otherwise made a context on cuda:0 and put what diffusers allocates on the current device there. A thread
    that cannot bind fails each call it is given, saying why (a failing initializer breaks the pool with no cause
    but "an initializer failed")."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    failed = threading.local()

    def bind() -> None:
        try:
            bind_thread(device)
        except Exception as exc:
            failed.error = exc

    def checked(fn: Any, *args: Any, **kwargs: Any) -> Any:
        error = getattr(failed, "error", None)
        if error is not None:
            raise RuntimeError(f"a load thread could not use {device}: {type(error).__name__}: {error}") from error
        return fn(*args, **kwargs)

    class Bound(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            return super().submit(checked, fn, *args, **kwargs)

    return Bound(thread_name_prefix="diffusiond-load", initializer=bind)
