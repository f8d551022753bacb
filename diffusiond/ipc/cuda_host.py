"""Register shared-memory mappings with CUDA so device-to-host copies run at PCIe speed.

``cudaHostRegister`` page-locks an existing mapping and makes it visible to the copy engines; a
``non_blocking`` copy into it is then a true async DMA. Registration is slow (it pins every
page), so it happens once per arena, never per output, and is undone before the unmap.

Used as the arena's ``on_map``/``on_unmap`` hooks; a no-op without CUDA. ``register_for`` ties a
registration to the object that owns the memory (a model's host copy of its weights).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)

_REGISTERED: set[int] = set()
_PORTABLE = 1  # cudaHostRegisterPortable: usable from every CUDA context of the process


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def register(address: int, nbytes: int) -> bool:
    """Pin [address, address + nbytes) for CUDA; returns False when there is no CUDA."""
    if not cuda_available():
        return False
    import torch

    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed with CUDA error {code}")
    _REGISTERED.add(address)
    log.debug("registered %d bytes at %#x with CUDA", nbytes, address)
    return True


def unregister(address: int, nbytes: int) -> None:
    if address not in _REGISTERED:
        return
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)
    _REGISTERED.discard(address)


def is_registered(address: int) -> bool:
    return address in _REGISTERED


def register_for(owner: object, address: int, nbytes: int) -> Callable[[], None]:
    """Pin [address, address + nbytes), memory ``owner`` holds, until ``owner`` is collected or the returned
    callable (idempotent) is called, whichever comes first: the caller's way to unpin before it frees the memory.

    CUDA keeps a registration after the memory under it is freed, and the next block the allocator put at those
    addresses then failed to register ("already mapped", CUDA error 712: a second model in one process). The
    finalizer runs when ``owner`` goes, before the attributes that hold the memory are cleared."""
    register(address, nbytes)
    done = weakref.finalize(owner, unregister, address, nbytes)
    done.atexit = False  # at exit the process's mappings go with it
    return done
