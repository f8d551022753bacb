"""Which imports need a module: block it, import the worker template's libraries, and name each chain that
asked for it (issue 27's cold start, where ``torch._dynamo`` was 3.3 s of the template's 10.8 s on an H100 host).

A module imported at import time by one library can be deferred; one that several import (a decorator applied at
class definition, ``torch.compiler.disable``) cannot, short of changing them. Run:
``python scripts/import_blockers.py torch._dynamo``. It prints, per library import, whether it still succeeds,
and each blocked request with the last frames that made it (site-packages paths).
"""

from __future__ import annotations

import argparse
import importlib.abc
import traceback
from typing import Any

TEMPLATE = ("diffusers.utils", "diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils",
            "transformers.modeling_utils")
"""What ``worker/startup.py`` imports after torch (``import_libraries``), in its order."""


class Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple[str, list[str]]] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == self.name or fullname.startswith(self.name + "."):
            frames = [f"{f.filename.rpartition('site-packages/')[2]}:{f.lineno}" for f in traceback.extract_stack()
                      if "importlib" not in f.filename and "<frozen" not in f.filename][:-1]
            self.seen.append((fullname, frames[-3:]))
            raise ImportError(f"{fullname} blocked by import_blockers.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", help="the module to block, e.g. torch._dynamo")
    args = parser.parse_args()
    import sys

    import torch  # noqa: F401  (imported before the block: the question is what the libraries on top need)

    blocker = Blocker(args.module)
    sys.meta_path.insert(0, blocker)
    for name in TEMPLATE:
        try:
            __import__(name)
            print(f"{name}: imports without {args.module}")
        except Exception as exc:  # a library turns the ImportError into its own
            print(f"{name}: fails without {args.module} ({type(exc).__name__})")
    for fullname, frames in blocker.seen:
        print(f"asked for {fullname} by: {' <- '.join(reversed(frames))}")


if __name__ == "__main__":
    main()
