"""The daemon the fuzzing kit fuzzes, and the world it runs in (part of tests/fuzzkit.py): the files
``image_path`` may name under ``--input-dir`` (every corpus image, symlink loops, links out), the
crafted safetensors files a LoRA path may name, ``Ctx`` (what the families build requests from: the
daemon, a finished job, its LoRAs and folders), and the ``serve`` arguments and token of a daemon fit
for fuzzing.

Apart because it sets a daemon up rather than drawing inputs: tests/test_fuzz_surfaces.py and
scripts/fuzz.py start their daemon with it, and the families only read the ``Ctx`` it makes.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from fuzzkit_images import image_corpus
from fuzzkit_wire import Target, request

# the daemon's limits for fuzzing: whatever valid request Hypothesis finds is cheap to run
CONFIG_LIMITS = """
[limits]
max_size = 128
max_n = 2
max_steps = 4
"""


# the environment the daemon runs in: files to read, LoRAs to register ------------------------------
def populate_input_dir(root: Path) -> list[str]:
    """The files ``image_path`` may name: every corpus image, then the traps (symlink loops, links
    out of the folder, a folder, names near the length limit). Returns the names."""
    root.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for name, data in image_corpus().items():
        (root / name).write_bytes(data)
        names.append(name)
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "in.png").write_bytes(image_corpus()["png-rgb"])
    links = {"loop": "loop", "loop-a": "loop-b", "loop-b": "loop-a", "escape": "/etc/passwd", "zero": "/dev/zero",
             "up": "..", "dangling": "missing", "self-dir": ".", "inside": "png-rgb"}
    for name, to in links.items():
        link = root / name
        if not link.is_symlink():
            os.symlink(to, link)
    (root / ("n" * 250 + ".png")).write_bytes(image_corpus()["png-rgb"])
    return [*names, "sub", "sub/in.png", *links, "n" * 250 + ".png"]


def safetensors(header: str | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def populate_lora_dir(root: Path) -> list[str]:
    """safetensors files a LoRA path may name: headers nested 100k deep, holding 5000-digit
    numbers, lengths that lie, dtypes and shapes that do not exist. Returns absolute paths."""
    root.mkdir(parents=True, exist_ok=True)
    t = '{"unet.x.lora_A.weight": {"dtype": "F32", "shape": [%s], "data_offsets": [%s]}}'
    files = {
        "deep100k.safetensors": safetensors('{"__metadata__": ' + '{"a":' * 100_000 + "1" + "}" * 100_000 + "}"),
        "deeplist.safetensors": safetensors('{"unet.x.lora_A.weight": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "digits.safetensors": safetensors(t % ("1" * 5000, "0, 4"), b"\0" * 4),
        "offsets.safetensors": safetensors(t % ("1", "0, " + "9" * 5000), b"\0" * 4),
        "float.safetensors": safetensors(t % ("1e309", "0, 4"), b"\0" * 4),
        "negative.safetensors": safetensors(t % ("-1", "0, 4"), b"\0" * 4),
        "huge-shape.safetensors": safetensors(t % (str(2**64), "0, 4"), b"\0" * 4),
        "dtype.safetensors": safetensors(t.replace("F32", "Q9") % ("1", "0, 4"), b"\0" * 4),
        "length-lies.safetensors": safetensors("{}", length=2**63),
        "length-zero.safetensors": safetensors("", length=0),
        "not-json.safetensors": safetensors("{not json"),
        "not-utf8.safetensors": safetensors(b'{"\xff\xfe": 1}'),
        "surrogate.safetensors": safetensors('{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                                             b"\0" * 4),
        "metadata-types.safetensors": safetensors('{"__metadata__": {"a": [1, 2, {"b": null}]}}'),
        "empty.safetensors": b"",
        "short.safetensors": b"\x05\0\0",
        "nul\x01name.safetensors": safetensors("{}"),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "dir.safetensors").mkdir(exist_ok=True)
    loop = root / "loop.safetensors"
    if not loop.is_symlink():
        os.symlink("loop.safetensors", loop)
    return [str(root / name) for name in [*files, "dir.safetensors", "loop.safetensors"]]


@dataclass(frozen=True)
class Ctx:
    """What the strategies build requests from: the daemon, a finished job with outputs and a
    preview, the LoRAs it serves, the folders it reads."""

    target: Target
    job_id: str
    loras: tuple[str, ...] = ()
    input_dir: str | None = None
    input_names: tuple[str, ...] = ()
    lora_paths: tuple[str, ...] = ()
    valid_lora: str | None = None

    @property
    def listeners(self) -> list[str]:
        return ["unix", "web"] if self.target.web_port is not None else ["unix"]


def finished_job(target: Target, timeout: float = 120) -> str:
    """A job that ran to the end with a preview and a trajectory, so URLs can reach its outputs, previews and
    trajectory arrays."""
    ans = request(target, "POST", "/v1/jobs", {"prompt": "fuzz", "model": "tiny", "width": 64, "height": 64,
                                                "steps": 2, "preview": {"every": 1, "max_side": 16},
                                                "scheduler": "ddim", "eta": 1.0, "trajectory": {}})
    assert ans.status == 202, ans.body
    job = ans.json()
    deadline = time.monotonic() + timeout
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        job = request(target, "GET", f"/v1/jobs/{job['id']}").json()
    assert job["status"] == "succeeded", job
    return str(job["id"])


def web_port_of(target: Target) -> int | None:
    """The --web listener's port, from the URL the daemon gives over its socket."""
    ans = request(target, "GET", "/v1/admin/web")
    if ans.status != 200:
        return None
    from urllib.parse import urlsplit

    return urlsplit(ans.json()["url"]).port


# a daemon to fuzz ------------------------------------------------------------------------------
def daemon_args(tmp: Path, lora_files: dict[str, Path], web: bool = True) -> tuple[list[str], Path, Path]:
    """The ``serve`` arguments of a daemon fit for fuzzing (tiny, two LoRAs, small limits,
    ``--input-dir``, ``--web`` on a free loopback port with a known token), after writing the
    files it reads. Returns (args, input dir, crafted LoRA dir)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "fuzz.toml"
    config.write_text(f'max_loras = 2\n[[models]]\nname = "tiny"\nspec = "tiny"\n{CONFIG_LIMITS}\n[loras]\n'
                      f'ink = "{lora_files["ink"]}"\ndots = "{lora_files["dots"]}"\n')
    inputs, crafted = tmp / "inputs", tmp / "crafted-loras"
    populate_input_dir(inputs)
    populate_lora_dir(crafted)
    args = ["--config", str(config), "--retention-s", "60", "--job-timeout", "60", "--max-batch", "2",
            "--input-dir", str(inputs)]
    if web:
        (tmp / "token").write_text(FUZZ_TOKEN + "\n")
        args += ["--web", "127.0.0.1:0", "--token-file", str(tmp / "token")]
    return args, inputs, crafted


FUZZ_TOKEN = "fuzz-token-0123456789abcdef0123"


def make_ctx(target: Target, input_dir: Path | None, crafted: Path | None, valid_lora: Path | None,
             loras: tuple[str, ...] = ("ink", "dots")) -> Ctx:
    names = tuple(populate_input_dir(input_dir)) if input_dir else ()
    paths = tuple(populate_lora_dir(crafted)) if crafted else ()
    return Ctx(target, finished_job(target), loras, str(input_dir) if input_dir else None, names, paths,
               str(valid_lora) if valid_lora else None)
