"""Which import initialises CUDA in the worker template's imports (issue 27: a template on CUDA found it initialised).

Prints the first module whose import left ``torch.cuda.is_initialized()`` true, and the stack of the first
``torch.cuda._lazy_init`` call. Run on a GPU host: ``PYTHONPATH=. python3 scripts/cuda_init_probe.py``.
"""

import builtins
import traceback

import torch
import torch.cuda

_orig_init = torch.cuda._lazy_init
_real_import = builtins.__import__
seen: list[str] = []


def _init() -> None:
    if not torch.cuda.is_initialized() and not seen:
        seen.append("stack")
        frames = [f for f in traceback.format_stack() if "importlib" not in f and "cuda_init_probe" not in f]
        print("first _lazy_init from:\n" + "".join(frames[-25:]), flush=True)
    _orig_init()


def _import(name, *args, **kwargs):  # type: ignore[no-untyped-def]
    was = torch.cuda.is_initialized()
    module = _real_import(name, *args, **kwargs)
    if not was and torch.cuda.is_initialized():
        print(f"CUDA initialised during the import of {name}", flush=True)
    return module


torch.cuda._lazy_init = _init
builtins.__import__ = _import
import diffusiond.worker.process  # noqa: E402,F401
from diffusiond.worker import startup  # noqa: E402

print("after process:", torch.cuda.is_initialized(), flush=True)
startup.quiet_libraries()
print("after quiet_libraries:", torch.cuda.is_initialized(), flush=True)
from diffusiond.worker import template  # noqa: E402

print("NVML capabilities:", template._nvml_capabilities(), flush=True)
with template._device_queries_from_nvml():
    startup.import_libraries()
print("after import_libraries:", torch.cuda.is_initialized(), flush=True)
