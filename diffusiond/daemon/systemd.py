"""systemd integration without libsystemd: readiness and status notification, the watchdog, and
socket activation.

Why it exists: under ``Type=notify`` systemd only considers the daemon started once it says
``READY=1``, so units ordered after it (a trainer, say) wait until it admits jobs (issue 27: not until
every model is loaded; ``STATUS=`` says what still loads) rather than until the process exists;
``WatchdogSec=`` restarts a daemon whose event loop has stopped making progress; and socket activation
lets systemd own the Unix socket (its path, mode and group), so clients can connect while the daemon
starts or restarts and nothing is lost in between.

Why without a dependency: the three protocols are a few environment variables and one datagram,
as in gunicorn's ``systemd.py``. Everything here is a no-op when not run by systemd, never
raises because of systemd, and has no import-time side effects: it reads the environment only
when called, so a test or a worker process can import it freely.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

__all__ = [
    "SD_LISTEN_FDS_START",
    "listen_fds",
    "listen_fds_with_names",
    "notify",
    "watchdog_interval",
    "watchdog_loop",
]

log = logging.getLogger(__name__)

#: The first inherited file descriptor in the socket activation protocol (after stdin/out/err).
SD_LISTEN_FDS_START = 3

# A bounded wait: READY=1 must not be dropped because PID 1 is briefly busy, but a wedged notify
# socket must not stall the event loop for long either.
_SEND_TIMEOUT_S = 1.0


def notify(*lines: str) -> bool:
    """Send ``KEY=VALUE`` lines to the service manager; True when the datagram was sent.

    False (never an exception) when not run under systemd or when sending fails: losing a status
    line must not take the daemon down, and a missed ``READY=1`` or ``WATCHDOG=1`` is reported by
    systemd itself as a start or watchdog timeout. Newlines inside a line are flattened to spaces
    so that, say, an exception message in ``STATUS=`` cannot inject extra assignments.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not lines:
        return False
    if address[0] == "@":
        # Abstract namespace: the name is the rest after a leading NUL, with no terminator.
        target = "\0" + address[1:]
    elif address[0] == "/":
        target = address
    else:
        log.debug("NOTIFY_SOCKET=%r is neither a path nor an abstract name; not notifying", address)
        return False
    payload = "\n".join(line.replace("\n", " ") for line in lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(_SEND_TIMEOUT_S)
            sock.sendto(payload, target)
    except (OSError, ValueError) as exc:
        log.debug("sd_notify to %r failed: %s", address, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings, or None when systemd expects none from this process.

    Half of ``WatchdogSec=``, as sd_watchdog_enabled(3) advises, so one late tick is not a
    restart. ``WATCHDOG_PID`` naming another process means the variables were inherited (a worker
    spawned by the engine) and the pings are not ours to send.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None
        value = int(usec)
    except ValueError:
        log.debug("ignoring malformed WATCHDOG_USEC=%r / WATCHDOG_PID=%r", usec, pid)
        return None
    if value <= 0:
        return None
    return value / 1_000_000 / 2


async def watchdog_loop(interval: float) -> None:
    """Ping ``WATCHDOG=1`` every ``interval`` seconds until cancelled.

    It runs as a task on the engine's event loop on purpose, not in a thread: if a callback
    blocks the loop, the pings stop and systemd aborts and restarts the daemon, which is the
    failure the watchdog exists to catch. A thread would keep pinging for a dead loop.
    """
    if interval <= 0:
        raise ValueError(f"watchdog interval must be positive, got {interval!r}")
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def listen_fds_with_names(unset_environment: bool = True) -> list[tuple[str, socket.socket]]:
    """Sockets passed by systemd socket activation, each with its ``FileDescriptorName=``.

    Names come from ``LISTEN_FDNAMES`` (``"unknown"`` where systemd gave none), so a unit with
    several ``ListenStream=`` lines can tell its sockets apart. See :func:`listen_fds`.
    """
    fds_var = os.environ.get("LISTEN_FDS")
    pid_var = os.environ.get("LISTEN_PID")
    names_var = os.environ.get("LISTEN_FDNAMES")
    if unset_environment:
        # Unset whatever the outcome, like sd_listen_fds(3): worker processes must not inherit
        # variables that describe descriptors they do not have.
        for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            os.environ.pop(name, None)
    if not fds_var or not pid_var:
        return []
    try:
        if int(pid_var) != os.getpid():
            return []
        count = int(fds_var)
    except ValueError:
        log.debug("ignoring malformed LISTEN_FDS=%r / LISTEN_PID=%r", fds_var, pid_var)
        return []
    names = names_var.split(":") if names_var else []
    result: list[tuple[str, socket.socket]] = []
    for index in range(max(count, 0)):
        fd = SD_LISTEN_FDS_START + index
        name = names[index] if index < len(names) and names[index] else "unknown"
        try:
            # Not inherited by the worker processes (or anything else the daemon starts).
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            # Not open, or not a socket (ListenFIFO=, say): nothing this daemon can serve on.
            log.warning("ignoring inherited fd %d (%s): %s", fd, name, exc)
            continue
        result.append((name, sock))
    return result


def listen_fds(unset_environment: bool = True) -> list[socket.socket]:
    """Sockets passed by systemd socket activation, in unit-file order; [] when none were passed.

    systemd created, bound and is listening on them (path, mode and group come from the
    ``.socket`` unit), so the daemon must serve on them as they are: not bind, not unlink.
    They are taken only when ``LISTEN_PID`` is this process, because an inherited
    environment names descriptors that belong to the parent. Family and type are read from
    the descriptor. With ``unset_environment`` (the default) the variables are removed so
    that child processes do not see them.
    """
    return [sock for _, sock in listen_fds_with_names(unset_environment)]
