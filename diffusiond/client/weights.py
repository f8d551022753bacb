"""Live weights from a trainer: ``update_lora(name, state_dict)`` (and ``update_weights(model,
component, state_dict)`` for a whole component's parameters) without files or JSON.

The tensors are written once, into an anonymous memfd (``os.memfd_create``: no file on disk, gone
when the last fd closes), and the fd travels to the daemon over its output socket with SCM_RIGHTS,
together with a msgspec header naming each tensor's dtype, shape and offset (UPDATE_LORA). The
daemon hands duplicates of the same fd to its workers; each copies the tensors out once into its
model. Why the output socket and not an HTTP request: an fd only travels with ``sendmsg`` on a
Unix socket read by hand, which aiohttp's transports do not expose; the output socket already is
that socket (``daemon/edge/handoff.py``), with the same same-user rule.

The call is blocking and returns the adapter's new version once every live worker applied it
(between two batches: no batch mixes versions; a model with no worker running gets it when it
starts). If this process dies after sending, the update still completes; before, nothing
happened. Refusals come back as ``DaemonError`` (status 400, the first bad tensor named), exactly
as the HTTP API would shape them; what cannot be sent at all (a dtype other than the three, NaN or
infinite values) raises TypeError or ValueError here, naming the tensor, before anything is sent.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from diffusiond.client.errors import ClientTimeout, DaemonError, DaemonUnreachable, update_error
from diffusiond.ipc.channel import recv_with_fds
from diffusiond.ipc.frames import FrameDecoder, FrameEncoder
from diffusiond.ipc.messages import Updated, UpdateLora, UpdateRefused, UpdateWeights, WeightTensor
from diffusiond.protocol import MODEL_DTYPES, output_socket_path

_ALIGN = 64  # each tensor starts on a cache line


def pack(state_dict: Mapping[str, Any]) -> tuple[int, list[WeightTensor]]:
    """A memfd holding every tensor of ``state_dict`` (torch tensors or numpy arrays) back to back,
    and the header that says where each lies. The caller owns (and closes) the fd.

    Written with ``pwrite``, not through a mapping: the kernel fills the memfd's fresh pages without a
    page fault per 4 KiB in this process, which took about as long as the copy itself (issue 29's
    ``update_lora`` latency; ``scripts/bench_update_io.py``). Each tensor is checked for NaN and infinities and
    written in chunks by a few threads (numpy's ufuncs and ``pwrite`` let go of the GIL): a 4.8 GB UNet's whole
    update took 3.6 s on the H100 host with one, and a whole tensor's check made temporaries of its size."""
    arrays: list[tuple[str, str, np.ndarray]] = []
    for name, value in state_dict.items():
        dtype, arr = _as_array(name, value)
        arrays.append((str(name), dtype, arr))
    tensors: list[WeightTensor] = []
    offset = 0
    for name, dtype, arr in arrays:
        tensors.append(WeightTensor(name, dtype, list(arr.shape), offset))
        offset += -(-arr.nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("diffusiond-lora-update", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, offset)
        chunks = [(name, dtype, arr.reshape(-1).view(np.uint8)[start:start + _CHUNK], t.offset + start)
                  for t, (name, dtype, arr) in zip(tensors, arrays, strict=True)
                  for start in range(0, arr.nbytes, _CHUNK)]
        threads = max(1, min(_THREADS, os.cpu_count() or 1, len(chunks)))
        with ThreadPoolExecutor(threads, thread_name_prefix="diffusiond-pack") as pool:
            for _ in pool.map(lambda c: _check_and_write(fd, *c), chunks):  # raises the first chunk's error
                pass
    except BaseException:
        os.close(fd)
        raise
    return fd, tensors


_CHUNK = 32 << 20  # bytes one thread checks and writes at a time: a multiple of every dtype's size
_THREADS = 8  # past that the memory bus, not the cores, sets the pace


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
    fd, tensors = pack(state_dict)
    return _send(socket_path, UpdateLora(name, tensors), fd, f"updating LoRA {name!r}", timeout)


def update_weights(socket_path: str, model: str, component: str, state_dict: Mapping[str, Any],
                   timeout: float | None) -> int:
    """The same for whole parameters of one component of ``model`` (names of its ``state_dict``)."""
    fd, tensors = pack(state_dict)
    return _send(socket_path, UpdateWeights(model, component, tensors), fd,
                 f"updating {component} of {model}", timeout)


def _send(socket_path: str, msg: UpdateLora | UpdateWeights, fd: int, what: str, timeout: float | None) -> int:
    path = output_socket_path(socket_path)
    sock: socket.socket | None = None
    try:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # EMFILE here too is a ClientError
            sock.settimeout(timeout)
            sock.connect(path)
            frame = FrameEncoder().encode(msg, 1)
            sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            os.close(fd)  # the daemon has its own now
            fd = -1
            answer = _receive(sock)
        except TimeoutError:
            raise ClientTimeout(socket_path, what, timeout) from None
        except OSError as exc:
            # The daemon's own socket, not the output one (review44-f 3): the message says to start a
            # daemon on this path, and one started on <socket>.out would listen in the wrong place.
            raise DaemonUnreachable(socket_path, f"its output socket {path}: {exc.strerror or exc}") from None
        finally:
            if sock is not None:
                sock.close()
    finally:
        if fd >= 0:
            os.close(fd)
    if isinstance(answer, UpdateRefused):
        raise update_error(answer.status, answer.code, answer.message, answer.field)
    if not isinstance(answer, Updated):
        raise DaemonError(502, "bad_answer", f"unexpected answer to an update: {type(answer).__name__}")
    return answer.version


def _receive(sock: socket.socket) -> object:
    decoder = FrameDecoder()
    while True:
        data, fds = recv_with_fds(sock)
        for extra in fds:
            os.close(extra)
        if not data:
            raise ConnectionResetError("the daemon closed the output socket before answering")
        frames = decoder.feed(data)
        if frames:
            return frames[0][3]
