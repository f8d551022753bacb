"""The servers a bench run drives, as child processes: started with their log in a file, stopped with
SIGTERM (then SIGKILL) whatever happens, and waited for until ``/ready`` answers with the start's preload
done: a bench measures loaded models, and since issue 27 a 200 alone means only "admitting"."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from diffusiond.bench.load import BenchError


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A bench cut short by ``timeout`` (SIGTERM; the GPU scripts bound every step so) stops its server too:
    SIGTERM's default action ended the bench without ``finally`` and left the server holding the device's
    memory for the next step."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], sock: Path, log: Path, name: str, timeout: float = 1800) -> None:
    async def poll() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BenchError(f"{name} exited with {proc.returncode} before it was ready; its log ends:\n"
                                 f"{log.read_text()[-4000:]}")
            if sock.exists():
                try:
                    conn = aiohttp.UnixConnector(path=str(sock))
                    async with aiohttp.ClientSession(connector=conn) as s, s.get("http://x/ready") as r:
                        # the naive server has no preload: its 200 is enough
                        if r.status == 200 and (await r.json()).get("preload", {}).get("state", "done") == "done":
                            return
                except aiohttp.ClientError:
                    pass
            await asyncio.sleep(0.2)
        # the log lives in a temporary folder that goes with this run: quote it, do not point to it
        raise BenchError(f"{name} was not ready after {timeout:.0f} s; its log ends:\n{log.read_text()[-4000:]}")

    asyncio.run(poll())
