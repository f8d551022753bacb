"""The model spec grammar (``diffusiond.pipelines.spec``): one reading of a spec for the daemon's
config and the registry, without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from diffusiond.daemon.config import model_name_for as config_model_name_for
from diffusiond.daemon.config import parse_model_arg as config_parse_model_arg
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import (
    ACCEPTED_FORMS,
    ModelSpec,
    check_options,
    loads_libraries,
    model_name_for,
    offload_mode,
    parse_model_arg,
    parse_options,
    parse_spec,
)

PACKAGE = Path(__file__).resolve().parent.parent / "diffusiond"


def test_reading_specs_loads_no_torch() -> None:
    code = (
        "import sys, diffusiond.pipelines.spec, diffusiond.pipelines, diffusiond.daemon.config\n"
        "from diffusiond.pipelines import PipelineError, Task\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from diffusiond.pipelines import load_pipeline\n"  # the lazy name still resolves
        "assert callable(load_pipeline) and 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tiny", ModelSpec("tiny", "tiny")),
        (" tiny-video ", ModelSpec("tiny-video", "tiny-video")),
        ("tiny-flux", ModelSpec("tiny-flux", "tiny-flux")),
        ("synthetic", ModelSpec("synthetic", "synthetic")),
        (
            "synthetic:compute_ms=40, task=video,",
            ModelSpec("synthetic", "synthetic:compute_ms=40, task=video,", {"compute_ms": "40", "task": "video"}),
        ),
        ("random:sdxl", ModelSpec("random", "sdxl")),
        ("random:wan-1.3b,save=0", ModelSpec("random", "wan-1.3b", {"save": "0"})),
        ("org/model", ModelSpec("hub", "org/model")),
        ("/no/such/dream.safetensors", ModelSpec("checkpoint", "/no/such/dream.safetensors")),
        ("/no/such/DREAM.SAFETENSORS", ModelSpec("checkpoint", "/no/such/DREAM.SAFETENSORS")),
    ],
)
def test_parse_spec_kinds(spec: str, expected: ModelSpec) -> None:
    assert parse_spec(spec) == expected


def test_a_folder_is_a_folder_even_when_it_looks_like_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_spec("org/model") == ModelSpec("folder", "org/model")
    assert parse_spec(str(tmp_path)) == ModelSpec("folder", str(tmp_path))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "empty model spec"),
        ("   ", "empty model spec"),
        ("model.ckpt", "pickle-based checkpoint"),
        ("weights.BIN", "pickle-based checkpoint"),
        ("no such model!", r"unrecognised model spec 'no such model!'; accepted: 'tiny'"),
        ("synthetic:oops", r"bad option 'oops' in model spec 'synthetic:oops'; expected key=value pairs"),
        ("random:sd15,=1", r"bad option '=1' in model spec 'random:sd15,=1'"),
    ],
)
def test_parse_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(PipelineError, match=match):
        parse_spec(spec)


def test_options_and_accepted_forms() -> None:
    assert parse_options(" a = 1 ,b=,", "s") == {"a": "1", "b": ""}
    check_options({"cpu_offload": "1", "save": "0"})
    with pytest.raises(PipelineError, match=r"unknown model option\(s\) cpu_ofload, zz; known: allow_unsafe"):
        check_options({"cpu_ofload": "1", "zz": "2"})
    assert all(form in ACCEPTED_FORMS for form in ("'tiny'", "random:sd15", "synthetic", "'org/name'"))


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("tiny", ("tiny", "tiny")),
        ("sd=/models/sd15", ("sd", "/models/sd15")),
        ("org/model", ("org/model", "org/model")),
        ("/ckpt/dreamshaper.safetensors", ("dreamshaper", "/ckpt/dreamshaper.safetensors")),
        ("/ckpt/old.ckpt", ("old", "/ckpt/old.ckpt")),
        ("synthetic:compute_ms=40", ("synthetic", "synthetic:compute_ms=40")),
        ("bench=synthetic:compute_ms=40", ("bench", "synthetic:compute_ms=40")),
        ("random:sdxl", ("random:sdxl", "random:sdxl")),
        ("random:wan-1.3b,save=0", ("random:wan-1.3b,save=0", "random:wan-1.3b,save=0")),
        ("./models/sd15", ("sd15", "./models/sd15")),
        ("~/models/x", ("x", "~/models/x")),
    ],
)
def test_model_arg_and_name(arg: str, expected: tuple[str, str]) -> None:
    assert parse_model_arg(arg) == expected == config_parse_model_arg(arg)
    assert model_name_for(expected[1]) == config_model_name_for(expected[1])


def test_no_import_cycle_in_the_package() -> None:
    """Every import counts, also one inside a function: a cycle hidden there is still a cycle."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
        graph[name] = deps - {name}

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in graph[node]:
                if dep == start:
                    return [*path, start]
                if dep not in seen:
                    seen.add(dep)
                    stack.append((dep, [*path, dep]))
        return None

    cycles = [c for c in map(cycle_from, sorted(m for m in graph if m.startswith("diffusiond.pipelines"))) if c]
    assert not cycles, cycles


@pytest.mark.parametrize(("options", "match"), [
    ({"offload": "stream", "resident_blocks": "x"}, r"resident_blocks='x': give a whole number of blocks"),
    ({"offload": "stream", "resident_blocks": "1e3"}, r"resident_blocks='1e3'"),
    ({"offload": "stream", "resident_blocks": "100001"}, r"resident_blocks='100001'"),
    ({"resident_blocks": "3"}, "resident_blocks=3 applies to offload=stream only, and no offload is given"),
    ({"resident_blocks": "3", "offload": "group"}, "offload=stream only, and offload=group is given"),
    ({"offload": "stream", "fp8": "1"}, "offload=stream with fp8=1 is refused"),
    ({"offload": "stream", "quant": "text_encoder_2:int8,unet:fp8-storage"}, r"quant=unet:\.\.\. is refused"),
])
def test_offload_stream_options_are_checked_with_the_spec(options: dict[str, str], match: str) -> None:
    with pytest.raises(PipelineError, match=match):
        check_options(options)


def test_offload_stream_options_that_are_accepted() -> None:
    check_options({"offload": "stream", "resident_blocks": "0"})
    check_options({"offload": "stream", "quant": "text_encoder_2:fp8-storage"})  # the encoders may be quantized
    assert offload_mode({"offload": "stream", "resident_blocks": "40"}) == "stream"


@pytest.mark.parametrize(("spec", "libraries"), [
    ("synthetic:compute_ms=5", False), ("random:sd15,save=0", True), ("tiny", True), ("/models/sd15", True),
    ("/models/flux1-dev-Q8_0.gguf", True),
])
def test_the_template_imports_the_model_libraries_for_every_model_but_synthetic(spec: str, libraries: bool) -> None:
    """A random preset is a diffusers model: taken as synthetic, its worker paid diffusers' and transformers' model
    imports inside its load, after the fork, where the template could have paid them before (issue 27/31)."""
    assert loads_libraries(spec) is libraries
