"""The application builder: ``serve run diffusiond.ray:build model=sd=/models/sd15 replicas=2 gpus_per_replica=1``.

The arguments are strings from ``serve run`` or typed values from a ``serve deploy`` YAML; both
go through ``Options.parse``, which names the argument and what it accepts when one is wrong
(before any replica starts, so a typo is one line, not a crashed deployment).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import shlex
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from diffusiond.ray.auth import exposure_refusal, read_token

ARGS_HELP = {
    "model": "model spec(s) for `diffusiond serve --model`, comma-separated (default tiny, or with config the "
             "file's models)",
    "replicas": "a number of replicas, or 'auto' to scale on the daemons' queue length (default 1)",
    "min_replicas": "with replicas=auto: the fewest replicas, 0 scales to zero (default 1)",
    "max_replicas": "with replicas=auto: the most replicas (default 4)",
    "target_load": "with replicas=auto: jobs queued or running per replica to aim for (default 4)",
    "gpus_per_replica": "GPUs Ray gives each replica's daemon (default 0)",
    "cpus_per_replica": "CPUs Ray reserves for each replica (default 1)",
    "device": "the daemon's --device (default cuda with GPUs, else cpu)",
    "config": "a TOML file for the daemon's --config (the same DaemonConfig as on one machine)",
    "daemon_args": "further `diffusiond serve` flags, as one shell-quoted string",
    "max_ongoing_requests": "requests in flight per replica before Serve queues at the router (default 64)",
    "batch_affinity": "batchable requests stay on one replica while its queue is shorter than this (default 4)",
    "health_check_period_s": "how often Serve asks each replica's daemon /health (default 10)",
    "start_timeout_s": "how long a replica waits for its daemon to load its models (default 600)",
    "model_affinity": "new work goes to a replica with its model on the device while its queue is shorter "
                      "than this (default 8)",
    "token_file": "a file holding the bearer token clients must send (on every node)",
    "token_env": "an environment variable holding the bearer token clients must send (on every node)",
    "allow_unauthenticated": "true to serve without a token behind a proxy bound beyond loopback (default false)",
    "shared_state_dir": "a state dir on a volume every replica mounts: each daemon keeps PATH/<replica id>, and a "
                        "replica adopts the jobs of one that is gone (none)",
    "resources_per_replica": "Ray custom resources each replica needs, NAME=AMOUNT comma-separated "
                             "(to place replicas on chosen nodes; none)",
}


@dataclass(frozen=True)
class Options:
    model: tuple[str, ...] | None = None  # None: tiny, or the config file's own models
    replicas: int | None = 1  # None: autoscaling
    min_replicas: int = 1
    max_replicas: int = 4
    target_load: float = 4.0
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    device: str | None = None
    config: str | None = None
    daemon_args: tuple[str, ...] = field(default=())
    max_ongoing_requests: int = 64
    batch_affinity: int = 4
    health_check_period_s: float = 10.0
    start_timeout_s: float = 600.0
    model_affinity: int = 8
    token_file: str | None = None
    token_env: str | None = None
    allow_unauthenticated: bool = False
    shared_state_dir: str | None = None
    resources_per_replica: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Options:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown argument(s) {', '.join(unknown)}; diffusiond.ray:build takes: "
                             + "; ".join(f"{k}: {v}" for k, v in ARGS_HELP.items()))
        values: dict[str, Any] = {}
        for name, raw in args.items():
            values[name] = _convert(name, raw)
        opts = cls(**values)
        flags = {a.split("=", 1)[0] for a in opts.daemon_args}  # --state-dir=DIR is --state-dir DIR to the daemon
        if opts.shared_state_dir is not None and ({"--state-dir", "--no-persist"} & flags):
            raise ValueError(f"shared_state_dir={opts.shared_state_dir!r} and --state-dir or --no-persist in "
                             "daemon_args: give the state dir one way (shared_state_dir gives each replica "
                             "PATH/<replica id>)")
        if opts.replicas is None and not 0 <= opts.min_replicas <= opts.max_replicas:
            raise ValueError(f"min_replicas={opts.min_replicas} and max_replicas={opts.max_replicas}: "
                             "need 0 <= min_replicas <= max_replicas")
        autoscaling = [name for name in AUTOSCALING_ONLY if name in args]
        if opts.replicas is not None and autoscaling:
            raise ValueError(f"{', '.join(autoscaling)} with replicas={opts.replicas}: they bound autoscaling, which "
                             "runs only with replicas=auto; give replicas=auto, or leave them out for a fixed count")
        check_daemon_command(opts)
        return opts

    def serve_args(self) -> list[str]:
        """The daemon's command line after ``diffusiond serve --socket PATH``."""
        out: list[str] = []
        if self.config:
            out += ["--config", self.config]
        # a config file's [[models]] are its own unless `model` replaces them (--model does, as on one machine)
        for m in self.model if self.model is not None else () if self.config else ("tiny",):
            out += ["--model", m]
        device = self.device or ("cuda" if self.gpus_per_replica > 0 else "cpu")
        given = {a.split("=", 1)[0] for a in self.daemon_args}
        if self.shared_state_dir is not None and "--state-sync" not in given:
            # a lost node is a power cut to its store: with `normal` the jobs it accepted last may not be there for
            # the replica that adopts them (docs/scaling.md)
            out += ["--state-sync", "full"]
        return [*out, "--device", device, *self.daemon_args]

    def stop_timeout_s(self) -> float:
        """How long a replica's stop waits for its daemon before it kills it: the daemon's drain grace, then its
        workers' stop. Read from the flags; a config file's ``drain_grace_s`` is on the replicas' nodes, not here."""
        from diffusiond.ray.replica import STOP_TIMEOUT_S, WORKER_STOP_S

        grace = _parse_serve(self.serve_args(), "the daemon's command line").drain_grace_s
        return STOP_TIMEOUT_S if grace is None else max(STOP_TIMEOUT_S, float(grace) + WORKER_STOP_S)


def _convert(name: str, raw: Any) -> Any:
    def bad(what: str) -> ValueError:
        return ValueError(f"{name}={raw!r}: expected {what} ({ARGS_HELP[name]})")

    if name == "model":
        items = raw if isinstance(raw, list) else str(raw).split(",")
        models = tuple(str(m).strip() for m in items if str(m).strip())
        if not models:
            raise bad("at least one model spec")
        return models
    if name == "daemon_args":
        return tuple(raw) if isinstance(raw, list) else tuple(shlex.split(str(raw)))
    if name in ("device", "config", "token_file", "token_env", "shared_state_dir"):
        return str(raw)
    if name == "resources_per_replica":
        return _resources(raw, bad)
    if name == "allow_unauthenticated":
        if isinstance(raw, bool):
            return raw
        if str(raw).strip().lower() in ("true", "1", "yes", "false", "0", "no"):
            return str(raw).strip().lower() in ("true", "1", "yes")
        raise bad("true or false")
    if name == "replicas" and str(raw).strip().lower() == "auto":
        return None
    integer = name in ("replicas", "min_replicas", "max_replicas", "max_ongoing_requests", "batch_affinity",
                       "model_affinity")
    try:
        value = int(str(raw)) if integer else float(str(raw))
    except ValueError:
        raise bad("an integer" if integer else "a number") from None
    if not math.isfinite(value):  # nan passed every bound below, and Ray or Serve refused it in a traceback
        raise bad("a finite number")
    low = 1 if name in ("replicas", "max_replicas", "max_ongoing_requests", "batch_affinity", "model_affinity") else 0
    if value < low or (name in ("health_check_period_s", "start_timeout_s", "target_load") and value <= 0):
        raise bad(f"a value >= {low}" if value < low else "a positive number")
    return value


AUTOSCALING_ONLY = ("min_replicas", "max_replicas", "target_load")
# flags of `diffusiond serve` the replica sets itself: given again in daemon_args the later one won, and the
# replica waited start_timeout_s for a daemon on its own socket that listened elsewhere
REPLICA_OWNS = {
    "--socket": "the replica starts its daemon on a private socket of its own and speaks to it there",
    # on every replica: the second on a node cannot bind the address, and each opens the whole API beside the gateway
    "--web": "the gateway is the way in through Ray; use one daemon's own --web on a workstation",
    "--tcp": "the gateway is the way in through Ray (Serve's proxy, behind token_file or token_env)",
}
# Serve's graceful shutdown waits this much past the replica's own stop, for the replica to end after its daemon.
SHUTDOWN_MARGIN_S = 30.0


def check_daemon_command(opts: Options) -> None:
    """Refuse, when the application is built, a daemon command line that cannot work: read by the daemon's own
    parser, so a typo in ``daemon_args`` is one line here and not a daemon that exits in every replica Serve
    starts and retries; and a CUDA device the replica's GPUs cannot give. Paths (models, ``config``) are not
    looked at: they are on the replicas' nodes, which need not be the one that builds."""
    owned = [a for a in opts.daemon_args if a.split("=", 1)[0] in REPLICA_OWNS]
    if owned:
        flag = owned[0].split("=", 1)[0]
        raise ValueError(f"daemon_args={shlex.join(opts.daemon_args)!r}: {flag} is not for daemon_args: "
                         f"{REPLICA_OWNS[flag]}; leave it out")
    _parse_serve(list(opts.daemon_args), f"daemon_args={shlex.join(opts.daemon_args)!r}")
    whole = _parse_serve(opts.serve_args(), "the daemon's command line (model, device, config, daemon_args)")
    device = str(whole.device or "")
    parts = [d.strip() for d in device.split(",") if d.strip().startswith("cuda")]
    gpus = math.ceil(opts.gpus_per_replica)
    if parts and gpus == 0:
        raise ValueError(f"device {device!r} with gpus_per_replica={opts.gpus_per_replica:g}: Ray gives each replica "
                         "no GPU, so its daemon sees none (CUDA_VISIBLE_DEVICES is empty); give gpus_per_replica=N, "
                         "or device=cpu")
    beyond = [d for d in parts if d[5:].isdigit() and int(d[5:]) >= gpus]
    if beyond:
        raise ValueError(f"device {device!r} with gpus_per_replica={opts.gpus_per_replica:g}: the daemon sees the "
                         f"replica's {gpus} GPU(s) as cuda:0 to cuda:{gpus - 1}, and has no {', '.join(beyond)}; "
                         "give device=cuda (all of them), or more gpus_per_replica")


def _parse_serve(argv: list[str], what: str) -> argparse.Namespace:
    """``argv`` read as ``diffusiond serve`` reads it (``cli._main``), its usage errors raised as ValueError."""
    from diffusiond.cli import build_parser, unknown_arguments  # the flags alone: no daemon code, no torch
    from diffusiond.commands.argtypes import dash_values

    parser = build_parser()

    def refuse(message: str) -> NoReturn:
        raise ValueError(f"{what}: `diffusiond serve` refuses it: {message}")

    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    parser.error = serve.error = refuse  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --help would print the whole usage into serve's log
            args, extras = parser.parse_known_args(dash_values(parser, ["serve", *argv]))
        if extras:
            unknown_arguments(parser, "serve", extras)
    except SystemExit:  # --help among them: argparse printed and would exit
        refuse("--help prints the flags and exits; leave it out")
    return args


def _resources(raw: Any, bad: Any) -> tuple[tuple[str, float], ...]:
    items = list(raw.items()) if isinstance(raw, dict) else [
        tuple(p.split("=", 1)) if "=" in p else (p, "") for p in str(raw).split(",") if p.strip()]
    out = []
    for key, value in items:
        try:
            amount = float(str(value))
        except ValueError:
            raise bad("NAME=AMOUNT pairs, comma-separated (nodeA=1)") from None
        if not str(key).strip() or amount <= 0:
            raise bad("NAME=AMOUNT pairs with a name and a positive amount")
        out.append((str(key).strip(), amount))
    return tuple(out)


# How often each replica reports its daemon's load and whether it takes work (``router``): the
# router's view of a daemon is this much behind, plus Serve's broadcast to the routers.
ROUTING_STATS_PERIOD_S = 2.0
# A report older than this (the replica stopped reporting: busy, hung, or its stats call fails)
# says nothing the router trusts about where a model is; its load is still counted.
ROUTING_STATS_STALE_S = 3 * ROUTING_STATS_PERIOD_S


# When Serve kills a replica (its stop outlasted graceful_shutdown_timeout_s: a client still following a job's
# events, say) or someone ray.kills it, Ray SIGKILLs the processes the replica started as its worker exits, before
# the kernel's SIGTERM (PR_SET_PDEATHSIG, replica.py) can reach the daemon: it never drained, and its sockets were
# left behind. With this off, the SIGTERM comes, and the daemon drains and stops as on Serve's graceful stop (the
# process is still one the replica started: nothing is left running). Ray merges these with the application's own
# runtime_env variables.
LET_THE_DAEMON_DRAIN = {"RAY_kill_child_processes_on_worker_exit": "false"}


def proxy_host() -> str | None:
    """The host Serve's proxy is bound to, from the running Serve controller (``http_options``
    of ``serve start`` or a ``serve deploy`` config); None when no controller runs yet, in which
    case Serve starts its proxy on its default, 127.0.0.1."""
    from ray.serve import context

    client = context._get_global_client(raise_if_no_controller_running=False)
    return None if client is None else str(client.http_config.host)


def check_access(opts: Options, host: str | None) -> None:
    """Refuse, before any replica starts, a token that cannot be read or an open gateway on a network."""
    token = read_token(opts.token_file, opts.token_env)
    refusal = exposure_refusal(host, token is not None, opts.allow_unauthenticated)
    if refusal:
        raise ValueError(refusal)


def build(args: dict[str, Any]) -> Any:
    """The Serve application: a gateway (the HTTP ingress) in front of the daemon replicas."""
    from ray import serve

    from diffusiond.ray.gateway import Gateway
    from diffusiond.ray.replica import DaemonReplica
    from diffusiond.ray.router import JobRouter

    opts = Options.parse(dict(args))
    check_access(opts, proxy_host())
    scaling: dict[str, Any] = {"num_replicas": opts.replicas}
    if opts.replicas is None:
        scaling = {"autoscaling_config": {
            "min_replicas": opts.min_replicas, "max_replicas": opts.max_replicas,
            "target_ongoing_requests": opts.target_load,
            "policy": {"policy_function": "diffusiond.ray.router:queue_policy"}}}
    daemons = serve.deployment(
        name="diffusiond",
        max_ongoing_requests=opts.max_ongoing_requests,
        ray_actor_options={"num_cpus": opts.cpus_per_replica, "num_gpus": opts.gpus_per_replica,
                           "runtime_env": {"env_vars": LET_THE_DAEMON_DRAIN},
                           **({"resources": dict(opts.resources_per_replica)} if opts.resources_per_replica else {})},
        health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=max(30.0, opts.health_check_period_s),
        graceful_shutdown_timeout_s=opts.stop_timeout_s() + SHUTDOWN_MARGIN_S,
        request_router_config={
            "request_router_class": JobRouter, "request_router_kwargs": {
                "batch_affinity": opts.batch_affinity, "model_affinity": opts.model_affinity,
                "stale_after_s": ROUTING_STATS_STALE_S},
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S, "request_routing_stats_timeout_s": 10.0},
        **scaling,
    )(DaemonReplica)
    gateway = serve.deployment(name="gateway", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)(Gateway)
    return gateway.bind(daemons.bind(opts.serve_args(), opts.start_timeout_s, opts.stop_timeout_s(),
                                     shared_state_dir=opts.shared_state_dir), opts.token_file, opts.token_env,
                        opts.shared_state_dir is not None)
