"""Tensor descriptors: where an output lives in shared memory, and how to read or write it.

A write copies exactly the bytes of the tensor it is given, even when that tensor is a view of a
much larger batch tensor (the storage-amplification bug of pickle-based transports cannot happen:
nothing here ever looks at the storage). A read is a zero-copy numpy or torch view.

torch is imported lazily so that the engine, which only reads, never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

# numpy has no bfloat16; such outputs are read as raw uint16 words by numpy (torch reads them natively).
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(np.uint16),
}


_NUMPY_NATIVE = frozenset(_NUMPY_DTYPES) - {"bfloat16"}


class TensorDesc(msgspec.Struct, frozen=True, kw_only=True):
    """A dense, C-contiguous tensor at ``offset`` of slot ``slot_id``.

    ``dedicated`` means the slot is its own memfd (sent with the frame) rather than a range of the
    worker's arena; then ``offset`` is 0.
    """

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    slot_id: int
    offset: int = 0
    dedicated: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _NUMPY_DTYPES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}; known: {sorted(_NUMPY_DTYPES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        expected = math.prod(self.shape) * itemsize(self.dtype)
        if self.nbytes != expected:
            raise ValueError(f"nbytes {self.nbytes} does not match shape {self.shape} of {self.dtype}")
        if self.offset < 0 or self.slot_id < 0:
            raise ValueError(f"negative offset {self.offset} or slot id {self.slot_id}")


def numpy_dtype(dtype: str) -> np.dtype[Any]:
    """How numpy reads a tensor of ``dtype`` (bfloat16 as raw uint16 words)."""
    return _NUMPY_DTYPES[dtype]


def itemsize(dtype: str) -> int:
    return _NUMPY_DTYPES[dtype].itemsize


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """The bytes a dense tensor of ``dtype`` and ``shape`` holds (KeyError for a dtype not taken)."""
    return itemsize(dtype) * math.prod(shape)


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def nbytes_of(tensor: torch.Tensor) -> int:
    """Bytes of the view itself, never of its storage."""
    return tensor.numel() * tensor.element_size()


def describe(tensor: torch.Tensor, slot_id: int, offset: int = 0, dedicated: bool = False) -> TensorDesc:
    return TensorDesc(
        dtype=dtype_name(tensor),
        shape=tuple(tensor.shape),
        nbytes=nbytes_of(tensor),
        slot_id=slot_id,
        offset=offset,
        dedicated=dedicated,
    )


def host_tensor(buffer: memoryview, dtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU torch tensor over ``buffer`` (writable shared memory), shaped like the output."""
    import torch

    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def write_tensor(buffer: memoryview, tensor: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """Copy ``tensor`` (any device, any strides) into the start of ``buffer``.

    Only ``tensor``'s own elements move. With ``non_blocking`` and a CUDA source the copy is
    queued on the current stream; the caller must synchronize before announcing the output.
    Returns the host tensor that aliases the buffer.
    """
    need = nbytes_of(tensor)
    if need > len(buffer):
        raise ValueError(f"tensor of {need} bytes does not fit a buffer of {len(buffer)} bytes")
    dst = host_tensor(buffer[:need], tensor.dtype, tuple(tensor.shape))
    if need and tensor.device.type == "cpu" and dtype_name(tensor) in _NUMPY_NATIVE:
        # numpy copies on this thread only; a large torch copy_ would start an OpenMP team here
        # and slow the forward running beside it (see worker/copier.py, _output_layout_numpy)
        np.copyto(dst.numpy(), tensor.numpy())
    elif need:
        dst.copy_(tensor, non_blocking=non_blocking)
    return dst


def as_numpy(buffer: memoryview, desc: TensorDesc) -> np.ndarray:
    """Zero-copy numpy view of the described tensor inside ``buffer`` (the whole slot mapping)."""
    end = desc.offset + desc.nbytes
    if end > len(buffer):
        raise ValueError(f"descriptor range [{desc.offset}, {end}) exceeds buffer of {len(buffer)} bytes")
    dt = _NUMPY_DTYPES[desc.dtype]
    return np.frombuffer(buffer, dtype=dt, count=math.prod(desc.shape), offset=desc.offset).reshape(desc.shape)


def as_torch(buffer: memoryview, desc: TensorDesc) -> torch.Tensor:
    """Zero-copy torch view. Read-only memory stays read-only: writing through it faults."""
    import warnings

    import torch

    arr = as_numpy(buffer, desc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if desc.dtype == "bfloat16" else t
