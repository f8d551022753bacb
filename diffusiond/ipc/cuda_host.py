"""Register shared-memory mappings with CUDA so device-to-host copies run at PCIe speed.

``cudaHostRegister`` page-locks an existing mapping and makes it visible to the copy engines; a
``non_blocking`` copy into it is then a true async DMA. Registration is slow (it pins every
page), so it happens once per arena, never per output, and is undone before the unmap.

Used as the arena's ``on_map``/``on_unmap`` hooks; a no-op without CUDA.
"""

from __future__ import annotations

import logging

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
