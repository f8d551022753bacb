"""Test-only faults in the state dir (``serve --test-state-fault``): a full disk, a write cut half-way.

Apart from ``store.py`` because no user ever sets them: the reliability tests (docs/reliability.md) switch
them on to check that a full disk is a clear 507 and that a crash mid-write leaves no partial file served.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass


@dataclass
class StateFaults:
    """Test-only faults (``serve --test-state-fault``), comma-separated.

    ``enospc_file=PATH``: while PATH exists, every write to the state dir fails with ENOSPC (a
    full disk, switched on and off by the test). ``write_delay_ms=N``: each output file write
    stops N ms half-way through (a crash there must leave no partial file served).
    ``update_delay_ms=N``: each write of a job's status waits N ms first (a slow disk: a crash
    must never undo an ending a client was told of).
    """

    enospc_file: str | None = None
    write_delay_ms: int = 0
    update_delay_ms: int = 0

    @classmethod
    def parse(cls, spec: str) -> StateFaults:
        f = cls()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key == "enospc_file":
                f.enospc_file = value
            elif key == "write_delay_ms":
                f.write_delay_ms = int(value)
            elif key == "update_delay_ms":
                f.update_delay_ms = int(value)
            else:
                raise ValueError(f"unknown state fault {key!r}")
        return f

    def check_space(self) -> None:
        if self.enospc_file and os.path.exists(self.enospc_file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
