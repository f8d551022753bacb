"""The pre-imported template the engine's workers are forked from (issue 27's cold start).

A fresh worker spends seconds in imports before it reads its model (torch with its CUDA libraries, diffusers'
utilities, diffusers' and transformers' model modules: ~13 s on an H100 host). This process does them once, as
the daemon starts, then forks a worker for each FORK the engine sends (``ipc/template.py``): the child applies
the handle's env overrides, resets what the template changed about signals and logging, and runs the worker's
``main`` on the attached channel fd. gunicorn's ``preload_app`` and Android's zygote are the precedents.

A process that called cuInit cannot fork children that use CUDA, so nothing here may initialise it: torch is told to
answer ``torch.cuda.is_available()`` from NVML (``PYTORCH_NVML_BASED_CUDA_CHECK``), and the template checks after
its imports that CUDA is still uninitialised, and that they started no Python thread (a fork copies only the
caller; native ones, which ``threading`` does not see, are named in its log), before it says READY;
otherwise it says UNUSABLE with why and the engine spawns workers as before.

Two more things keep the forked workers as cheap as spawned ones. numpy's OpenBLAS sizes its thread pool when it
is loaded, here, before any worker's share of the cores is known: unless the user set a BLAS thread count, the
template loads it with one thread, so N forked CPU workers do not each run a pool of every core (a spawned
worker's is its share). And the imports' objects are frozen out of the garbage collector (``gc.freeze``, as
gunicorn and Instagram do): a collection in a child would otherwise write to every object's header and copy
the pages it shares with the template (~90 MB a worker measured with diffusers' and transformers' models).

It reaps its children and reports each exit (EXITED), and it dies with the engine: EOF on its socket, and the
parent-death signal.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator
from typing import NoReturn

import diffusiond.worker.startup as startup
from diffusiond.ipc.template import MAX_MESSAGE, Exited, Fork, Forked, Status, decode_request, encode

log = logging.getLogger("diffusiond.worker.template")

_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
_OPENBLAS = "OPENBLAS_NUM_THREADS"
_BLAS_SET = (_OPENBLAS, "GOTO_NUM_THREADS", "OMP_NUM_THREADS")  # what OpenBLAS reads at load, in this order
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
WORKER_NAME = b"diffusiond-wkr"  # a forked worker's name in top and ps -o comm (its cmdline stays the template's)


def _die_with_parent() -> None:
    """SIGKILL when the engine dies, however it dies (EOF on the socket covers the rest)."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the prctl
        os._exit(0)


def _imports(libraries: bool, quiet: bool, compiler: bool = False) -> None:
    """What a worker imports before it reads its model; raises with why the template cannot fork."""
    import torch

    import diffusiond.worker.process  # noqa: F401 - the worker's own modules

    if quiet:  # as the worker's main does for any model: diffusers' utilities (torch._dynamo with them)
        startup.quiet_libraries()
    if libraries:  # as its start does for a model that is not synthetic
        with _device_queries_from_nvml():
            startup.import_libraries()
            if compiler:  # a model compiles: torch.compile's own imports, else each worker's (issue 31)
                startup.import_compiler()
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised during the imports; a forked worker could not use it")
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        raise RuntimeError(f"the imports started threads ({names}); a fork copies only one")
    native = _native_threads()
    if native:  # a BLAS pool the user sized (OPENBLAS_NUM_THREADS): OpenBLAS stops it at fork and the child makes
        # its own; another library's would be the first thing to suspect if a forked worker hangs, so it is named
        log.info("the imports started %d native threads (%s); forked workers do not inherit them",
                 len(native), ", ".join(native))
    gc.collect()
    gc.freeze()  # the children share these objects' pages: their collections leave them alone


@contextlib.contextmanager
def _device_queries_from_nvml() -> Iterator[None]:
    """Libraries ask the device what it can do as they are imported, and ``torch.cuda`` answers only by
    initialising CUDA: torchao (imported with diffusers' quantizers) calls ``has_triton()``, which reads the
    device's properties, and ``torch.cuda.get_device_capability()`` to choose its kernels. On the H100 that made
    every template unusable (issue 27). For the imports, both are answered from NVML (no CUDA context): the cache
    of device properties torch keeps for its compile workers, and ``get_device_capability``; both are put back
    after, so a forked worker reads the device's real properties. With several devices the weakest answers for
    all (a library then leaves out kernels only the stronger ones run). Where NVML cannot say, nothing is changed,
    and the check after the imports says why the template cannot fork."""
    capabilities = _nvml_capabilities()
    if not capabilities:
        yield
        return
    import torch
    from torch._dynamo import device_interface

    props, current = device_interface.caching_worker_device_properties, device_interface.caching_worker_current_devices
    fill = "cuda" not in props and "cuda" not in current  # real properties already there are the better answer
    real, weakest = torch.cuda.get_device_capability, capabilities[0]
    try:
        if fill:  # has_triton() reads .major of the current device's properties from here
            props["cuda"], current["cuda"] = [types.SimpleNamespace(major=c[0], minor=c[1]) for c in capabilities], 0
        torch.cuda.get_device_capability = lambda device=None: weakest
        yield
    finally:
        torch.cuda.get_device_capability = real
        if fill:
            props.pop("cuda", None)
            current.pop("cuda", None)


def _nvml_capabilities() -> list[tuple[int, int]]:
    """The compute capability of every device NVML sees (through the driver's library, as torch's own NVML
    checks do: no CUDA context), weakest first; empty when NVML is not there."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return []
        try:
            count = ctypes.c_uint()
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return []
            found = []
            for i in range(count.value):
                handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
                if (nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0 or
                        nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
                    return []
                found.append((major.value, minor.value))
            return sorted(found)
        finally:
            nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return []


def _native_threads() -> list[str]:
    """The names of this process's threads but the calling one, native ones included (``threading`` sees only
    Python's), from /proc; empty where it cannot be read."""
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
        names = []
        for task in tasks:
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
                names.append(f"{f.read().strip()} ({task})")
        return names
    except (OSError, ValueError):
        return []


def _set_env() -> dict[str, str | None]:
    """The env the template imports under, which its children undo: the values it replaced (None: unset)."""
    before = {_NVML_CHECK: os.environ.get(_NVML_CHECK)}
    os.environ[_NVML_CHECK] = "1"
    if not any(os.environ.get(name) for name in _BLAS_SET):
        before[_OPENBLAS] = os.environ.get(_OPENBLAS)
        os.environ[_OPENBLAS] = "1"
    return before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffusiond-template", description="diffusiond worker template")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket to the engine")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--libraries", action="store_true", help="import diffusers and transformers too")
    parser.add_argument("--compiler", action="store_true", help="and torch's compiler (with --libraries)")
    args = parser.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine handles Ctrl-C for the process group
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s template[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=args.fd)
    env_before = _set_env()
    t0 = time.perf_counter()
    quiet = logging.getLogger().getEffectiveLevel() > logging.DEBUG
    try:
        _imports(args.libraries, quiet, args.compiler)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        # said here too, not only to the engine, which may be gone or not reading; the traceback
        # only at DEBUG, as the reason names what to do
        log.warning("cannot fork workers: %s; workers start as fresh interpreters", why,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        _send(sock, Status(False, why, os.getpid()))
        return 1
    if not _send(sock, Status(True, pid=os.getpid())):
        return 0  # the engine stopped during the imports
    log.info("ready in %.0f ms (torch%s imported); workers are forked from here", (time.perf_counter() - t0) * 1000,
             ", diffusers' utilities" * quiet + ", diffusers' and transformers' models" * args.libraries
             + ", torch's compiler" * (args.libraries and args.compiler))
    return _serve(sock, env_before)


def _serve(sock: socket.socket, env_before: dict[str, str | None]) -> int:
    """Forks and reaps until the engine is gone: EOF, or a send that fails (it closed its end as we reaped)."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD wakes the select through the pipe
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        data, fds = b"", list[int]()
        if sock.fileno() in readable:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
            if not data:
                return 0  # the engine is gone; the children notice on their own channels
        if not _reap(sock, children):
            return 0
        if data and not _serve_one(sock, data, fds, children, [sock.fileno(), wake_r, wake_w], env_before):
            return 0


def _serve_one(sock: socket.socket, data: bytes, fds: list[int], children: set[int], close: list[int],
               env_before: dict[str, str | None]) -> bool:
    """One FORK answered; False when the answer could not be sent (the engine is gone)."""
    try:
        msg = decode_request(data)
    except Exception as exc:
        log.error("unreadable request from the engine: %s", exc)
        for fd in fds:
            os.close(fd)
        return True
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return _send(sock, Forked(msg.seq, error=f"FORK came with {len(fds)} fds, not the worker's one"))
    try:
        pid = os.fork()
    except OSError as exc:
        return _send(sock, Forked(msg.seq, error=f"fork: {exc}"))
    else:
        if pid == 0:
            _child(msg, fds[0], close, env_before)
        children.add(pid)
        pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # no pidfds (kernel before 5.3): the engine kills by pid
            pidfd = os.pidfd_open(pid)  # before this process can reap the child, so it names that child (issue 27)
        try:
            return _send(sock, Forked(msg.seq, pid=pid), pidfd)
        finally:
            if pidfd is not None:
                os.close(pidfd)
    finally:
        os.close(fds[0])


def _send(sock: socket.socket, msg: Forked | Exited | Status, fd: int | None = None) -> bool:
    """False when the engine is gone (it closed its end while a child was ending): not an error at its stop."""
    try:
        socket.send_fds(sock, [encode(msg)], [] if fd is None else [fd])
    except OSError:
        return False
    return True


def _reap(sock: socket.socket, children: set[int]) -> bool:
    """Each ended child reported; False when the engine is gone."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return True
        if pid == 0:
            return True
        children.discard(pid)
        if not _send(sock, Exited(pid, os.waitstatus_to_exitcode(status))):
            return False
    return True


def _child(msg: Fork, fd: int, close: list[int], env_before: dict[str, str | None]) -> NoReturn:
    """The new worker: the template's state undone, then the worker's ``main`` as a spawned one runs it."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the worker's main sets its own
        for other in close:
            os.close(other)
        for name, value in env_before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.update(msg.env)  # read at CUDA init, which has not happened; OpenMP read its own at load:
        if "OMP_NUM_THREADS" in msg.env:
            import torch

            torch.set_num_threads(int(msg.env["OMP_NUM_THREADS"]))
        root = logging.getLogger()
        for handler in list(root.handlers):  # the worker's main configures its own (with its own pid)
            root.removeHandler(handler)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, WORKER_NAME, 0, 0, 0)
        startup.forked()
        from diffusiond.worker.process import main as worker_main

        code = worker_main(["--fd", str(fd), "--log-level", msg.log_level])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
