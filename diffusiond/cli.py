"""The ``diffusiond`` command: ``serve`` starts a daemon; every other command is a client of one.

The commands and exit codes are the contract in docs/api.md ("Command line"), because scripts branch
on them; ``commands/__init__.py`` names the codes. Client commands go through ``diffusiond.client``
like any other program would. Nothing imported at module level loads torch, diffusers, numpy, Pillow
or PyAV (a test holds it), and neither the daemon's configuration nor the server is imported until
``serve`` runs, so client commands and ``--help`` start in a fraction of the time a torch import
takes.

Output piped into a program that stops reading (``diffusiond status | head -1``) ends the command
quietly with exit 141 (128 + SIGPIPE): what a shell reports for any other tool killed by that
signal, so a ``set -o pipefail`` script sees the same from this one, and no traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from diffusiond import __version__
from diffusiond.client import AsyncClient, ClientError, ClientTimeout, DaemonUnreachable
from diffusiond.commands import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    residency,
)
from diffusiond.commands.admin import cancel, history, models, sleep, status, wake, web_url
from diffusiond.commands.argtypes import (
    HISTORY_MAX_LIMIT,
    control_arg,
    dash_values,
    finite_float,
    int_between,
    ip_adapter_arg,
    job_id_arg,
    lora_arg,
    non_negative_float,
    parse_size,
    positive_float,
    positive_int,
    whole_number,
)
from diffusiond.commands.flags import with_flag
from diffusiond.commands.follow import lost_daemon
from diffusiond.commands.generate import GenerateState, UsageError, cancel_after_interrupt, run_generate
from diffusiond.commands.upscale import hires_arg, upscale_arg
from diffusiond.protocol import (
    BATCH_SIZES,
    COMPILE_MODES,
    DEFAULT_WEB_ADDRESS,
    FORMATS,
    LOG_LEVELS,
    JobStatus,
    default_socket_path,
)

QUICK_TIMEOUT_S = 30.0
"""Bound for requests that should answer at once (status, models, cancel): a hung daemon is an error."""

SERVE_FIELDS = (
    "socket", "model", "device", "workers", "dtype", "max_batch", "batch_wait_ms", "batch_sizes", "queue_size",
    "job_timeout_s", "output_mode", "arena_mb", "tcp", "token_file", "log_level", "socket_mode",
    "socket_group", "allow_uid", "retention_s", "drain_grace_s", "orphan_grace_s", "png_compress_level",
    "encode_threads", "fault",
    "slot_timeout_s", "stream_stall_s", "trace", "web", "input_dir", "compile", "warmup", "lora", "max_loras",
    "preview_decoder", "controlnet", "ip_adapter", "upscaler",
    "state_dir", "persist", "reset_state", "keep_days", "keep_gb", "retention_check_s", "state_fault", "state_sync",
    "keep_alive", "max_keep_alive", "device_memory", "host_memory", "pin", "offload",
    "reserve_memory", "preload", "max_model_wait", "preimport",
)  # fmt: skip
"""Flags of ``serve`` that map one to one onto DaemonConfig fields (see daemon/config.py)."""



def octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an octal mode such as 0600 or 660, got {text!r}") from None
    if not 0 <= mode <= 0o7777:
        raise argparse.ArgumentTypeError(f"mode {text!r} is out of range")
    return mode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusiond", description="A local generation daemon for diffusion models.")
    parser.add_argument("--version", action="version", version=f"diffusiond {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sock = argparse.ArgumentParser(add_help=False)
    sock.add_argument(
        "--socket", metavar="PATH", help="daemon socket (default: $DIFFUSIOND_SOCKET, then the runtime directory)"
    )
    _add_serve(sub)

    g = sub.add_parser("generate", parents=[sock], help="generate images or videos and write them to files")
    g.add_argument("prompt", metavar="PROMPT")
    g.add_argument("-o", "--output", metavar="PATH",
                   help="output file (default: <job id>.<ext>; -n N adds -0, -1, ...); - writes one output to stdout")
    own = "the model's own, in diffusiond models' defaults column"
    g.add_argument("--model", metavar="NAME", help="a model the daemon serves (default: the first it serves; "
                                                   "diffusiond models lists them)")
    g.add_argument("-n", type=positive_int, metavar="N", help="number of outputs (default 1)")
    g.add_argument("--size", type=parse_size, metavar="WxH", help=f"output width x height (default: {own})")
    g.add_argument("--steps", type=positive_int, metavar="N", help=f"denoising steps (default: {own})")
    g.add_argument("--guidance", type=finite_float, metavar="G", help=f"guidance scale (default: {own})")
    g.add_argument("--negative", metavar="TEXT", help="negative prompt")
    g.add_argument("--seed", type=whole_number, metavar="S", help="the same seed and settings make the same output "
                                                         "(default: a random one, printed with each file)")
    g.add_argument("--format", choices=tuple(FORMATS),
                   help="output format (default: from -o's extension, else the model's own: png for images, mp4 "
                        "for videos)")
    g.add_argument("--frames", type=positive_int, metavar="N", help="number of frames (video models)")
    g.add_argument("--fps", type=positive_int, metavar="N", help=f"frames per second of a video (default: {own})")
    g.add_argument("--no-audio", dest="audio", action="store_const", const=False,
                   help="leave out the sound track of a model that makes one (LTX-2); an mp4 then has none")
    g.add_argument("--timeout", type=positive_float, metavar="S", help="give up (and cancel) after S seconds")
    g.add_argument("--preview", nargs="?", const=1, type=positive_int, metavar="N",
                   help="show the picture every N steps (default 1) while it forms, in terminals that show images "
                        "(kitty, iTerm2, WezTerm); elsewhere nothing extra")
    g.add_argument("--lora", action="append", type=lora_arg, metavar="NAME[:WEIGHT]",
                   help="apply a LoRA the daemon serves (see GET /v1/loras), weight 1 if left out; repeatable")
    g.add_argument("--control", action="append", type=control_arg, metavar="NAME[@MODE]:IMAGE[:SCALE]",
                   help="steer by a ControlNet the daemon serves (see GET /v1/controlnets) and a picture for it, "
                        "scale 1 if left out; @MODE: a union ControlNet's mode, by number or by the name the "
                        "daemon lists; repeatable")
    g.add_argument("--ip-adapter", action="append", type=ip_adapter_arg, metavar="NAME:IMAGE[:SCALE]",
                   help="steer by a reference picture through an IP-Adapter the daemon serves "
                        "(see GET /v1/ip-adapters), scale 1 if left out; repeatable (up to 4 act together)")
    g.add_argument("--upscale", type=upscale_arg, metavar="NAME[:SCALE]",
                   help="every output through an upscaler the daemon serves (see GET /v1/upscalers), at its own "
                        "scale unless SCALE is given")
    g.add_argument("--hires", type=hires_arg, metavar="SCALE[:STRENGTH[:STEPS[:UPSCALER]]]",
                   help="a second, image-to-image pass at SCALE times the size (strength 0.5 and the same steps "
                        "unless given; the picture made larger by UPSCALER, else bicubic)")
    g.add_argument("--image", action="append", metavar="FILE",
                   help="edit this image (image-to-image; inpainting with --mask); repeat it for a model that edits "
                        "from several pictures (max_input_images in GET /v1/models): Picture 1, 2, ... in order")
    g.add_argument("--mask", metavar="FILE",
                   help="inpaint: repaint where this PNG is transparent (or white, in a mask without alpha)")
    g.add_argument("--strength", type=finite_float, metavar="S",
                   help="how much of --image to repaint, in (0, 1] (default 0.8; 1.0 with --mask)")
    g.add_argument("--keep-alive", metavar="DURATION",
                   help="how long the model stays on its device after this job: 10m, 1h30m, seconds, 0 (leave "
                        "at once) or -1 (forever); the daemon caps it by its --max-keep-alive")
    g.add_argument("--json", action="store_true", help="print one JSON object with the job and the files")

    s = sub.add_parser("status", parents=[sock], help="show the daemon's health, workers and queue")
    s.add_argument("--json", action="store_true")
    s.add_argument("--wait", type=non_negative_float, metavar="SECONDS", default=0.0,
                   help="first wait up to this long for the daemon to be up and ready (for scripts that start one)")
    s.set_defaults(func=status)
    m = sub.add_parser("models", parents=[sock], help="list every model the daemon serves, loaded or not")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=models)
    c = sub.add_parser("cancel", parents=[sock], help="cancel a queued or running job")
    c.add_argument("job_id", type=job_id_arg, metavar="JOB_ID")
    c.set_defaults(func=cancel)
    h = sub.add_parser("history", parents=[sock], help="list jobs, newest first (kept across restarts)")
    h.add_argument("--status", choices=[st.value for st in JobStatus])
    h.add_argument("--model", metavar="NAME")
    h.add_argument("--before", metavar="JOB_ID", help="the jobs admitted before this one (the next page)")
    h.add_argument("--limit", type=int_between(1, HISTORY_MAX_LIMIT), default=20, metavar="N",
                   help=f"at most N jobs, 1 to {HISTORY_MAX_LIMIT} (default 20)")
    h.add_argument("--json", action="store_true", help="the daemon's page as JSON")
    h.set_defaults(func=history)
    p = sub.add_parser("ps", parents=[sock], help="show where each model is: device, host memory or disk, until when")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=residency.ps)
    p = sub.add_parser("load", parents=[sock], help="bring a model onto its device now")
    p.add_argument("model", metavar="NAME")
    p.set_defaults(func=residency.load)
    p = sub.add_parser("unload", parents=[sock], help="take a model off its device once its work is done")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("model", metavar="NAME", nargs="?")
    which.add_argument("--all", action="store_true", help="every model")
    p.set_defaults(func=residency.unload)
    p = sub.add_parser("sleep", parents=[sock], help="drain, then free device memory")
    p.add_argument("--level", type=int, choices=(1, 2), default=1,
                   help="1: weights to host memory, a fast wake (default); 2: stop the workers, freeing all they "
                        "held (CUDA contexts too); wake then loads from the files")
    p.set_defaults(func=sleep)
    sub.add_parser("wake", parents=[sock], help="take device memory back and reload").set_defaults(func=wake)
    sub.add_parser("web-url", parents=[sock], help="print the web page's sign-in URL (serve --web)").set_defaults(
        func=web_url)
    # $RUNTIME_DIRECTORY is left out: only serve reads it (protocol.default_socket_path says why)
    where = ("print the socket path the other commands use (--socket, $DIFFUSIOND_SOCKET, "
             "$XDG_RUNTIME_DIR/diffusiond, else /tmp/diffusiond-$UID)")
    sub.add_parser("socket", parents=[sock], help=where, description=where)
    from diffusiond.bench import add_parser as add_bench

    add_bench(sub)
    _add_fit(sub)
    return parser


def _add_fit(sub: Any) -> None:
    """``fit``'s flags; the command itself is daemon/residency/fit_command.py (it reads files, not a socket)."""
    p = sub.add_parser("fit", help="list the configurations of a model that fit a device, from its files' headers")
    p.add_argument("spec", metavar="SPEC",
                   help="a diffusers folder, a hub id in the HF cache, a .safetensors file, or FILE.gguf,base=FOLDER "
                        "(Wan 2.2 A14B: HIGH.gguf,base=FOLDER,transformer_2=LOW.gguf)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="the device budget (24GiB, or 0.8 of the device's total); without it, only list")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="the dtype the model would be loaded at (default: serve's for --device: bfloat16 on cuda, "
                        "float32 on cpu)")
    p.add_argument("--working", metavar="SIZE",
                   help="working memory counted beside the weights (default: residency's estimate at --size; 0: none)")
    p.add_argument("--size", default="1024x1024", metavar="WxH", help="output size of the working estimate (1024x1024)")
    p.add_argument("--batch", default="1", metavar="N",
                   help="images in one forward for the working estimate (1; the daemon batches up to --max-batch)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default), or cpu: nothing can be offloaded there, so only resident ones are listed")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=None)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    add = p.add_argument
    add("--config", metavar="FILE", help="TOML file; flags override its values")
    add("--socket", metavar="PATH",
        help="the Unix socket to listen on (default: $DIFFUSIOND_SOCKET, then the runtime directory)")
    add("--model", action="append", metavar="SPEC",
        help="tiny, a folder, a hub id, a .safetensors file or FILE.gguf,base=FOLDER[,transformer_2=LOW.gguf]; "
             "NAME=SPEC")
    add("--device", metavar="DEV", help="auto (the default: every GPU torch can use, else cpu), cpu, cuda (every "
        "GPU) or cuda:0,cuda:1")
    add("--workers", type=positive_int, metavar="N", help="workers per model on cpu")
    add("--dtype", metavar="DTYPE",
        help="float32, float16 or bfloat16 (default: bfloat16 on a GPU, float32 on the CPU)")
    add("--max-batch", type=int, metavar="N",
        help="the most outputs one forward runs (4), for every model without its own max_batch in the config file")
    add("--batch-wait-ms", type=finite_float, metavar="MS",
        help="how long a batch waits for more requests it could run with (0: it runs at once)")
    add("--batch-sizes", choices=BATCH_SIZES,
        help="batch sizes that form: auto (default: powers of two up to --max-batch for compiled models, any "
             "size for eager ones), pow2 or any, for every model without its own batch_sizes in the config file")
    add("--queue-size", type=int, metavar="N", help="jobs that may wait to run; past it new jobs are refused (256)")
    add("--job-timeout", dest="job_timeout_s", type=finite_float, metavar="S",
        help="a job not done within S seconds fails, naming the stage it was in (600)")
    add("--output-mode", metavar="MODE",
        help="async (outputs copied and encoded while the next forward runs; default) or sync (to measure against)")
    add("--arena-mb", type=int, metavar="MB",
        help="each worker's shared memory for outputs; a larger one gets memory of its own (512)")
    add("--tcp", metavar="HOST:PORT", help="also listen on TCP (needs --token-file)")
    add("--token-file", metavar="FILE", help="the token of --tcp and --web (at least 16 characters)")
    add("--web", nargs="?", const=DEFAULT_WEB_ADDRESS, metavar="HOST:PORT",
        help=f"serve the web page and the API on TCP behind a token (default {DEFAULT_WEB_ADDRESS})")
    add("--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LEVEL", help=", ".join(LOG_LEVELS))
    add("--socket-mode", type=octal_mode, metavar="MODE", help="octal, default 0600")
    add("--socket-group", metavar="GROUP", help="the socket's group (with --socket-mode 0660 its members connect)")
    add("--allow-uid", action="append", type=int, metavar="UID", help="repeatable; checked with SO_PEERCRED")
    add("--retention-s", type=finite_float, metavar="S", help="how long a finished job stays in memory (600)")
    add("--drain-grace-s", type=finite_float, metavar="S", help="on SIGTERM, how long running jobs get to finish (30)")
    add("--orphan-grace-s", type=finite_float, metavar="S",
        help="a worker still computing a batch whose jobs all ended (cancelled, past their deadline) this long, "
             "while other jobs wait for its model, is killed and replaced so the model serves again (60; 0: never)")
    add("--png-compress-level", type=int, metavar="N", help="0-9: smaller PNGs against encoding time (4)")
    add("--encode-threads", type=int, metavar="N", help="threads that encode outputs (the CPU count, at most 4)")
    add("--slot-timeout-s", type=finite_float, metavar="S", help="how long a copy waits for a free arena slot (30)")
    add("--stream-stall-s", type=finite_float, metavar="S", help="close an output download stalled this long (120)")
    add("--input-dir", metavar="DIR",
        help="edits on /v1/jobs may name input images by path, only inside DIR (default: no paths)")
    add("--trace", action="store_true", default=None,
        help="keep a timeline of forwards and copies (CUDA-timed on GPUs) at GET /v1/admin/trace")
    add("--preview-decoder", metavar="PATH",
        help="a diffusers AutoencoderTiny folder (TAESD) to draw previews with (default: linear latent factors)")
    add("--lora", action="append", metavar="NAME=PATH",
        help="serve a LoRA adapter: a folder written by save_lora_weights or a .safetensors file "
             "(diffusers or kohya layout); repeatable")
    add("--controlnet", action="append", metavar="NAME=PATH[,modes=A:B:...]",
        help="serve a ControlNet: a diffusers ControlNet folder or a .safetensors file; a union one's modes "
             "named in the order of their numbers (modes=canny:tile:depth), so requests may name them; repeatable")
    add("--ip-adapter", action="append", metavar="NAME=PATH[,image_encoder=DIR]",
        help="serve an IP-Adapter: its .safetensors weights file (or a folder holding one) and its image "
             "encoder, image_encoder/ beside the file unless given; repeatable")
    add("--upscaler", action="append", metavar="NAME=PATH[,tile=N][,overlap=N]",
        help="serve a super-resolution model (ESRGAN and others spandrel reads): a .pth or .safetensors "
             "file, run in tiles of N input pixels (512; 0: the whole picture) that share overlap pixels "
             "(32); repeatable")
    add("--max-loras", type=positive_int, metavar="N",
        help="LoRA adapters each worker keeps loaded, and the most one request may name (8)")
    add("--state-dir", metavar="DIR",
        help="jobs and outputs kept across restarts (default: $XDG_STATE_HOME/diffusiond, ~/.local/state/diffusiond)")
    add("--no-persist", dest="persist", action="store_false", default=None,
        help="keep jobs and outputs in memory only: a restart loses them")
    add("--reset-state", action="store_true", default=None,
        help="move a corrupt or foreign state database aside and start with an empty one")
    add("--state-sync", choices=("normal", "full"),
        help="normal: accepted jobs survive any daemon crash; full: a power cut too (an fsync per job)")
    add("--keep-days", type=finite_float, metavar="D", help="delete finished jobs and their outputs after D days")
    add("--keep-gb", type=finite_float, metavar="GB", help="delete the oldest finished jobs while outputs take more")
    add("--retention-check-s", type=finite_float, help=argparse.SUPPRESS)
    add("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
        help="torch.compile every model (MODE: " + ", ".join(COMPILE_MODES) + "; default: default); "
             "reduce-overhead replays CUDA graphs")
    add("--warmup", metavar="WxH:B,...", help="shapes each worker runs before it is ready, e.g. 512x512:1,512x512:8; "
        "WxH:all: every batch size that forms at WxH (compiled models)")
    add("--keep-alive", metavar="DURATION",
        help="how long a model nobody uses stays on its device: 5m (default), 30s, 1h; 0 leaves at once, -1 stays")
    add("--max-keep-alive", metavar="DURATION", help="the longest keep_alive a request may ask for (default: any)")
    add("--device-memory", metavar="SIZE",
        help="what models on one device may take (20GiB, or 0.8 of its total); idle models leave to make room "
             "(default: its free memory at start less --reserve-memory)")
    add("--host-memory", metavar="SIZE", help="weights kept in host memory off their devices (default: no bound)")
    add("--reserve-memory", metavar="SIZE",
        help="free memory left to other programs on each GPU: below it idle models leave and new jobs wait (1GiB)")
    add("--max-model-wait", metavar="DURATION",
        help="the longest a job waits behind another model's jobs for their device before that model yields it: "
             "30s (default), 2m; -1: no bound")
    add("--pin", action="append", metavar="NAME", help="this model never leaves its device for another; repeatable")
    add("--preload", action="append", metavar="NAME|all|none",
        help="models the start loads (repeatable or a,b); the others load when a job needs them "
             "(default: those that fit, in order; none when systemd socket-activates the daemon)")
    add("--offload", choices=("none", "model", "group", "sequential", "stream", "auto"), metavar="MODE",
        help="what of every model stays on its device: none, model, group (blocks streamed in), sequential, "
             "stream (the blocks --device-memory has room for stay, the rest stream through a ring), or "
             "auto (the fastest that fits --device-memory, from the files' headers; see diffusiond fit)")
    add("--preimport", choices=("auto", "on", "off"),
        help="fork workers from a template process that imported torch, diffusers and transformers once, as the "
             "daemon started, rather than start each as a fresh interpreter (seconds of imports on every model "
             "load and restart): on, off, or auto (the default: CPU and CUDA workers)")
    add("--test-fault", dest="fault", help=argparse.SUPPRESS)  # fault injection for the test suite only
    add("--test-state-fault", dest="state_fault", help=argparse.SUPPRESS)
    p.set_defaults(func=None)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit, where a broken pipe is a message on stderr and exit 120
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    return code


def _quiet_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's own flush at exit finds nowhere to fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a real file (tests capture it): nothing will flush it
        pass


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(dash_values(parser, sys.argv[1:] if argv is None else argv))
        if extras:
            unknown_arguments(parser, args.command, extras)
    except SystemExit as exc:  # argparse's own usage errors (2), --help and --version (0)
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USAGE)
    if args.command == "socket":  # what a script puts in S=$(diffusiond socket) for curl --unix-socket
        print(args.socket or default_socket_path())
        return EXIT_OK
    if args.command == "serve":
        return serve(args)
    if args.command == "fit":  # reads files, no daemon: headers only, no torch
        from diffusiond.daemon.residency.fit_command import run as run_fit

        return run_fit(args)
    if args.command == "bench":
        from diffusiond.bench import run as run_bench

        return run_bench(args)
    socket_path = args.socket or default_socket_path()
    try:
        if args.command == "generate":
            return _generate(args, socket_path)
        # sleep drains running jobs and wake reloads models: both may rightly take minutes.
        timeout = None if args.command in ("sleep", "wake", "load", "unload") else QUICK_TIMEOUT_S
        return _run(args.func(args, AsyncClient(socket_path, timeout)))
    except UsageError as exc:
        print(f"diffusiond {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (DaemonUnreachable, ClientTimeout) as exc:  # a daemon that stopped answering is not reachable
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ClientError as exc:  # DaemonError: the daemon answered, and refused (generate's: with the field's flag)
        shown = (with_flag(str(exc), getattr(exc, "field", None), None if args.format else args.output)
                 if args.command == "generate" else str(exc))
        print(f"error: {shown}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def unknown_arguments(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> None:
    """Arguments the command does not take: its own usage, not the top level's (argparse's default
    for a subcommand), and the nearest flag it has, as ``git`` does: ``--sise`` -> ``--size``."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = commands.choices[command]
    flags = [f for a in sub._actions for f in a.option_strings if f.startswith("--")]
    hints = [f"{e} -> {close[0]}" for e in extras if e.startswith("-")
             for close in [difflib.get_close_matches(e.split("=", 1)[0], flags, n=1, cutoff=0.6)] if close]
    sub.error(f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))


def _run(coro: Coroutine[Any, Any, int]) -> int:
    import uvloop  # here: --help and usage errors never need an event loop

    return uvloop.run(coro)


def serve(args: argparse.Namespace) -> int:
    """Validate the whole configuration before anything starts, then run the daemon until it stops."""
    from diffusiond.daemon.config import ConfigError, build_config, load_toml

    overrides = {name: getattr(args, name) for name in SERVE_FIELDS if getattr(args, name) is not None}
    try:
        file_values = load_toml(args.config) if args.config else {}
        config = build_config(file_values, overrides)
    except (ConfigError, ValueError, TypeError) as exc:
        print(f"diffusiond serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from diffusiond.daemon.server import serve as run_server  # heavy: engine, workers

    return int(run_server(config) or 0)


def _generate(args: argparse.Namespace, socket_path: str) -> int:
    state = GenerateState(socket_path)
    try:
        return _run(run_generate(args, state))
    except DaemonUnreachable:
        if state.job_id is None:  # it never answered: "start one" is the right advice
            raise
        # It answered a moment ago and took the job: not "start one".
        print(f"error: {lost_daemon(state.job_id, state.finished)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        # Ctrl-C outside the loop's own handling (e.g. a second one): still cancel the job.
        if state.job_id is not None and not state.finished:
            try:
                return _run(cancel_after_interrupt(state))
            except KeyboardInterrupt:
                pass
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
