"""Build-once model folders in the diffusiond cache, for the models made in code (tiny-inpaint, tiny-video,
tiny-flux, presets; ``tiny`` predates it and keeps its own rename-only rule, ``tiny.ensure_tiny``).

A model built in code is saved with ``save_pretrained`` and then loaded back through the ordinary
folder loader, so it takes the same path as a real model. Building can take a while (a preset is
gigabytes) and several workers may start at once, so the folder must appear atomically (built
beside it, then renamed: a reader never sees half a model) and concurrent builders must not each
write their own copy (an exclusive lock per folder: the second waits, then finds the first's).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

BUILT_FOLDERS: Final = {"tiny": "tiny-v2", "tiny-inpaint": "tiny-inpaint-v1", "tiny-video": "tiny-video-v1",
                        "tiny-flux": "tiny-flux-v1"}
"""Spec -> its folder under ``<cache>/models``: torch-free, so that the engine finds the files of a model built
in code (their headers, issue 29). Bump a model's name when its architecture or saved layout changes: an old
cache folder is then ignored."""


def cache_root() -> Path:
    """The diffusiond cache: ``$DIFFUSIOND_CACHE``, else ``$XDG_CACHE_HOME/diffusiond``, else ~/.cache."""
    explicit = os.environ.get("DIFFUSIOND_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "diffusiond"


def is_complete(folder: Path) -> bool:
    """Folders appear whole by rename, so an index file means a whole model (tiny uses the same test)."""
    return (folder / "model_index.json").is_file()


def ensure_built(folder_name: str, build: Callable[[Path], None], cache_dir: Path | None = None) -> Path:
    """Return ``<cache>/models/<folder_name>``, calling ``build(tmp_folder)`` first if it is missing.

    The lock lives in ``<cache>/locks`` rather than beside the model, so the models folder holds
    nothing but complete models, and lock files are never deleted (deleting a lock file that
    another process waits on would let a third take a different lock on a new file).
    """
    root = cache_dir if cache_dir is not None else cache_root()
    models = root / "models"
    final = models / folder_name
    if is_complete(final):
        return final
    locks = root / "locks"
    models.mkdir(parents=True, exist_ok=True)
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{folder_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we crash
        if is_complete(final):  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder_name}.build-", dir=models))
        try:
            build(tmp)
            if is_complete(final):  # put there meanwhile by a builder that takes no lock (an older version)
                return final
            if final.exists():  # an incomplete leftover from a build killed mid-rename
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
