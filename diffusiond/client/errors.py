"""The exceptions of the diffusiond client, in a module of their own.

They sit below both ``diffusiond.client`` (which re-exports them: import them from there) and
``diffusiond.client.zerocopy`` (whose ZeroCopyUnavailable is a ClientError), so the client can use the
zero-copy path without the two modules importing each other. The tree, and when each is raised,
is in ``diffusiond.client``'s docstring and docs/api.md.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Any

__all__ = ["ClientError", "ClientTimeout", "DaemonError", "DaemonUnreachable", "JobFailed", "UpdateSplit",
           "update_error"]


class ClientError(Exception):
    """The root of every exception this module raises; see the tree in the module docstring."""


class DaemonError(ClientError):
    """The daemon answered, and the answer was an error (a rejected request, an unknown job, ...).

    One type for every HTTP error, carrying the daemon's own code and message, so callers can
    branch on ``status``/``code`` and show ``str(exc)`` to a person as it is. ``status`` is 0
    for errors found on this side (an event stream that kept ending early).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        stage: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.stage = stage
        self.retry_after = retry_after
        super().__init__(status, code, message, field, stage)

    def __str__(self) -> str:
        details = [self.code, f"HTTP {self.status}"] if self.status else [self.code]  # 0: found on this side
        if self.field:
            details.append(f"field {self.field}")
        if self.stage:
            details.append(f"stage {self.stage}")
        if self.retry_after is not None:
            details.append(f"retry after {self.retry_after:g} s")
        return f"{self.message} ({', '.join(details)})"


class UpdateSplit(DaemonError):
    """``update_lora``/``update_weights``: some workers of a model applied the update and others did not
    (one refused it, or did not answer in time), so they now run different weights (HTTP 409,
    ``update_split``). The message says how many applied it and why the others did not. Nothing is wrong
    with the tensors as such: send the update again, which every worker takes as a new version."""


def update_error(status: int, code: str, message: str, field: str | None = None) -> DaemonError:
    """The exception for a refused live update: ``UpdateSplit`` for a split, else ``DaemonError``."""
    cls = UpdateSplit if code == "update_split" else DaemonError
    return cls(status, code, message, field)


class DaemonUnreachable(ClientError):
    """Nothing answers on the socket (missing, refused, or the connection died).

    The message names the path tried and how to start a daemon, because the usual cause is simply
    that none is running, or that client and daemon disagree about the path.
    """

    def __init__(self, socket_path: str, reason: str, denied: str | None = None) -> None:
        self.socket_path = socket_path
        self.reason = reason
        # the socket is there and its permissions keep this user out (EACCES): a daemon runs, another user's, and
        # "start one" would send the user to a path taken; what to do instead
        self.denied = denied
        self.not_a_socket = not_a_socket(socket_path)
        # the job ``generate`` had submitted when the daemon went away: kept in its state dir, it runs again
        # when the daemon restarts, so wait on it or cancel it rather than submit again
        self.job_id: str | None = None
        super().__init__(socket_path, reason)

    def __str__(self) -> str:
        if self.not_a_socket:  # no daemon can be started there either: serve refuses such a path
            return (
                f"{self.socket_path} is {self.not_a_socket}, not a socket: no diffusiond listens there.\n"
                "Point the client at the daemon's socket with --socket PATH or $DIFFUSIOND_SOCKET "
                "(`diffusiond socket` prints the default one)."
            )
        if self.denied is not None:
            return f"{self.socket_path} refuses this user ({self.reason}): {self.denied}"
        if self.job_id is not None:
            return (f"the daemon at {self.socket_path} went away while job {self.job_id} ran ({self.reason}). A daemon "
                    "with a state dir runs the job again when it restarts: wait for it (client.wait, `diffusiond "
                    "history`) or cancel it (`diffusiond cancel JOB_ID`), rather than submit it again")
        return (
            f"no diffusiond reachable at {self.socket_path} ({self.reason}).\n"
            f"Start one with `diffusiond serve --socket {self.socket_path}` or "
            "`systemctl --user start diffusiond.socket`,\n"
            "or point the client at a running daemon with --socket PATH or $DIFFUSIOND_SOCKET."
        )


OTHER_USER = ("the daemon listening there runs as another user, and its socket lets only that user in: run this "
              "as that user, or have the daemon started with --socket-group GROUP --socket-mode 0660 (or --allow-uid "
              f"{os.getuid()} with a socket mode that lets this user reach it)")
"""What to do about a daemon's socket that refused this user."""


def permission_denied(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or aiohttp's wrapper of one) is a socket's permissions refusing this user."""
    err = exc if isinstance(exc, OSError) and exc.errno else getattr(exc, "os_error", None)
    return isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM)


def not_a_socket(path: str) -> str | None:
    """What ``path`` is when it exists and is no socket (``a directory``, ``a regular file``), else None."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "a special file"


class ClientTimeout(ClientError, TimeoutError):
    """A request or a wait took longer than the caller allowed.

    Kept apart from DaemonUnreachable: the daemon may well be alive and busy (a long sleep, a
    queue full of work), and the job behind a timed-out wait is still there, so the message
    says what timed out and after how long rather than suggesting the daemon is gone.
    """

    def __init__(self, socket_path: str, what: str, seconds: float | None) -> None:
        self.socket_path = socket_path
        self.what = what
        self.seconds = seconds
        super().__init__(socket_path, what, seconds)

    def __str__(self) -> str:
        limit = f"longer than {self.seconds:g} s" if self.seconds is not None else "too long"
        return f"{self.what} (daemon at {self.socket_path}) took {limit}"


class JobFailed(ClientError):
    """A job ended failed or cancelled where the caller asked for its outputs.

    Carries the daemon's account (``code``, ``message``, ``stage``: where the job was when it
    ended) and the whole final ``job`` document, so a caller can tell a deadline from a bad
    prompt without parsing the message.
    """

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.job_id = str(job.get("id"))
        self.status = str(job.get("status") or "failed")
        error = job.get("error")
        err: dict[str, Any] = error if isinstance(error, dict) else {}
        self.code = str(err.get("code") or self.status)
        # an error given as a plain string is the daemon's message all the same
        said = err.get("message") if isinstance(error, dict) else error
        self.message = str(said or f"job {self.job_id} {self.status}")
        self.stage = None if err.get("stage") is None else str(err["stage"])
        super().__init__(job)

    def __str__(self) -> str:
        """One line for a person: the job named once (the daemon's message often names it already, as a
        deadline's does), then the code where it says more than the status, and the stage it ended in."""
        named = re.search(rf"\bjob {re.escape(self.job_id)}\b", self.message) is not None
        head = self.message if named else f"job {self.job_id} {self.status}: {self.message}"
        details = [self.code] if self.code != self.status else []
        if self.stage:
            details.append(f"stage {self.stage}")
        return f"{head} ({', '.join(details)})" if details else head
