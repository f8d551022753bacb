"""What the command line and the Python client refuse before anything is sent:
numbers JSON cannot carry, ``-o`` naming a directory that is not there, an empty job id, a history page
larger than the daemon serves, and a ``--socket`` that is no socket. No daemon: each of these must be
caught on this side, with the flag or the parameter named, and nothing written.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from diffusiond.cli import main
from diffusiond.client import AsyncClient, Client
from diffusiond.client.params import job_body
from diffusiond.commands.argtypes import HISTORY_MAX_LIMIT
from diffusiond.commands.generate import UsageError, build_body, check_output_dir, output_paths


# non-finite numbers ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["nan", "inf", "NaN", "Infinity", "1e999"])
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["generate", "x", "--guidance", "{}"], "--guidance"),
        (["generate", "x", "--image", "in.png", "--strength", "{}"], "--strength"),
        (["generate", "x", "--timeout", "{}"], "--timeout"),
        (["generate", "x", "--lora", "ink:{}"], "--lora"),
        (["generate", "x", "--control", "edges:lines.png:{}"], "--control"),
        (["generate", "x", "--ip-adapter", "style:ref.png:{}"], "--ip-adapter"),
        (["generate", "x", "--upscale", "esrgan:{}"], "--upscale"),
        (["generate", "x", "--hires", "{}"], "--hires"),
        (["generate", "x", "--hires", "2:{}"], "--hires"),
        (["status", "--wait", "{}"], "--wait"),
        (["serve", "--job-timeout", "{}"], "--job-timeout"),
        (["serve", "--drain-grace-s", "{}"], "--drain-grace-s"),
        (["serve", "--batch-wait-ms", "{}"], "--batch-wait-ms"),
        (["serve", "--keep-days", "{}"], "--keep-days"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_flag_given_nan_or_inf_is_a_usage_error_naming_it(
    flags: list[str], named: str, bad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once these reached the daemon as a body with ``NaN`` in it: ``request body is not valid JSON``,
    exit 1, no flag named."""
    args = [f.format(bad) for f in flags]
    if args[0] != "serve":
        args += ["--socket", str(tmp_path / "none.sock")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"argument {named}" in err and "finite" in err, err
    assert "valid JSON" not in err


def test_finite_numbers_still_reach_the_request() -> None:
    from diffusiond.cli import build_parser

    args = build_parser().parse_args(["generate", "x", "--guidance", "7.5", "--lora", "ink:-0.5", "--hires",
                                      "1.5:0.4", "--upscale", "esrgan:2", "--timeout", "1e3"])
    body = build_body(args, None)
    assert (body["guidance_scale"], body["loras"], body["timeout_s"]) == (7.5, [{"name": "ink", "weight": -0.5}],
                                                                          1000.0)
    assert body["hires"] == {"scale": 1.5, "strength": 0.4} and body["upscale"] == {"name": "esrgan", "scale": 2.0}


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"guidance_scale": math.nan}, "guidance_scale"),
        ({"strength": math.inf}, "strength"),
        ({"timeout_s": -math.inf}, "timeout_s"),
        ({"loras": {"ink": math.nan}}, "loras.ink"),
        ({"loras": [("ink", math.inf)]}, "loras[0][1]"),
        ({"hires": {"scale": 2.0, "strength": math.nan}}, "hires.strength"),
        ({"hires": math.inf}, "hires"),
        ({"control": [{"name": "edges", "image_path": "a.png", "scale": math.nan}]}, "control[0].scale"),
        ({"keep_alive": math.inf}, "keep_alive"),
        ({"size": (math.nan, 64)}, "size[0]"),
    ],
)
def test_the_client_refuses_nan_and_inf_naming_the_parameter(params: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(named)} must be a finite number"):
        job_body("a", params)  # type: ignore[arg-type]


def test_client_generate_and_create_job_refuse_nan_before_sending(tmp_path: Path) -> None:
    """No daemon on the socket: a request that got as far as sending would be DaemonUnreachable."""
    with Client(str(tmp_path / "none.sock")) as c:
        with pytest.raises(ValueError, match=r"^guidance_scale must be a finite number, got nan"):
            c.generate("a", guidance_scale=float("nan"))
        with pytest.raises(ValueError, match=r"^loras\[0\]\.weight must be a finite number, got inf"):
            c.create_job({"prompt": "a", "loras": [{"name": "ink", "weight": math.inf}]})

    async def submit() -> None:
        async with AsyncClient(str(tmp_path / "none.sock")) as ac:
            await ac.submit("a", strength=math.nan)

    with pytest.raises(ValueError, match=r"^strength must be a finite number"):
        asyncio.run(submit())


# -o naming a directory -------------------------------------------------------------------
def test_o_with_a_trailing_slash_names_a_directory(tmp_path: Path) -> None:
    out = tmp_path / "outdir"
    out.mkdir()
    assert output_paths("j_1", f"{out}/", "png", 1) == [out / "j_1.png"]
    assert output_paths("j_1", f"{out}/", "png", 2) == [out / "j_1-0.png", out / "j_1-1.png"]
    assert output_paths("j_1", ".", "png", 1) == [Path("j_1.png")]
    check_output_dir(f"{out}/")
    check_output_dir(".")


@pytest.mark.parametrize("n", [None, 2])
def test_o_naming_a_missing_directory_is_refused_before_anything_is_sent(
    n: int | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once ``-o newdir/`` wrote a PNG named ``newdir`` (``-n 2``: ``newdir-0``, ``newdir-1``)."""
    missing = f"{tmp_path / 'newdir'}/"
    with pytest.raises(UsageError, match=f"^directory '{missing}' for -o does not exist; create it first$"):
        check_output_dir(missing, n)
    argv = ["generate", "x", "-o", missing, "--socket", str(tmp_path / "none.sock")]
    assert main(argv + (["-n", str(n)] if n else [])) == 2  # a usage error, not exit 3 for the missing daemon
    assert "does not exist; create it first" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("output", ["outdir/fox.png", "outdir/", "outdir/sub/fox.png"])
def test_o_under_a_file_says_the_file_is_not_a_directory(output: str, tmp_path: Path) -> None:
    (tmp_path / "outdir").write_bytes(b"a file")
    with pytest.raises(UsageError, match=f"^'{tmp_path / 'outdir'}' is a file, not a directory"):
        check_output_dir(f"{tmp_path}/{output}")  # not tmp_path / output: Path drops the trailing /


# the other usage errors ------------------------------------------------------------------
@pytest.mark.parametrize("job_id", ["", "  "])
def test_cancel_with_an_empty_job_id_is_a_usage_error(
    job_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cancel", job_id, "--socket", str(tmp_path / "none.sock")]) == 2
    assert "JOB_ID is empty" in capsys.readouterr().err


@pytest.mark.parametrize("limit", ["0", "1001", "100000", "ten"])
def test_history_limit_out_of_range_is_refused_naming_the_flag(
    limit: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["history", "--limit", limit, "--socket", str(tmp_path / "none.sock")]) == 2
    assert "argument --limit:" in capsys.readouterr().err


def test_history_limit_help_gives_the_range_and_it_is_the_daemons(capsys: pytest.CaptureFixture[str]) -> None:
    from diffusiond.daemon.edge.jobs import HISTORY_MAX_LIMIT as DAEMONS

    assert HISTORY_MAX_LIMIT == DAEMONS
    assert main(["history", "--help"]) == 0
    assert f"1 to {DAEMONS}" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("kind", ["a regular file", "a directory"])
def test_a_socket_path_that_is_no_socket_says_so(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not "start one with serve --socket PATH", which serve then refuses ("exists and is not a socket")."""
    path = tmp_path / "in.png"
    if kind == "a directory":
        path.mkdir()
    else:
        path.write_bytes(b"\x89PNG")
    assert main(["status", "--socket", str(path)]) == 3
    err = capsys.readouterr().err
    assert f"{path} is {kind}, not a socket" in err
    assert "diffusiond serve" not in err


@pytest.fixture
def stdin_of(monkeypatch: pytest.MonkeyPatch) -> Any:
    def feed(data: bytes) -> None:
        raw = io.BytesIO(data)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(raw))

    return feed


def test_image_dash_reads_stdin_once(stdin_of: Any, tmp_path: Path) -> None:
    from diffusiond.cli import build_parser

    stdin_of(b"\x89PNG picture")
    args = build_parser().parse_args(["generate", "x", "--image", "-"])
    assert base64.b64decode(build_body(args, None)["image"]) == b"\x89PNG picture"
    stdin_of(b"\x89PNG picture")
    mask = tmp_path / "m.png"
    mask.write_bytes(b"m")
    args = build_parser().parse_args(["generate", "x", "--image", "-", "--image", "-", "--mask", str(mask)])
    with pytest.raises(UsageError, match="stdin is read once"):
        build_body(args, None)
    stdin_of(b"")
    with pytest.raises(UsageError, match="stdin was empty"):
        build_body(build_parser().parse_args(["generate", "x", "--image", "-"]), None)


def test_image_with_an_empty_name_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Once ``--image : Is a directory``."""
    assert main(["generate", "x", "--image", "", "--socket", str(tmp_path / "none.sock")]) == 2
    assert "--image needs a file name (or - for the picture on stdin)" in capsys.readouterr().err
