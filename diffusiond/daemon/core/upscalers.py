"""The upscalers this daemon serves (``serve --upscaler NAME=PATH[,tile=N][,overlap=N]``, TOML ``[upscalers]``).

The engine loads no torch, yet a file spandrel cannot read should stop the start with a message
naming the flag and the path, not fail every job later, and ``GET /v1/upscalers`` and admission
need each model's scale before any worker is up (workers start on demand). So the start runs one
short process (``python -m diffusiond.pipelines.upscalers``) that reads every file on the CPU with
spandrel and answers each one's scale and architecture; the workers load them again on their
device.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from diffusiond.daemon.errors import invalid
from diffusiond.ipc.upscale import DEFAULT_OVERLAP, DEFAULT_TILE, UpscalerSetting

PROBE_TIMEOUT_S = 300.0  # torch's import alone takes seconds on a slow disk; a file takes less


class UpscalerProbeError(Exception):
    """An upscaler that cannot be served; the message names the flag and the path."""


@dataclass(frozen=True)
class UpscalerInfo:
    name: str
    path: str
    scale: int
    architecture: str
    purpose: str = "SR"
    tags: tuple[str, ...] = ()
    tile: int = DEFAULT_TILE  # the serve setting, shown by GET /v1/upscalers (the workers run it)
    overlap: int = DEFAULT_OVERLAP


class UpscalerRegistry:
    """Name -> what spandrel found in the file; filled by ``probe`` at start, fixed after."""

    def __init__(self, settings: Mapping[str, UpscalerSetting]) -> None:
        self.settings = dict(settings)
        self.paths = {name: s.path for name, s in self.settings.items()}
        self.infos: dict[str, UpscalerInfo] = {}

    async def probe(self) -> None:
        """Read every configured file once with spandrel, in a process of its own."""
        if not self.paths:
            return
        args = [f"{name}={path}" for name, path in self.paths.items()]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "diffusiond.pipelines.upscalers", *args, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise UpscalerProbeError(f"reading the upscalers took over {PROBE_TIMEOUT_S:g} s") from None
        try:
            found = json.loads(out)
        except ValueError:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            hint = " (is spandrel installed? pip install 'diffusiond[upscale]')" if b"spandrel" in err else ""
            raise UpscalerProbeError(f"the upscalers could not be read: {tail[0]}{hint}") from None
        for name, path in self.paths.items():
            entry = found.get(name) or {"error": "no answer"}
            if "error" in entry:
                raise UpscalerProbeError(f"--upscaler {name}={path}: {entry['error']}")
            s = self.settings[name]
            self.infos[name] = UpscalerInfo(name, path, int(entry["scale"]), str(entry["architecture"]),
                                            str(entry.get("purpose", "SR")), tuple(entry.get("tags", ())),
                                            tile=s.tile, overlap=s.overlap)

    def resolve(self, name: str, field: str) -> UpscalerInfo:
        """Admission: the upscaler ``name`` is served (a 400 naming ``field`` otherwise)."""
        info = self.infos.get(name)
        if info is None:
            known = ", ".join(sorted(self.infos)) or "none: serve --upscaler NAME=PATH"
            raise invalid(f"upscaler {name[:64]!r} is not served by this daemon (known: {known})", field=field)
        return info
