"""The Ray builder's arguments against the daemon they start, without a cluster: a ``config=FILE`` serves the
file's models, and what the builder can tell is wrong about the daemon's command line is refused when
``serve run``/``serve deploy`` builds the application, naming the argument, instead of failing in every
replica Serve starts (and retries) with the daemon's own message."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from diffusiond.cli import SERVE_FIELDS, build_parser
from diffusiond.daemon.config import build_config, load_toml
from diffusiond.ray.app import Options


def served_models(opts: Options) -> list[str]:
    """The models the replica's daemon serves: its command line read as ``diffusiond serve`` reads it."""
    args = build_parser().parse_args(["serve", "--socket", "/nonexistent/d.sock", *opts.serve_args()])
    assert isinstance(args, argparse.Namespace)
    overrides = {name: getattr(args, name) for name in SERVE_FIELDS if getattr(args, name) is not None}
    config = build_config(load_toml(args.config) if args.config else {}, overrides)
    return [m.name for m in config.models]


def test_a_config_file_serves_its_own_models_when_no_model_argument_is_given(tmp_path: Path) -> None:
    """docs/scaling.md: ``config=FILE`` is "the same DaemonConfig as on one machine". The builder always added
    ``--model tiny`` (the ``model`` default), and the daemon's flags replace the file's ``[[models]]``: the
    replicas served tiny, and every request for the file's models got model_not_found."""
    toml = tmp_path / "daemon.toml"
    toml.write_text('[[models]]\nname = "pic"\nspec = "tiny"\n\n[[models]]\nname = "pic2"\nspec = "tiny"\n')
    assert served_models(Options.parse({"config": str(toml)})) == ["pic", "pic2"]
    # given both, the flag wins over the file, as on one machine
    assert served_models(Options.parse({"config": str(toml), "model": "other=tiny"})) == ["other"]
    assert served_models(Options.parse({})) == ["tiny"]  # neither: tiny, as before


@pytest.mark.parametrize(("args", "says"), [
    ({"daemon_args": "--max-bach 8"}, "--max-bach"),  # a typo: every replica's daemon exited 2
    ({"daemon_args": "--max-batch eight"}, "--max-batch"),
    ({"daemon_args": "--socket /run/d.sock"}, "--socket"),  # the replica waited start_timeout_s for its own socket
    ({"daemon_args": "--web"}, "--web"),  # the second replica on a node could not bind it
    ({"daemon_args": "--tcp=0.0.0.0:9000 --token-file /t"}, "--tcp"),  # the whole API on every replica's node
    ({"shared_state_dir": "/data", "daemon_args": "--state-dir=/other"}, "--state-dir"),  # the = spelling passed
    ({"device": "cuda"}, "gpus_per_replica"),  # no GPU from Ray: CUDA_VISIBLE_DEVICES is empty
    ({"daemon_args": "--device cuda:0"}, "gpus_per_replica"),
    ({"gpus_per_replica": "1", "device": "cuda:0,cuda:1"}, "cuda:1"),  # one GPU visible: cuda:0 only
    ({"gpus_per_replica": "nan"}, "finite"),
    ({"health_check_period_s": "inf"}, "finite"),
    ({"replicas": "2", "max_replicas": "8"}, "replicas=auto"),  # silently a fixed 2
    ({"target_load": "2"}, "replicas=auto"),
])
def test_a_daemon_command_line_that_cannot_work_is_refused_when_the_application_is_built(
        args: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError) as err:
        Options.parse(args)
    assert says in str(err.value), str(err.value)


@pytest.mark.parametrize("args", [
    {"daemon_args": "--max-batch 8 --job-timeout 60 --keep-alive -1 --test-fault no_working_measure"},
    {"gpus_per_replica": "0.5", "device": "cuda"},
    {"gpus_per_replica": "2", "device": "cuda:0,cuda:1"},
    {"gpus_per_replica": "1"},
    {"device": "auto"},
    {"replicas": "auto", "max_replicas": "8", "target_load": "2"},
])
def test_command_lines_that_work_are_taken(args: dict[str, str]) -> None:
    Options.parse(args)


def test_a_state_dir_given_with_an_equals_sign_is_the_replicas_own_under_it(tmp_path: Path) -> None:
    """``--state-dir=/data`` was not seen: the replica added ``--no-persist --state-dir PRIVATE`` after it, which
    the daemon read last, and the jobs were kept in memory."""
    from diffusiond.ray.replica import own_state_dir

    argv = ["serve", "--socket", "/s", *own_state_dir(["--state-dir=/data"], tmp_path, "r1")]
    args = build_parser().parse_args(argv)
    assert args.state_dir == "/data/r1" and args.persist is None


def test_a_replicas_stop_waits_for_the_daemons_drain_grace() -> None:
    """``--drain-grace-s 300`` was taken, and the replica killed its daemon 60 s into the drain."""
    assert Options.parse({"daemon_args": "--drain-grace-s 300"}).stop_timeout_s() > 300


def test_a_shared_state_dir_syncs_every_accepted_job_unless_told_otherwise() -> None:
    """A lost node is a power cut to its store: with ``--state-sync normal`` the jobs it accepted last may be
    missing for the replica that adopts them."""
    def sync(args: dict[str, str]) -> str | None:
        parsed = build_parser().parse_args(["serve", "--socket", "/s", *Options.parse(args).serve_args()])
        return getattr(parsed, "state_sync", None)

    assert sync({"shared_state_dir": "/data"}) == "full"
    assert sync({"shared_state_dir": "/data", "daemon_args": "--state-sync normal"}) == "normal"
    assert sync({}) is None
