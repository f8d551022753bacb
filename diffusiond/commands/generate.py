"""``diffusiond generate``: submit one job, follow it, write its outputs to files.

Kept apart from ``cli.py`` because it is the one command with real behaviour: output naming,
format inference, progress, atomic downloads and cancel-on-interrupt. The helpers are plain
functions so they can be tested without a daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import secrets
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffusiond.client import AsyncClient, ClientError, ClientTimeout, JobFailed
from diffusiond.client.handle import CANCEL_GRACE_S
from diffusiond.client.params import image_b64
from diffusiond.client.transport import SOCKET_WAIT_S
from diffusiond.commands import EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE
from diffusiond.commands.follow import LostDaemon, follow
from diffusiond.commands.preview import PREVIEW_FORMAT, PreviewPane, pane_for
from diffusiond.commands.progress import ProgressBar
from diffusiond.protocol import (
    FORMAT_OF_CONTENT_TYPE,
    FORMAT_OF_SUFFIX,
    FORMATS,
    TERMINAL_STATUSES,
    JobStatus,
)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each ends generate as Ctrl-C does: the job is cancelled (nobody will read its outputs), the exit
status is 128 + the signal, as a shell reports a process that signal ended. ``timeout 60 diffusiond
generate ...`` sends SIGTERM; a closed terminal sends SIGHUP."""


class UsageError(Exception):
    """A command-line mistake found after parsing; exits 2 like argparse's own errors."""


@dataclass
class GenerateState:
    """What an interrupt handler outside the event loop needs to cancel the right job."""

    socket_path: str
    job_id: str | None = None
    finished: bool = False
    stopped_by: int = signal.SIGINT  # the signal that stopped it: the exit status is 128 + it


OTHER_MEDIA = frozenset({".tif", ".tiff", ".bmp", ".avif", ".heic", ".heif", ".jxl", ".exr", ".mov", ".mkv", ".avi",
                         ".webm", ".mpg", ".mpeg", ".m4v"})
"""Suffixes of picture and video formats diffusiond does not write: ``-o`` naming one is refused without --format.
Any other suffix (``run.v2``) is a name, not a format, and the model's default format is written under it."""


def choose_format(fmt: str | None, output: str | None) -> str | None:
    """--format, else what -o's extension says; None lets the daemon pick its model's default.

    Not sending a format when nothing asked for one matters for video models: their default is a
    video format, which a blanket ``png`` would break.

    A ``--format`` that -o's extension contradicts (``--format mp4 -o clip.png``) is a usage
    error naming both: writing MP4 bytes under a .png name would mislead every program that
    opens the file by its name; so is an extension that names no format, without ``--format``.
    """
    named = FORMAT_OF_SUFFIX.get(Path(output).suffix.lower()) if output and not names_a_directory(output) else None
    suffix = Path(output).suffix.lower() if output and not names_a_directory(output) else ""
    if named is None and suffix in OTHER_MEDIA and not fmt:  # PNG bytes went into out.tif, silently
        known = ", ".join(sorted({f.extension for f in FORMATS.values()}))
        raise UsageError(f"-o {output}: {suffix} is not a format diffusiond writes ({known}); name the file with "
                         "one of them, or give --format to write that format under this name")
    if fmt:
        if named is not None and named != fmt:
            raise UsageError(f"--format {fmt} and -o {output} disagree ({Path(output or '').suffix} is {named}); "
                             f"name the file .{FORMATS[fmt].extension}, or leave out --format")
        return fmt
    return named


def extension_for(fmt: str | None, content_type: str | None = None) -> str:
    """The file extension for default names: the format asked for, else what was served, else png."""
    if fmt is None and content_type:
        fmt = FORMAT_OF_CONTENT_TYPE.get(content_type.split(";")[0].strip().lower())
    known = FORMATS.get(fmt) if fmt is not None else None
    return (known or FORMATS["png"]).extension


def output_paths(job_id: str, output: str | None, ext: str, count: int) -> list[Path]:
    """Where each of ``count`` outputs goes: -o PATH (or ``<job id>.<ext>``), indexed when count > 1.

    ``-o`` naming a directory (``names_a_directory``) puts default-named files in it.
    """
    if output is None or names_a_directory(output):
        base = Path(output or ".") / f"{job_id}.{ext}"
        if output is None:
            base = Path(base.name)
    else:
        base = Path(output)
    if count <= 1:
        return [base]
    return [base.with_name(f"{base.stem}-{k}{base.suffix}") for k in range(count)]


def check_output_dir(output: str | None, n: int | None = None, as_json: bool = False) -> None:
    """Fail before submitting, not after minutes of GPU time, when the outputs cannot be written. ``-o -`` is
    stdout, for one output that nothing else prints there (a file named ``-`` was written before)."""
    if output == "-":
        if (n or 1) > 1 or as_json:
            raise UsageError(f"-o - writes one output to stdout; {'--json prints there too' if as_json else f'-n {n}'}"
                             ": give a file name (-o out.png; -n N makes out-0.png, out-1.png, ...)")
        if sys.stdout.isatty():  # an image's bytes on a terminal garble it
            raise UsageError("-o - writes the output's bytes to stdout, which is a terminal here: pipe it "
                             "(-o - | display) or redirect it (-o - > out.png)")
        return
    if output is None:
        return
    if names_a_directory(output):
        if not Path(output).is_dir():
            raise UsageError(_not_a_directory(Path(output), output, output))
    elif not Path(output).parent.is_dir():
        raise UsageError(_not_a_directory(Path(output).parent, str(Path(output).parent), output))
    if refusal := _not_writable(output):
        raise UsageError(refusal)


def _not_writable(output: str) -> str | None:
    """Why -o's outputs could not be written for want of permission, found before the job rather than after
    minutes of it; None when they can (or when only trying will tell: ``download`` then says which file).
    A new or regular file is made in its directory (the temp file, renamed); anything else is written into."""
    target = Path(output)
    if names_a_directory(output):
        directory = Path(os.path.abspath(target))
    else:
        try:
            replaced = _replaced_by_rename(target)
        except OSError:
            return None
        if not replaced:
            return None if os.access(target, os.W_OK) else f"no permission to write {output!r} (-o {output})"
        directory = Path(os.path.realpath(target)).parent
    if not directory.is_dir() or os.access(directory, os.W_OK | os.X_OK):
        return None
    return (f"no permission to create files in directory {str(directory)!r} (-o {output}); "
            "give -o a path in a directory you can write to")


def _replaced_by_rename(path: Path) -> bool:
    """Whether an output at ``path`` is written beside it and renamed over it: a regular file, or none yet (a new
    file, or a symlink to one not there yet). Anything else (``/dev/null``, ``/dev/stdout``, a FIFO) is written
    into, so the check before the job and the download after it agree. An OSError other than a missing file is
    the caller's to judge."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True


def names_a_directory(output: str) -> bool:
    """``-o`` means a directory to put default-named outputs in: one that exists, or a name that says so by
    its trailing separator (``newdir/``), or ``.`` and ``..``. Path() drops the trailing separator, so
    ``-o newdir/`` once wrote a file named ``newdir``."""
    ends = tuple(sep for sep in (os.sep, os.altsep) if sep)
    return output.endswith(ends) or os.path.basename(output) in (".", "..") or Path(output).is_dir()


def _not_a_directory(directory: Path, shown: str, output: str) -> str:
    """Why ``directory`` cannot take -o's outputs: missing, or it (or a folder above it) is a file."""
    for above in (directory, *directory.parents):
        if above.exists() or above.is_symlink():
            if not above.is_dir():
                return f"{str(above)!r} is a file, not a directory (-o {output})"
            break
    return f"directory {shown!r} for -o does not exist; create it first"


def build_body(args: argparse.Namespace, fmt: str | None, pane: PreviewPane | None = None) -> dict[str, Any]:
    """The POST /v1/jobs body with only what the user gave, so the daemon's defaults stay in charge.
    Previews only when ``pane`` can show them: nobody would see them otherwise."""
    body: dict[str, Any] = {"prompt": args.prompt}
    if pane is not None and getattr(args, "preview", None):
        body["preview"] = {"every": args.preview, "format": PREVIEW_FORMAT[pane.protocol]}
    if args.size is not None:
        body["width"], body["height"] = args.size
    for key, value in (
        ("model", args.model),
        ("n", args.n),
        ("steps", args.steps),
        ("guidance_scale", args.guidance),
        ("negative_prompt", args.negative),
        ("seed", args.seed),
        ("output_format", fmt),
        ("num_frames", args.frames),
        ("fps", args.fps),
        ("audio", getattr(args, "audio", None)),  # --no-audio: False; else the model's default
        ("timeout_s", args.timeout),
        ("loras", getattr(args, "lora", None)),
        ("strength", args.strength),
        ("upscale", getattr(args, "upscale", None)),  # commands/upscale.py
        ("hires", getattr(args, "hires", None)),
        ("keep_alive", getattr(args, "keep_alive", None)),  # the daemon parses it, and names it in a 400
    ):
        if value is not None:
            body[key] = value
    pictures = args.image or []  # one is ``image``; several are one edit's ``images`` (issue 30)
    stdin: list[str] = []  # the flag that read it: stdin is read once
    for key, path in (*(("image", p) for p in pictures), ("mask", args.mask)):
        if path is not None:
            data = read_picture(f"--{key} ", path, stdin)
            if key == "image" and len(pictures) > 1:
                body.setdefault("images", []).append(data)
            else:
                body[key] = data
    for key, flag in (("control", "--control"), ("ip_adapter", "--ip-adapter")):
        for entry in getattr(args, key, None) or []:
            picture = read_picture(f"{flag} {entry['name']}:", entry["image"], stdin)
            body.setdefault(key, []).append({**entry, "image": picture})
    if args.mask is not None and args.image is None:
        raise UsageError("--mask needs --image: the mask says which part of that image to repaint")
    return body


def read_picture(flag: str, path: str, stdin: list[str]) -> str:
    """A picture flag's file as base64; ``-`` reads stdin, as ``-o -`` writes stdout, once a
    run (``stdin`` records which flag read it). ``flag`` is what the messages print before the path."""
    if not path:
        raise UsageError(f"{flag.strip()} needs a file name (or - for the picture on stdin)")
    if path != "-":
        try:
            return image_b64(path)
        except OSError as exc:
            raise UsageError(f"{flag}{path}: {exc.strerror or exc}") from None
    if stdin:
        raise UsageError(f"{flag}-: stdin is read once, and {stdin[0]}- has it already; give a file name")
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(f"{flag}- reads the picture from stdin, which is a terminal here: pipe it (cat in.png | "
                         "diffusiond generate ...) or redirect it (< in.png)")
    stdin.append(flag)
    data = sys.stdin.buffer.read()
    if not data:
        raise UsageError(f"{flag}-: stdin was empty; pipe or redirect a picture into it")
    return image_b64(data)


async def download(client: AsyncClient, job_id: str, index: int, path: Path) -> int:
    """Stream one output to a temp file beside ``path``, then rename: never a half-written file.

    Not for what is no regular file (``-o /dev/null``, ``/dev/stdout``, a FIFO): the rename put a regular
    file in its place (as root, /dev/null itself) or failed after the job, for want of a temp file in /dev; it
    is written into as it is. A symlink keeps pointing where it did: the file it names is the one replaced."""
    if not _replaced_by_rename(path):
        with open(path, "wb") as f:
            return await client.stream_output(job_id, index, f)
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
    # Not mkstemp: its 0600 would stick to the output; 0666 here lets the umask decide, as for any file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            size = await client.stream_output(job_id, index, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


async def run_generate(args: argparse.Namespace, state: GenerateState) -> int:
    """Run the job; on Ctrl-C stop waiting for it, cancel it and say so.

    The interrupt is a flag raced against the work rather than a cancellation delivered into
    it: if a library under the work swallowed the CancelledError (a read of the event stream
    that absorbs it), the cancel would be lost and Ctrl-C would hang. A second Ctrl-C stops
    waiting for the daemon to confirm the cancel.
    """
    bar = ProgressBar(sys.stderr)
    loop = asyncio.get_running_loop()
    interrupt, give_up = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        if give_up.is_set():
            raise KeyboardInterrupt  # a third: leave by the outer handler in cli.py
        if not interrupt.is_set():
            state.stopped_by = signum
        (give_up if interrupt.is_set() else interrupt).set()

    handled: list[int] = []
    try:
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, on_signal, signum)
            handled.append(signum)
    except (ValueError, RuntimeError):  # not the main thread: signals are not ours to take
        pass
    try:
        async with AsyncClient(state.socket_path) as client:
            work = asyncio.ensure_future(_generate(client, args, state, bar))
            stop = asyncio.ensure_future(interrupt.wait())
            try:
                await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                if not work.done():
                    work.cancel()
            if interrupt.is_set() and state.job_id is None:  # a submit under way: its answer names the job
                quit_now = asyncio.ensure_future(give_up.wait())
                await asyncio.wait({work, quit_now}, return_when=asyncio.FIRST_COMPLETED)
                quit_now.cancel()
            if not interrupt.is_set() or (work.done() and not work.cancelled()):
                return work.result()
            bar.close()
            code = await interrupted(client, state, give_up)
        # The client is closed now, so a work task that ignored its cancel has lost its
        # connection and ends; collect it so its exception is not reported as unretrieved.
        await asyncio.wait({work}, timeout=5.0)
        if work.done() and not work.cancelled():
            work.exception()
        return code
    finally:
        bar.close()
        for taken in handled:
            loop.remove_signal_handler(taken)


async def _generate(client: AsyncClient, args: argparse.Namespace, state: GenerateState, bar: ProgressBar) -> int:
    check_output_dir(args.output, args.n, args.json)
    fmt = choose_format(args.format, args.output)
    pane = pane_for(sys.stderr) if getattr(args, "preview", None) else None
    answered = asyncio.Event()  # clear while a POST is in flight, its answer to come
    answered.set()
    create = asyncio.ensure_future(client.create_job(build_body(args, fmt, pane), on_wait=lambda: print(
        "diffusiond is loading its models; the job is submitted as soon as it is ready", file=sys.stderr),
        on_socket_wait=lambda why: print(  # `serve &` a moment ago; else the usual error follows
            f"waiting for a daemon at {client.socket_path} ({why}; up to {SOCKET_WAIT_S:g} s) ...", file=sys.stderr),
        on_posting=lambda flight: answered.clear() if flight else answered.set()))
    try:
        job = await asyncio.shield(create)
    except asyncio.CancelledError:
        await _settle_submit(create, answered, state)
        raise
    job_id = state.job_id = str(job["id"])
    bar.job_id = job_id
    if await asleep(client):
        print(f"diffusiond is asleep: job {job_id} waits in its queue until `diffusiond wake`", file=sys.stderr)
    bar.update_from_job(job)
    try:
        # past the daemon's own deadline by the grace, so its error (with its stage) normally arrives first
        job = await follow(client, job_id, bar, None if args.timeout is None else args.timeout + CANCEL_GRACE_S, pane)
    except LostDaemon as exc:
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ClientTimeout:
        bar.close()
        if args.timeout is None:  # not the user's bound (connecting took too long): no job of theirs to cancel
            raise
        ended = await cancel_quietly(client, job_id)
        what = ("cancelled it" if ended == JobStatus.CANCELLED else f"it had {ended} meanwhile" if ended
                else f"the daemon did not confirm its cancel (`diffusiond cancel {job_id}`)")
        print(f"error: job {job_id} did not finish within {args.timeout:g} s; {what}", file=sys.stderr)
        return EXIT_FAILED
    state.finished = True
    bar.close()
    if job.get("status") != JobStatus.SUCCEEDED:
        print(f"error: {JobFailed(job)}", file=sys.stderr)
        return EXIT_FAILED

    outputs = sorted(job.get("outputs") or [], key=lambda o: int(o.get("index", 0)))
    count = max([args.n or 1, len(outputs)] + [int(o.get("index", 0)) + 1 for o in outputs])
    ext = extension_for(fmt, outputs[0].get("content_type") if outputs else None)
    stdout = args.output == "-"
    if stdout and count != 1:  # a model that made more than the one asked for: nothing written half
        print(f"error: -o - writes one output to stdout; job {job_id} made {count}: give a file name", file=sys.stderr)
        return EXIT_FAILED
    paths = output_paths(job_id, args.output, ext, count)
    files = []
    for out in outputs:
        index = int(out.get("index", 0))
        path = paths[index]
        try:
            size = await (client.stream_output(job_id, index, sys.stdout.buffer) if stdout
                          else download(client, job_id, index, path))
            if stdout:
                sys.stdout.buffer.flush()
        except ClientError:
            raise
        except BrokenPipeError:  # -o - | head: the reader went away; the job is done, nothing to say
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
            return EXIT_BROKEN_PIPE
        except OSError as exc:  # the user's disk or directory, not the daemon: say which file
            print(f"error: cannot write {path}: {exc.strerror or exc}; job {job_id} keeps its outputs in the daemon "
                  f"(GET /v1/jobs/{job_id}/outputs/{index}) until its retention ends", file=sys.stderr)
            return EXIT_FAILED
        stdout_too = not stdout and _is_stdout(path)
        files.append({"path": str(path), "seed": out.get("seed"), "bytes": size})
        if not args.json:  # with -o -, the line goes beside the bytes, to stderr
            print(f"{'stdout' if stdout else path}  seed={out.get('seed')}", flush=True,
                  file=sys.stderr if stdout or stdout_too else sys.stdout)
    if args.json:
        print(json.dumps({"job": job, "files": files}))
    return EXIT_OK


async def _settle_submit(create: asyncio.Future[dict[str, Any]], answered: asyncio.Event, state: GenerateState) -> None:
    """Interrupted while submitting. With a POST in flight the daemon may have admitted the job, and only its
    answer names it: given a moment to come, the id lets ``interrupted`` cancel the job; lost, it ran for nobody.
    Between POSTs (a daemon still starting, a socket not bound yet) nothing was admitted: the submit stops at
    once, as it would otherwise offer the job again, and a job admitted then would run for nobody."""
    if not answered.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(answered.wait(), CANCEL_GRACE_S)
    if not create.done():  # between offers, or past the grace: no further offer
        create.cancel()
        await asyncio.wait({create}, timeout=CANCEL_GRACE_S)  # bounded: a cancel swallowed below must not hang
    if create.done() and not create.cancelled() and create.exception() is None:
        with contextlib.suppress(KeyError, TypeError):
            state.job_id = str(create.result()["id"])


def _is_stdout(path: Path) -> bool:
    """Whether ``path`` is where stdout goes (``-o /dev/stdout | convert - ...``, as ``-o -``): the line naming
    it then goes to stderr, not after the output's bytes into the pipe or file that reads them."""
    try:
        here, there = os.fstat(sys.stdout.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return os.path.samestat(here, there) and (stat.S_ISFIFO(here.st_mode) or stat.S_ISREG(here.st_mode))


async def asleep(client: AsyncClient) -> bool:
    """Whether the daemon sleeps (``diffusiond sleep``): it admits the job and queues it until a
    wake, so without a word generate would wait in silence. A health report that cannot be read
    says nothing either way."""
    try:
        return bool((await client.health()).get("sleeping"))
    except ClientError:
        return False


async def cancel_quietly(client: AsyncClient, job_id: str, give_up: asyncio.Event | None = None) -> str | None:
    """Best-effort cancel on the way out (``AsyncClient.cancel_soon``: bounded, and a job that had already ended
    is asked for, so the user is told what became of it, not that the daemon "did not confirm"); the status the
    job ended with, None when unknown. ``give_up`` (a second Ctrl-C) ends the wait at once, the cancel with it:
    left running, it held the client's close for its few seconds."""
    call = client.cancel_soon(job_id)
    stop = asyncio.ensure_future(give_up.wait()) if give_up is not None else None
    try:
        await asyncio.wait({call} if stop is None else {call, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (call, stop):
            if task is not None and not task.done():
                task.cancel()
    job = call.result() if call.done() and not call.cancelled() and call.exception() is None else None
    status = None if job is None else str(job.get("status") or JobStatus.CANCELLED)
    return status if status in TERMINAL_STATUSES else None


async def interrupted(client: AsyncClient, state: GenerateState, give_up: asyncio.Event | None = None) -> int:
    """Ctrl-C (or SIGTERM, SIGHUP): cancel the job (no point computing for nobody) and say what
    became of it; the exit status is 128 + the signal."""
    code = 128 + int(state.stopped_by)
    if state.job_id is None:
        print("interrupted", file=sys.stderr)
    elif state.finished:
        print(f"interrupted; job {state.job_id} had already finished", file=sys.stderr)
    else:
        ended = await cancel_quietly(client, state.job_id, give_up)
        state.finished = True
        if ended == JobStatus.CANCELLED:
            print(f"cancelled job {state.job_id}", file=sys.stderr)
        elif ended is not None:
            print(f"interrupted; job {state.job_id} had already {ended}", file=sys.stderr)
        else:
            print(f"interrupted; the daemon did not confirm the cancel of job {state.job_id}: "
                  f"`diffusiond cancel {state.job_id}` cancels it if it still runs", file=sys.stderr)
    return code


async def cancel_after_interrupt(state: GenerateState) -> int:
    """The same, for a KeyboardInterrupt that landed outside the event loop's own handling."""
    async with AsyncClient(state.socket_path) as client:
        return await interrupted(client, state)
