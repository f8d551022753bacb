"""``diffusiond serve``: wire the engine, the HTTP API, the sockets, signals and systemd together.

Order matters and is deliberate: the listening socket comes first (so /health and /ready answer
503 "starting" while models load), then the state dir (its lock, the jobs a crash left; only then is
"listening" logged, so a start refused there never reads as one that listened), then job
admission (jobs that come while models load wait in the queue), then the workers, then READY=1. SIGTERM, SIGINT
or SIGHUP (its terminal closed) stops admission (503), lets accepted jobs finish within the drain grace, stops the
workers, removes the socket and exits 0; a second signal skips the rest of the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

import diffusiond.daemon.workers.template as templates
from diffusiond import __version__
from diffusiond.daemon import systemd
from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.core.engine import Engine
from diffusiond.daemon.core.upscalers import UpscalerProbeError
from diffusiond.daemon.edge.api import WebAddress, create_app
from diffusiond.daemon.edge.handoff import OutputSocket
from diffusiond.daemon.edge.views import model_state
from diffusiond.daemon.edge.web import bind_tcp, create_web_app, sign_in_url
from diffusiond.daemon.edge.webauth import host_port
from diffusiond.daemon.state.statedir import StateDirError
from diffusiond.daemon.state.store import SqliteStore
from diffusiond.daemon.values import parse_host_port
from diffusiond.daemon.workers.link import WorkerStartError
from diffusiond.protocol import MIN_TOKEN_CHARS, output_socket_path

log = logging.getLogger("diffusiond")


class StartupError(Exception):
    pass


def bind_unix(path: str, mode: int, group: str | None) -> socket.socket:
    """Create the listening socket with its final mode from the first instant (umask), refusing to
    take over a socket another daemon is still serving. Bound under a temporary name and linked into
    place once it listens: a client that connects as soon as the path exists (a script polling for it)
    must not be refused in the instant between bind and listen."""
    p = Path(path)
    if not p.parent.exists():
        p.parent.mkdir(mode=0o700, parents=True)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise StartupError(f"{path} exists and is not a socket; remove it or choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            p.unlink()  # stale socket from a daemon that did not clean up
        else:
            raise StartupError(f"another daemon is already listening on {path}; stop it or choose another --socket")
        finally:
            probe.close()
    bound = _temporary_name(p)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(bound).st_mode):  # never another program's file of that name
            os.unlink(bound)  # a start of ours that was killed here, whose pid came round again
    old = os.umask(0o177)
    try:
        sock.bind(bound)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot create the socket {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    try:
        os.chmod(bound, mode)
        if group:
            try:
                os.chown(bound, -1, grp.getgrnam(group).gr_gid)
            except KeyError:
                raise StartupError(f"--socket-group {group!r} does not exist") from None
        sock.listen(512)
        try:
            os.link(bound, path)  # not a rename: a daemon that took the path meanwhile keeps it
        except FileExistsError:
            raise StartupError(f"another daemon is already listening on {path}; stop it or choose another "
                               "--socket") from None
        except OSError as exc:
            raise StartupError(f"cannot create the socket {path}: {exc.strerror or exc}") from None
    except BaseException:  # leave no socket file behind that nothing serves
        sock.close()
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bound)
    return sock


SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108 with the terminating NUL)


def _temporary_name(p: Path) -> str:
    """Where ``bind_unix`` binds before the socket listens: beside ``p`` (a link is within one filesystem),
    named after it and this process where that fits the path limit, else after the process alone (a path
    near the limit that fit once must still fit: 2026-12-06's fresh-clone run, ``make demo`` under pytest's
    long temporary directory)."""
    if len(os.fsencode(str(p))) > SUN_PATH_MAX:
        raise StartupError(f"the socket path {str(p)!r} is {len(os.fsencode(str(p)))} bytes; a Unix socket's path "
                           f"may have at most {SUN_PATH_MAX}: choose a shorter --socket")
    for name in (f".{p.name}.{os.getpid()}.tmp", f".{os.getpid():x}"):
        bound = str(p.with_name(name))
        if len(os.fsencode(bound)) <= SUN_PATH_MAX:
            return bound
    raise StartupError(f"the socket path {str(p)!r} is within a few bytes of the {SUN_PATH_MAX} a Unix socket's "
                       "path may have, too close to bind it first under a temporary name: choose a shorter --socket")


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise StartupError(f"cannot read --token-file {path}: {exc.strerror}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise StartupError(f"the token in {path} is shorter than {MIN_TOKEN_CHARS} characters; use a long random token")
    return token


async def run(config: DaemonConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        log.info("received %s%s", sig.name, "; stopping now" if signals > 1 else "; draining")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: its terminal closed; it killed the engine
        loop.add_signal_handler(sig, on_signal, sig)  # undrained, and left the socket file behind

    token = read_token(config.token_file) if config.token_file and (config.tcp or config.web) else None
    store = SqliteStore(config.state_path, reset=config.reset_state, faults=config.state_fault,
                        sync=config.state_sync) if config.persist else None
    engine = Engine(config, store=store)
    web_address = WebAddress()
    app = create_app(engine, token=token if config.tcp else None, web_address=web_address)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5,
                           auto_decompress=False)  # bodies.py decodes, within its limits
    web_runner: web.AppRunner | None = None
    created_socket: str | None = None
    watchdog_task: asyncio.Future[None] | None = None
    output_socket: OutputSocket | None = None
    code = 0
    # Everything started from here on is stopped in the ``finally`` below, whichever step fails.
    try:
        await runner.setup()
        try:  # before any socket: a daemon that cannot serve its upscalers does not start
            await engine.upscalers.probe()
        except UpscalerProbeError as exc:
            raise StartupError(str(exc)) from None
        inherited = systemd.listen_fds()
        unix_path: str | None = None
        if inherited:
            for s in inherited:
                await web.SockSite(runner, s).start()
                if s.family == socket.AF_UNIX and unix_path is None:
                    unix_path = str(s.getsockname()) or None
            where = f"{len(inherited)} socket(s) from systemd"
        else:
            sock = bind_unix(config.socket_path, config.socket_mode, config.socket_group)
            created_socket = unix_path = config.socket_path
            await web.SockSite(runner, sock).start()
            where = config.socket_path
        if unix_path is not None:
            output_socket = OutputSocket(engine, output_socket_path(unix_path))
            try:
                await output_socket.start()
            except OSError as exc:  # zero-copy is an extra: clients fall back to HTTP without it
                log.warning("no output socket at %s (%s): local clients will take outputs over HTTP",
                            output_socket.path, exc.strerror or exc)
                output_socket = None
        if config.tcp:
            host, port = parse_host_port(config.tcp, "--tcp")
            try:
                await web.TCPSite(runner, host or "127.0.0.1", port).start()
            except OSError as exc:
                raise StartupError(f"cannot listen on tcp {config.tcp}: {exc.strerror or exc}") from None
            where += f" and tcp {config.tcp} (bearer token required)"
        if config.web is not None:
            web_runner, bound = await _start_web(engine, config.web, token, web_address)
            where += f" and the web page on {bound}"
        systemd.notify("STATUS=starting")
        watchdog = systemd.watchdog_interval()
        watchdog_task = asyncio.ensure_future(systemd.watchdog_loop(watchdog)) if watchdog else None
        grace, unloaded = await _serve(engine, stop, where, socket_activated=bool(inherited))
        systemd.notify("STOPPING=1", "STATUS=draining")
        drain = asyncio.ensure_future(engine.drain(grace, unloaded=unloaded))
        second = asyncio.ensure_future(_second_signal(stop, lambda: signals))
        await asyncio.wait([drain, second], return_when=asyncio.FIRST_COMPLETED)
        second.cancel()
        if not drain.done():
            drain.cancel()
            await engine.drain(0)
    except WorkerStartError as exc:  # no model the start tried could load (or a --lora fits none)
        log.error("cannot start: %s; correct what this names (a model's folder or its --model options, a --lora) "
                  "or serve without it; --log-level debug logs the worker's traceback", exc)
        systemd.notify(f"STATUS=failed: {exc}")
        code = 1
    except (StartupError, StateDirError) as exc:
        log.error("cannot start: %s", exc)
        systemd.notify(f"STATUS=failed: {exc}")
        code = 1
    finally:
        if watchdog_task:
            watchdog_task.cancel()
        if output_socket is not None:
            await output_socket.close()
        await engine.stop()
        if web_runner is not None:
            await web_runner.cleanup()
        await runner.cleanup()
        if created_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(created_socket)
        log.info("stopped")
    return code


async def _serve(engine: Engine, stop: asyncio.Event, where: str, *,
                 socket_activated: bool) -> tuple[float, tuple[str, ...]]:
    """Admit jobs, say READY=1 (``/ready`` answers 200 from then: issue 27's "admitting", not "every model
    loaded"), then load what the start preloads while jobs come, and serve until asked to stop. Returns the
    drain's grace, and the models whose queued jobs it leaves at once: those a stop during the preload kept
    from loading (what waits for them would wait for nothing), while the jobs running on the models loaded
    already have the grace to finish. A start that fails raises (``WorkerStartError``), READY=1 or not."""
    opening = asyncio.ensure_future(engine.open(socket_activated=socket_activated))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([opening, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not opening.done():
            opening.cancel()
            return 0.0, ()
        opening.result()
        _announce(engine.config, where)
        loading = list(engine.keeper.preloading.models)
        systemd.notify("READY=1", f"STATUS=serving on {where}" + (f"; loading {', '.join(loading)}" if loading else ""))
        log.info("ready: admitting jobs%s", f" while the start loads {', '.join(loading)}" if loading else "")
        preload = asyncio.ensure_future(engine.preload())
        await asyncio.wait([preload, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not preload.done():
            unloaded = tuple(engine.keeper.preloading.models)
            preload.cancel()
            with contextlib.suppress(BaseException):
                await preload
            return engine.config.drain_grace_s, unloaded
        preload.result()
        if loading:
            systemd.notify(f"STATUS=serving on {where}; the start's preload is done")
            log.info("preload done: %s", ", ".join(f"{m.name} {model_state(engine, m)}" for m in engine.models()))
        await stop.wait()
        return engine.config.drain_grace_s, ()
    finally:
        stopper.cancel()


def _announce(config: DaemonConfig, where: str) -> None:
    """Logged once the state dir is locked and recovered (``engine.open``), not when the socket is bound: a start
    refused for a state dir in use must not read as "listening" first in the journal."""
    log.info("diffusiond %s listening on %s; models %s; %s", __version__, where,
             ", ".join(f"{m.name}={m.spec} on {','.join(m.devices)}" for m in config.models),
             f"jobs kept in {config.state_path}" if config.persist else "jobs kept in memory only (--no-persist)")
    for m in config.models:
        if m.offload_reason:
            log.info("model %s: %s", m.name, m.offload_reason)
        if m.max_batch is not None and m.max_batch != config.max_batch:
            log.info("model %s: batches of up to %d (its max_batch; the daemon's is %d)", m.name, m.max_batch,
                     config.max_batch)
        if (sizes := config.batch_sizes_of(m)) != tuple(range(1, config.max_batch_of(m) + 1)):
            log.info("model %s: batches of %s only (%s)", m.name, ", ".join(map(str, sizes)),
                     f"--batch-sizes {config.batch_sizes}" if m.batch_sizes is None
                     else f"its batch_sizes {m.batch_sizes}")


async def _start_web(engine: Engine, address: str, token: str | None,
                     web_address: WebAddress) -> tuple[web.AppRunner, str]:
    """The page and the API on TCP behind a token: ``--token-file``'s, else a random one, logged
    once inside the sign-in URL (``diffusiond web-url`` gives it again)."""
    host, port = parse_host_port(address, "--web")
    try:
        sock = bind_tcp(host, port)
    except OSError as exc:
        raise StartupError(f"cannot listen on --web {address}: {exc.strerror or exc}; "
                           "choose another port with --web HOST:PORT") from None
    token = token or secrets.token_urlsafe(32)
    runner = web.AppRunner(create_web_app(engine, token=token, listen_host=host), handler_cancellation=True,
                           access_log=None, shutdown_timeout=5, auto_decompress=False)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
    except BaseException:
        await runner.cleanup()
        sock.close()
        raise
    port = sock.getsockname()[1]  # the real one when --web asked for port 0
    web_address.url = sign_in_url(host, port, token)
    log.info("web page: %s", sign_in_url(host, port, token, for_log=True))
    return runner, host_port(host or "0.0.0.0", port)


async def _second_signal(stop: asyncio.Event, count: Callable[[], int]) -> None:
    while count() < 2:
        stop.clear()
        await stop.wait()


class ClientErrorLog(logging.Filter):
    """aiohttp's server logs every request its HTTP parser refuses (a malformed request line, a
    header too long, a body not in its Content-Encoding) at ERROR with a traceback, though it
    answers them 400 itself: anyone who reaches a port could fill the log. This filter, on the
    ``aiohttp.server`` logger, turns each into one INFO line without the traceback, at most one
    per ``every_s`` seconds (the next line counts those left out). Anything else aiohttp logs
    passes untouched: a real fault keeps its traceback."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self.last = -every_s
        self.skipped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            return True
        now = self.clock()
        if now - self.last < self.every_s or not logging.getLogger(record.name).isEnabledFor(logging.INFO):
            self.skipped += 1
            return False
        cause = exc.__cause__ if isinstance(exc, RequestPayloadError) and exc.__cause__ else exc
        detail = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
        skipped = f" ({self.skipped} more since the last such line)" if self.skipped else ""
        record.msg, record.args = "refused a malformed HTTP request: %s%s", (detail, skipped)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info = record.exc_text = None
        self.last, self.skipped = now, 0
        return True


def serve(config: DaemonConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s diffusiond[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.server").addFilter(ClientErrorLog())
    if config.device_auto:
        log.info("--device auto (the default): %s", config.device_auto)
    templates.spawn(config)  # first: its imports go on while the daemon starts (issue 27)
    import uvloop

    try:
        return uvloop.run(run(config))
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 1
