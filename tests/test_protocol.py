"""protocol.py: the one copy of the API's vocabulary, and what importing it (and its users) costs.

The import checks run in a fresh interpreter each, since this one has loaded everything already.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffusiond import protocol
from diffusiond.protocol import (
    FLOW_SCHEDULERS,
    FORMAT_OF_CONTENT_TYPE,
    FORMAT_OF_SUFFIX,
    FORMATS,
    IMAGE_FORMATS,
    SCHEDULERS,
    TERMINAL_EVENTS,
    TERMINAL_STATUSES,
    VIDEO_FORMATS,
    JobStatus,
    default_socket_path,
    frame_count_neighbours,
    schedulers_for,
)


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    code = f"{statement}; import sys; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_protocol_imports_only_the_standard_library() -> None:
    modules = loaded_after("import diffusiond.protocol") - loaded_after("pass")  # less site's own
    assert {m.split(".")[0] for m in modules} <= set(sys.stdlib_module_names) | {"diffusiond"}
    assert {m for m in modules if m.startswith("diffusiond")} == {"diffusiond", "diffusiond.protocol"}


def test_client_loads_no_daemon_module_nor_torch() -> None:
    modules = loaded_after("import diffusiond.client")
    assert not {m for m in modules if m.startswith(("diffusiond.daemon", "diffusiond.pipelines", "diffusiond.worker"))}
    assert not {"torch", "diffusers", "numpy", "PIL", "av"} & modules


def test_request_checks_load_neither_pillow_nor_pyav() -> None:
    modules = loaded_after("import diffusiond.daemon.edge.requests")
    assert not {"av", "PIL", "torch", "diffusers", "diffusiond.daemon.outputs.encoders"} & modules


def test_formats_table() -> None:
    assert list(FORMATS) == ["png", "jpeg", "webp", "gif", "mp4", "npy"]
    assert {"png", "jpeg", "webp", "npy"} == IMAGE_FORMATS and {"mp4", "webp", "gif", "npy"} == VIDEO_FORMATS
    assert FORMATS["jpeg"].extension == "jpg" and FORMAT_OF_SUFFIX[".jpg"] == FORMAT_OF_SUFFIX[".jpeg"] == "jpeg"
    assert all(FORMAT_OF_CONTENT_TYPE[f.content_type] == name for name, f in FORMATS.items())


def test_string_enums_are_their_wire_text() -> None:
    """JSON and CLI output built from them must be byte-identical to the plain strings."""
    assert str(JobStatus.SUCCEEDED) == f"{JobStatus.SUCCEEDED}" == "succeeded"
    assert "cancelled" in TERMINAL_STATUSES and "running" not in TERMINAL_STATUSES
    assert {"done", "error"} == TERMINAL_EVENTS
    assert JobStatus.FAILED.terminal and not JobStatus.QUEUED.terminal


def test_schedulers() -> None:
    assert set(SCHEDULERS) >= FLOW_SCHEDULERS
    assert schedulers_for(True) == ("flow-match", "flow-sde")
    assert set(schedulers_for(False)) == set(SCHEDULERS) - FLOW_SCHEDULERS


@pytest.mark.parametrize(("frames", "step", "expected"), [
    (9, 8, None), (1, 8, None), (17, 8, None), (10, 8, (9, 17)), (16, 8, (9, 17)), (2, 4, (1, 5)),
    (7, 1, None), (7, 0, None),
])  # fmt: skip
def test_frame_count_neighbours(frames: int, step: int, expected: tuple[int, int] | None) -> None:
    assert frame_count_neighbours(frames, step) == expected


def test_socket_path_rules() -> None:
    assert default_socket_path({"DIFFUSIOND_SOCKET": "/a", "XDG_RUNTIME_DIR": "/x"}) == "/a"
    assert default_socket_path({"RUNTIME_DIRECTORY": "/run/d:/run/e"}, serving=True) == "/run/d/diffusiond.sock"
    # a client inside another unit with RuntimeDirectory= (a trainer's) looks where the daemon is, not there
    assert default_socket_path({"RUNTIME_DIRECTORY": "/run/trainer", "XDG_RUNTIME_DIR": "/x"}) == \
        "/x/diffusiond/diffusiond.sock"
    assert default_socket_path({"XDG_RUNTIME_DIR": "/x"}) == "/x/diffusiond/diffusiond.sock"
    assert default_socket_path({}) == f"/tmp/diffusiond-{os.getuid()}/diffusiond.sock"


def test_the_daemon_config_and_the_client_use_the_same_rules() -> None:
    from diffusiond import client
    from diffusiond.daemon import config

    assert config.default_socket_path is client.default_socket_path is protocol.default_socket_path
