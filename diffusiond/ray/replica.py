"""One Serve replica: one real diffusiond daemon in a subprocess, reached over its private socket.

The daemon is the same program as on a workstation (``python -m diffusiond serve``, the same
flags or TOML ``DaemonConfig``), so every guarantee it keeps there (async output path, cancel,
deadlines, no lost output, a job that always ends with a reason) holds here unchanged. The
replica only moves bytes: a request comes in as a msgpack ``Call``, goes to the daemon over its
Unix socket with aiohttp, and the answer goes back as a stream: first the head (status and
headers, msgpack), then the body in chunks, so SSE progress and output bytes flow as they come.

Lifetime: the daemon dies with the replica. ``__del__`` (Serve's graceful stop) sends SIGTERM,
which drains and stops the workers, and waits; the daemon also gets SIGTERM from the kernel if
the replica's process dies without a goodbye (``PR_SET_PDEATHSIG``; ``app.LET_THE_DAEMON_DRAIN``
keeps Ray from SIGKILLing it first), so a killed actor leaves no daemon and no workers behind (and
the next health check of a replica on that node removes its private directory). ``check_health``
fails once the daemon has exited, and Serve then replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from diffusiond.protocol import ErrorCode
from diffusiond.ray import claims, ids
from diffusiond.ray.adoption import Adoption, Refusal, StoreDaemon, daemon_load, spawn, unix_session

log = logging.getLogger("diffusiond.ray")

CHUNK = 256 << 10
BIG_JSON = 1 << 20
PR_SET_PDEATHSIG = 1
# What a daemon's workers take to stop once its drain grace is over: a replica's stop waits for that too.
WORKER_STOP_S = 30.0
# The least a replica's stop waits for its daemon: the daemon's default drain grace and its workers' stop fit in it.
STOP_TIMEOUT_S = 60.0
# headers that belong to one hop, or that are wrong once a body is rewritten
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"})


class Call(msgspec.Struct, frozen=True):
    """An HTTP request on its way from the gateway to a replica (msgpack on the wire, never pickle)."""

    method: str
    path: str
    query: str = ""
    content_type: str | None = None
    body: bytes = b""
    replica: str | None = None  # the replica the job id named; None for any
    prefix: str = ""  # the application's route prefix, put before the job URLs the client is given


class Head(msgspec.Struct, frozen=True):
    status: int
    headers: list[tuple[str, str]]


def encode_error(status: int, code: ErrorCode, message: str) -> list[bytes]:
    """The head and body of an error the replica answers itself."""
    head = Head(status, [("content-type", "application/json")])
    return [msgspec.msgpack.encode(head), json.dumps(ids.error_body(code, message)).encode()]


def remove_stale_dirs(tmp: Path) -> None:
    """Remove the private directories (socket, daemon log) of replicas on this node whose daemon
    is gone. A replica stopped by Serve removes its own in ``__del__``; one whose process was
    killed cannot, so the living replicas' health checks do it for them."""
    for d in tmp.glob("diffusiond-ray-*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            pid = int((d / "daemon.pid").read_text())
        except (OSError, ValueError):
            continue  # not ours, or a replica still starting its daemon
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            continue


def _die_with(parent: int) -> Callable[[], None]:
    """What the child runs between fork and exec: ask the kernel for SIGTERM when the replica's
    thread that started it ends, and exit at once if the replica is already gone (no signal would
    ever come). libc is loaded here, before the fork, not in the child."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def child() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return child


class DaemonReplica:
    """The body of the Serve deployment (``app.build`` wraps it in ``serve.deployment``)."""

    def __init__(self, serve_args: list[str], start_timeout_s: float = 600.0, stop_timeout_s: float = STOP_TIMEOUT_S,
                 shared_state_dir: str | None = None) -> None:
        import ray
        from ray import serve

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.stop_timeout_s = stop_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix=f"diffusiond-ray-{self.replica}-"))
        self.socket = self.dir / "d.sock"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        gpus = [str(g) for g in ray.get_gpu_ids()]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # the GPUs Ray gave this replica, and no others
        # The store its jobs are kept in, and bound to in their ids: the replica's id, unless a
        # shared state dir holds an adopted store of that name (claims.claim_own)
        self.store = self.replica
        self.adoption: Adoption | None = None
        args = own_state_dir(serve_args, self.dir, self.replica)
        pass_fds: tuple[int, ...] = ()
        if shared_state_dir is not None:
            root = Path(shared_state_dir)
            self._claim = claims.claim_own(root, self.replica)
            self.store, pass_fds = self._claim.store, (self._claim.fd,)
            args = [*serve_args, "--state-dir", str(root / self.store)]
            self.adoption = Adoption(root, self.replica, self.store, list(serve_args), self.dir, env,
                                     lambda: _die_with(os.getpid()), start_timeout_s)
        self.proc = spawn(args, self.socket, self.dir / "daemon.log", env, pass_fds, _die_with(os.getpid()))
        (self.dir / "daemon.pid").write_text(str(self.proc.pid))
        log.info("replica %s: daemon pid %d on %s (GPUs %s, store %s)", self.replica, self.proc.pid, self.socket,
                 gpus or "none", self.store)
        self._session: aiohttp.ClientSession | None = None
        self._stats_seq = 0
        self._adopted_load = 0
        self._wait_ready(start_timeout_s)
        if self.adoption is not None:
            self.adoption.start(self.adoption.scan())  # at start: the jobs of replicas that went while none was looking

    # the daemon -------------------------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> None:
        import socket as s

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.replica}: the diffusiond daemon exited with {self.proc.returncode} "
                                   f"while starting:\n{self.daemon_log()}")
            with contextlib.suppress(OSError), s.socket(s.AF_UNIX, s.SOCK_STREAM) as c:
                c.settimeout(5)
                c.connect(str(self.socket))
                c.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if b" 200 " in c.recv(4096).split(b"\r\n", 1)[0]:
                    return
            time.sleep(0.2)
        # the log first: stopping removes the private directory it is in, and with it the only word of why
        message = f"replica {self.replica}: the daemon was not ready after {timeout_s:g}s:\n{self.daemon_log()}"
        self._stop()
        raise RuntimeError(message)

    def daemon_log(self) -> str:
        try:
            return (self.dir / "daemon.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _gone_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"replica {self.replica}: its diffusiond daemon {how}; Serve will replace the replica"

    def _http(self) -> aiohttp.ClientSession:
        self._session = unix_session(self.socket, self._session)
        return self._session

    async def _health(self) -> dict[str, Any] | None:
        try:
            async with self._http().get("/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                doc: dict[str, Any] = await r.json()
                return doc
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    # Serve's hooks -----------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Fail once the daemon has exited or stopped answering; a daemon that is replacing a
        worker is still healthy (it does that itself)."""
        reason = self._gone_reason()
        if reason:
            raise RuntimeError(reason)
        remove_stale_dirs(self.dir.parent)
        if await self._health() is None:
            raise RuntimeError(f"replica {self.replica}: its diffusiond daemon does not answer /health")

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads: whether the daemon takes new work (not sleeping or draining) and
        its load, numbered so that the router knows which of its own sends a report already counts."""
        self._stats_seq += 1
        adopted = self._adopted_load = await self.adoption.tick() if self.adoption is not None else 0
        # the stores whose jobs' requests the router sends here: its own, and those it adopted
        stores = [self.store, *(self.adoption.stores() if self.adoption is not None else ())]
        h = None if self._gone_reason() else await self._health()
        if h is None:
            return {"accepting": False, "load": adopted, "seq": self._stats_seq, "models": {}, "stores": stores}
        return {"accepting": bool(h.get("accepting")) and not h.get("sleeping"), "load": daemon_load(h) + adopted,
                "seq": self._stats_seq, "models": await self._residency(), "stores": stores}

    async def _residency(self) -> dict[str, str]:
        """Model name -> where the daemon holds it (``device``, ``loading``, ``host``, ``disk``), from
        its ``GET /v1/models``: the router prefers a replica that has a job's model on the device."""
        try:
            async with self._http().get("/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                doc = await r.json()
            return {str(m["id"]): str(m.get("residency") or "disk") for m in doc["data"]}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return {}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The daemon's own load for the autoscaling policy."""
        h = None if self._gone_reason() else await self._health()
        return {"daemon_load": float(self._adopted_load) + (0.0 if h is None else float(daemon_load(h)))}

    def __del__(self) -> None:
        """Serve's graceful stop (and the collector's, a no-op by then): SIGTERM, wait, clean up."""
        if hasattr(self, "proc"):
            self._stop()

    def _stop(self) -> None:
        """Every daemon, its own and the adopted ones, told at once and waited for against one deadline: one
        after the other they took up to twice ``stop_timeout_s``, past Serve's graceful shutdown."""
        deadline = time.monotonic() + self.stop_timeout_s
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        if self.adoption is not None:
            self.adoption.stop_all(self.stop_timeout_s)
        if self.proc.poll() is None:
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica %s: daemon did not stop in %gs; killing it", self.replica, self.stop_timeout_s)
                self.proc.kill()
                self.proc.wait()
        if self.adoption is not None:
            self._claim.release()  # its daemon is gone: the store may be adopted now
        shutil.rmtree(self.dir, ignore_errors=True)

    # requests --------------------------------------------------------------------------------------
    async def forward(self, raw: bytes, replica: str | None = None, batch_key: str | None = None,
                      model: str | None = None) -> AsyncIterator[bytes]:
        """Answer one call: a msgpack ``Head``, then the body's chunks. ``replica``, ``batch_key``
        and ``model`` are for the router (``router.JobRouter`` reads them from the call)."""
        call = msgspec.msgpack.decode(raw, type=Call)
        if call.replica is not None and call.replica != self.store:
            # The router sends a job here when this replica adopted the job's store, or when the
            # job's replica is no longer among the running ones and no running replica says it has it.
            async for part in self._forward_adopted(call):
                yield part
            return
        reason = self._gone_reason()
        if reason:
            for part in encode_error(503, ErrorCode.REPLICA_UNAVAILABLE, reason):
                yield part
            return
        async for part in self._send(call, self._http(), self.store, self._gone_reason, f"replica {self.replica}"):
            yield part

    async def _forward_adopted(self, call: Call) -> AsyncIterator[bytes]:
        assert call.replica is not None
        if self.adoption is None:
            for part in encode_error(410, ErrorCode.REPLICA_GONE,
                                     f"the job's replica {call.replica} is gone (restarted or scaled down), and the "
                                     "job and its outputs with it (no shared_state_dir); submit the job again"):
                yield part
            return
        try:
            d: StoreDaemon = await self.adoption.daemon_for(call.replica)
        except Refusal as exc:
            for part in encode_error(exc.status, exc.code, str(exc)):
                yield part
            return
        d.inflight += 1
        try:
            async for part in self._send(call, d.http(), d.store, d.gone_reason,
                                         f"replica {self.replica}, adopted store {d.store}"):
                yield part
        finally:
            d.inflight -= 1
            d.used = time.monotonic()

    async def _send(self, call: Call, session: aiohttp.ClientSession, store: str,
                    gone: Callable[[], str | None], who: str) -> AsyncIterator[bytes]:
        """The call to one daemon (``store``'s), its answer relayed with ids bound to ``store``."""
        headers = {"Content-Type": call.content_type} if call.content_type else {}
        url = call.path + (f"?{call.query}" if call.query else "")
        started = False
        try:
            async with session.request(call.method, url, data=call.body or None, headers=headers) as resp:
                async for part in self._relay(resp, store, call.prefix):
                    started = True
                    yield part
        except aiohttp.ClientConnectionError as exc:
            if started:  # the head went out: the stream ends short, as a dropped connection does
                raise
            await asyncio.sleep(0.2)  # the daemon's exit status, if it died, is known a moment later
            message = gone() or f"{who}: its diffusiond daemon dropped the request ({exc})"
            for part in encode_error(503, ErrorCode.REPLICA_UNAVAILABLE, message):
                yield part

    @staticmethod
    def _bind(body: bytes, store: str, prefix: str = "") -> bytes:
        try:
            return json.dumps(ids.bind_document(json.loads(body), store, prefix), separators=(",", ":")).encode()
        except ValueError:
            return body

    async def _relay(self, resp: aiohttp.ClientResponse, store: str, prefix: str = "") -> AsyncIterator[bytes]:
        ctype = resp.headers.get("Content-Type", "")
        rewrite = ctype.startswith(("application/json", "text/event-stream"))
        headers = [(k.lower(), ids.bind_header(v, store, prefix) if k.lower() in ("location", "content-disposition")
                    else v) for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS]
        if not rewrite and resp.content_length is not None:
            headers.append(("content-length", str(resp.content_length)))
        if ctype.startswith("application/json"):
            body = await resp.read()
            # b64 images make a synchronous answer megabytes of JSON: parse those off the loop
            body = (await asyncio.to_thread(self._bind, body, store, prefix) if len(body) > BIG_JSON
                    else self._bind(body, store, prefix))
            yield msgspec.msgpack.encode(Head(resp.status, headers))
            yield body
        elif ctype.startswith("text/event-stream"):
            yield msgspec.msgpack.encode(Head(resp.status, headers))
            async for part in relay_sse(resp.content.iter_any(), store, prefix):
                yield part
        else:
            yield msgspec.msgpack.encode(Head(resp.status, headers))
            async for chunk in resp.content.iter_chunked(CHUNK):
                yield chunk


def _bind_sse_line(line: bytes, store: str, prefix: str = "") -> bytes:
    """One SSE line, its ``data:`` JSON with the job's ids bound to ``store`` (URLs under ``prefix``)."""
    if line.startswith(b"data: "):
        with contextlib.suppress(ValueError):
            doc = ids.bind_document(json.loads(line[6:]), store, prefix)
            return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    return line


async def relay_sse(chunks: AsyncIterator[bytes], store: str, prefix: str = "") -> AsyncIterator[bytes]:
    """An event stream as it comes, its ``data:`` lines bound to ``store``. Lines are cut here from
    the bytes, with no length limit: aiohttp's own line reader refuses a line over 512 KiB, and a
    preview's PNG in base64 (max_side up to 1024) is longer, which cut the stream before its
    terminal event. The daemon is this replica's own, so its lines are trusted."""
    pending = bytearray()
    async for chunk in chunks:
        pending += chunk
        end = pending.rfind(b"\n")
        if end < 0:
            continue
        whole, pending = bytes(pending[:end + 1]), pending[end + 1:]
        lines = [line + b"\n" for line in whole[:-1].split(b"\n")]
        yield b"".join(_bind_sse_line(line, store, prefix) for line in lines)
    if pending:  # a stream cut mid-line: what came is passed on as it came
        yield _bind_sse_line(bytes(pending), store, prefix)


def own_state_dir(serve_args: list[str], private: Path, replica: str) -> list[str]:
    """The daemon's arguments with a state dir of this replica's own: a state dir holds one
    daemon (its lock), and replicas on one node would otherwise all take the XDG default. Given
    ``--state-dir DIR`` (a shared volume, say), the replica uses ``DIR/<replica id>``, where the
    jobs it leaves wait to be read by hand.

    Given none, the daemon keeps its jobs in memory (``--no-persist``, its compile cache in the
    private directory): a store there would be removed with that directory at the replica's stop,
    so a job the daemon left in it for its next start would never end, and its event stream would
    close with no terminal event. In memory, the daemon's drain on SIGTERM ends each
    job it could not finish ``failed shutting_down`` with the reason, as on one machine."""
    args = list(serve_args)
    if "--no-persist" in args:
        return args
    for i, arg in enumerate(args):
        if arg == "--state-dir" and i + 1 < len(args):
            args[i + 1] = str(Path(args[i + 1]) / replica)
            return args
        if arg.startswith("--state-dir="):  # the daemon reads it as --state-dir DIR; added after, ours won
            args[i] = f"--state-dir={Path(arg.split('=', 1)[1]) / replica}"
            return args
    return [*args, "--no-persist", "--state-dir", str(private / "state")]
