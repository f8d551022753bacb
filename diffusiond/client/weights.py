"""Live weights from a trainer: ``update_lora(name, state_dict)`` (and ``update_weights(model,
component, state_dict)`` for a whole component's parameters) without files or JSON.

The tensors are written once, into anonymous memfds (``os.memfd_create``: no file on disk, gone when the last fd
closes; several "parts" for a large update, written in parallel, then sealed against writes and shrinking: see
``pack``), and the fds travel to the daemon over its output socket with SCM_RIGHTS in one frame, together with a
msgspec header naming each tensor's dtype, shape, part and offset (UPDATE_LORA). The daemon hands duplicates of
the same fds to its workers; each reads the tensors out once into its model. Why the output socket and not an
HTTP request: an fd only travels with ``sendmsg`` on a Unix socket read by hand, which aiohttp's transports do not
expose; the output socket already is that socket (``daemon/edge/handoff.py``), with the same same-user rule.

The call is blocking and returns the adapter's new version once every live worker applied it
(between two batches: no batch mixes versions; a model with no worker running gets it when it
starts). If this process dies after sending, the update still completes; before, nothing
happened. Refusals come back as ``DaemonError`` (status 400, the first bad tensor named), exactly
as the HTTP API would shape them; what cannot be sent at all (a dtype other than the three, NaN or
infinite values) raises TypeError or ValueError here, naming the tensor, before anything is sent.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from diffusiond.client.errors import ClientTimeout, DaemonError, DaemonUnreachable, permission_denied, update_error
from diffusiond.client.transport import SOCKET_WAIT_S
from diffusiond.client.zerocopy import connect, receive
from diffusiond.ipc.errors import ProtocolError
from diffusiond.ipc.frames import FrameDecoder, FrameEncoder
from diffusiond.ipc.messages import Updated, UpdateLora, UpdateRefused, UpdateWeights, WeightTensor
from diffusiond.ipc.updates import MAX_PARTS, SEALS
from diffusiond.protocol import MODEL_DTYPES, output_socket_path

_ALIGN = 64  # each tensor starts on a cache line


def pack(state_dict: Mapping[str, Any]) -> tuple[list[int], list[WeightTensor]]:
    """Memfds ("parts") holding every tensor of ``state_dict`` (torch tensors or numpy arrays), and the header
    that says where each lies: its part and its offset there. The caller owns (and closes) the fds.

    Written with ``pwrite``, not through a mapping: the kernel fills the memfd's fresh pages without a page
    fault per 4 KiB in this process, which took about as long as the copy itself (issue 29's ``update_lora``
    latency; ``scripts/bench_update_io.py``). Each part is checked for NaN and infinities and written in chunks
    (a whole tensor's check made temporaries of its size) by a thread of its own: numpy's ufuncs and ``pwrite``
    let go of the GIL, but ``pwrite`` to one shmem file holds its inode's lock, so threads sharing one memfd
    took turns (1 GB: 0.40 s on one thread and on two; 0.21 s on two memfds). There is a part per ``_PART``
    bytes (so a LoRA's few MB stay one memfd), per core, per tensor, up to ``_MAX_PARTS``. Tensors go largest
    first to the least-filled part, so the threads finish together."""
    arrays: list[tuple[str, str, np.ndarray]] = []
    for name, value in state_dict.items():
        dtype, arr = _as_array(name, value)
        arrays.append((str(name), dtype, arr))
    total = sum(_aligned(arr.nbytes) for _, _, arr in arrays)
    count = max(1, min(_MAX_PARTS, os.cpu_count() or 1, -(-total // _PART), len(arrays)))
    sizes = [0] * count
    placed: dict[int, WeightTensor] = {}
    members: list[list[tuple[int, int]]] = [[] for _ in range(count)]  # each part's (tensor's index, offset)
    for i in sorted(range(len(arrays)), key=lambda i: -arrays[i][2].nbytes):
        name, dtype, arr = arrays[i]
        part = sizes.index(min(sizes))
        placed[i] = WeightTensor(name, dtype, list(arr.shape), sizes[part], part)
        members[part].append((i, sizes[part]))
        sizes[part] += _aligned(arr.nbytes)
    fds: list[int] = []
    try:
        for size in sizes:
            fds.append(os.memfd_create("diffusiond-lora-update", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
            os.ftruncate(fds[-1], size)
        with ThreadPoolExecutor(count, thread_name_prefix="diffusiond-pack") as pool:
            bad = [b for b in pool.map(lambda fd, m: _write_part(fd, arrays, m), fds, members) if b is not None]
        if bad:  # each part's first, so the first of all: the one the state dict names first
            raise min(bad, key=lambda b: b[0])[1]
        for fd in fds:  # what was checked is what every worker reads, now and when one starts later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, [placed[i] for i in range(len(arrays))]


_PART = 64 << 20  # the least bytes worth a memfd and a thread of their own
_MAX_PARTS = MAX_PARTS  # what one update may bring (ipc/updates.py): writes scaled almost linearly up to 8 on an
# H200 host (4 GiB: 1.4-1.7 s on one memfd, 0.25-0.28 s on 8) and went on to 16 on an H100 host (0.15-0.16 s)
_CHUNK = 4 << 20  # bytes checked and written at a time, a multiple of every dtype's size: small enough that the
# check's temporaries stay in the CPU's cache (at 32 MiB a 1 GiB pack took 0.33-1.4 s on the 2-core box, at 4 MiB
# 0.33-0.35 s)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _write_part(fd: int, arrays: list[tuple[str, str, np.ndarray]],
                members: list[tuple[int, int]]) -> tuple[int, ValueError] | None:
    """One part's tensors, in the state dict's order, up to the first holding NaN or infinities: its index and
    the error naming it, for ``pack`` to raise the first of all parts'."""
    for i, at in sorted(members):
        name, dtype, arr = arrays[i]
        data = arr.reshape(-1).view(np.uint8)
        for start in range(0, arr.nbytes, _CHUNK):
            try:
                _check_and_write(fd, name, dtype, data[start:start + _CHUNK], at + start)
            except ValueError as exc:
                return i, exc
    return None


def _check_and_write(fd: int, name: str, dtype: str, data: np.ndarray, at: int) -> None:
    if not _finite(dtype, data):
        raise ValueError(f"tensor {name!r} holds NaN or infinite values; a diverged step's weights would "
                         "reach every output they touch, so they are not sent")
    view, done = data.data, 0
    while done < len(view):  # a pwrite may write less than asked
        done += os.pwrite(fd, view[done:], at + done)


# The exponent bits of each dtype sent, read as integers: all ones is an infinity or a NaN. An integer
# mask is a tenth of torch's isfinite on bfloat16 on a CPU (issue 29).
_EXPONENT = {"bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00), "float32": (np.uint32, 0x7F800000)}


def _finite(dtype: str, data: np.ndarray) -> bool:
    """``data``: the raw bytes of whole values of ``dtype``."""
    word, mask = _EXPONENT[dtype]
    bits = data.view(word)
    return not bool(np.any((bits & mask) == mask))


def _as_array(name: object, value: Any) -> tuple[str, np.ndarray]:
    """The dtype's name as the daemon reads it, and a C-contiguous array of the value in this machine's
    byte order (the daemon reads the memfd in it: a big-endian array's raw bytes would be garbage
    there). A dtype the daemon would not take is refused here, the tensor named (TypeError; some, float8
    say, have no numpy form to send); NaN and infinite values are refused by ``pack`` as it writes them."""
    if type(value).__module__.startswith("torch"):  # no torch import for callers who send numpy
        t = value.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        _check_dtype(name, dtype)
        if dtype == "bfloat16":  # numpy has no bfloat16: its words travel as int16
            import torch

            arr = t.view(torch.int16).numpy()
        else:
            arr = t.numpy()
    elif isinstance(value, np.ndarray):
        dtype = value.dtype.name
        _check_dtype(name, dtype)
        arr = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("="))
    else:
        raise TypeError(f"tensor {name!r} is a {type(value).__name__}; give torch tensors or numpy arrays")
    return dtype, arr


def _check_dtype(name: object, dtype: str) -> None:
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"tensor {name!r} has dtype {dtype}; weights are sent as {', '.join(MODEL_DTYPES)}: "
                        "convert it first (e.g. .float())")


def update_lora(socket_path: str, name: str, state_dict: Mapping[str, Any], timeout: float | None) -> int:
    """Send the update and wait for its answer; the new version. See the module docstring."""
    fds, tensors = pack(state_dict)
    return _send(socket_path, UpdateLora(name, tensors), fds, f"updating LoRA {name!r}", timeout)


def update_weights(socket_path: str, model: str, component: str, state_dict: Mapping[str, Any],
                   timeout: float | None) -> int:
    """The same for whole parameters of one component of ``model`` (names of its ``state_dict``)."""
    fds, tensors = pack(state_dict)
    return _send(socket_path, UpdateWeights(model, component, tensors), fds,
                 f"updating {component} of {model}", timeout)


def _send(socket_path: str, msg: UpdateLora | UpdateWeights, fds: list[int], what: str,
          timeout: float | None) -> int:
    """Send ``msg`` with all its parts in one frame (SCM_RIGHTS), and wait for the answer; ``fds`` are closed
    here, whatever happens."""
    path = output_socket_path(socket_path)
    sock: socket.socket | None = None
    try:
        try:
            sock = _connect(socket_path, path, timeout)
            frame = FrameEncoder().encode(msg, len(fds))
            sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            _close(fds)  # the daemon has its own now
            # With a timeout the socket is non-blocking, and one send takes only what fits its buffer: a header
            # of a few thousand tensors did not, and the daemon waited for the rest of its frame forever.
            if sent < len(frame):  # an empty send to a daemon that already answered and hung up is EPIPE
                sock.sendall(frame[sent:])
            answer, extra = receive(sock, FrameDecoder())
            _close(extra)  # an answer to an update brings none
        except TimeoutError:
            raise ClientTimeout(socket_path, what, timeout) from None
        except OSError as exc:
            # The daemon's own socket, not the output one: the message says to start a
            # daemon on this path, and one started on <socket>.out would listen in the wrong place.
            denied = (f"live updates go through the daemon's output socket {path}, which only the daemon's own user "
                      "may use (--socket-mode, --socket-group and --allow-uid open the HTTP socket alone): send "
                      "them from a process of that user") if permission_denied(exc) else None
            raise DaemonUnreachable(socket_path, f"its output socket {path}: {exc.strerror or exc}", denied) from None
        except ProtocolError as exc:  # an IPCError: outside the client's tree, which callers catch
            raise DaemonError(502, "bad_answer", f"the answer to {what} from {path} does not decode ({exc}); "
                              "is a diffusiond of this version listening there?") from None
        finally:
            if sock is not None:
                sock.close()
    finally:
        _close(fds)
    if isinstance(answer, UpdateRefused):
        raise update_error(answer.status, answer.code, answer.message, answer.field)
    if not isinstance(answer, Updated):
        raise DaemonError(502, "bad_answer", f"unexpected answer to an update: {type(answer).__name__}")
    return answer.version


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _connect(socket_path: str, path: str, timeout: float | None) -> socket.socket:
    """The output socket, waited for up to ``SOCKET_WAIT_S`` while it is not bound yet (no file, or nothing
    listening): a daemon started a moment ago binds it just after its own socket, and a socket-activated one
    only once something connected to its own socket, which this does once (a trainer's first call is often
    an update). A daemon that never comes is reported after the wait, as a submit's is."""
    deadline = time.monotonic() + SOCKET_WAIT_S
    woken = False
    while True:
        try:
            return connect(path, timeout)  # EMFILE too is a ClientError, by ``_send``
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= deadline:
                raise
        if not woken:
            woken = True
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.connect(socket_path)
        time.sleep(0.1)
