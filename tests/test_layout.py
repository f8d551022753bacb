"""The package's shape holds: imports go one way between the three processes and the layer
between them, and no module imports itself back through another.

Read from the source with ``ast`` (every import, at module level or inside a function), so a
new import that breaks the layering fails here, with the module and the line, before it can
grow into a knot."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import diffusiond

ROOT = Path(diffusiond.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(path: Path, *, module_level_only: bool = False) -> list[tuple[str, int]]:
    """(imported diffusiond module, line) for every import in the file. With
    ``module_level_only``, imports inside functions and ``if TYPE_CHECKING:`` are left out."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            type_only = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if isinstance(child, ast.Import) and (top or not module_level_only):
                found.extend((a.name, child.lineno) for a in child.names if a.name.startswith("diffusiond"))
            elif isinstance(child, ast.ImportFrom) and (top or not module_level_only):
                mod = child.module or ""
                if mod.startswith("diffusiond"):
                    found.append((mod, child.lineno))
                    # ``from diffusiond.daemon import views`` imports the module diffusiond.daemon.edge.views
                    found.extend((f"{mod}.{a.name}", child.lineno) for a in child.names)
            visit(child, top and not nested and not type_only)

    visit(tree, True)
    known = modules()
    return [(m, line) for m, line in found if m in known]


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# (importer package, packages it must not import, why)
RULES = [
    ("diffusiond.ipc", ["diffusiond.daemon", "diffusiond.worker", "diffusiond.pipelines", "diffusiond.client",
                        "diffusiond.cli", "diffusiond.commands", "diffusiond.bench"], "ipc is the layer between "
     "processes: it imports nothing of the package but the stdlib-only vocabulary in protocol.py"),
    ("diffusiond.protocol", ["diffusiond."], "the vocabulary is the bottom of the graph"),
    ("diffusiond.pipelines", ["diffusiond.daemon", "diffusiond.worker", "diffusiond.client", "diffusiond.cli",
                              "diffusiond.commands"],
     "pipelines are used by the worker and know nothing of the processes"),
    ("diffusiond.worker", ["diffusiond.daemon", "diffusiond.client", "diffusiond.cli", "diffusiond.commands"],
     "the worker process talks to the engine only through ipc"),
    ("diffusiond.daemon", ["diffusiond.worker", "diffusiond.client", "diffusiond.cli", "diffusiond.commands",
                           "diffusiond.zerocopy"],
     "the engine starts workers as processes; it shares only ipc, the vocabulary and the spec grammar"),
    ("diffusiond.client", ["diffusiond.daemon", "diffusiond.worker", "diffusiond.pipelines", "diffusiond.cli",
                           "diffusiond.commands", "diffusiond.bench"],
     "the client library speaks HTTP over the socket, like any program; the command line is built on it, "
     "not the other way round"),
    ("diffusiond.commands", ["diffusiond.daemon", "diffusiond.worker", "diffusiond.pipelines", "diffusiond.ipc"],
     "the command line is a client: it reaches the daemon only through diffusiond.client"),
    ("diffusiond.cli", ["diffusiond.worker", "diffusiond.pipelines", "diffusiond.ipc"],
     "the command line is a client (serve imports the daemon's config and server, lazily)"),
    ("diffusiond.ray", ["diffusiond.daemon", "diffusiond.worker", "diffusiond.pipelines", "diffusiond.ipc"],
     "the Ray Serve adapter runs the daemon as a process and speaks HTTP to it, like any client"),
    *[(package, ["diffusiond.ray"], "Ray is an optional extra on top of the daemon: nothing below it may need it")
      for package in ("diffusiond.protocol", "diffusiond.ipc", "diffusiond.daemon", "diffusiond.worker",
                      "diffusiond.pipelines", "diffusiond.client", "diffusiond.zerocopy", "diffusiond.cli",
                      "diffusiond.commands", "diffusiond.bench")],
]

# Modules in one room of the engine that another room must not import: the HTTP edge is the top
# (status codes are chosen there), so nothing below it may reach back up into it.
ENGINE_ROOMS = ["diffusiond.daemon.edge", "diffusiond.daemon.core", "diffusiond.daemon.workers",
                "diffusiond.daemon.outputs", "diffusiond.daemon.state"]
BELOW_THE_EDGE = [r for r in ENGINE_ROOMS if r != "diffusiond.daemon.edge"]


def test_the_client_library_and_the_command_line_live_in_their_own_packages() -> None:
    """From the tree one sees where the client library ends and the command line begins: nothing
    client-side sits at the package's top under a prefix."""
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert top == ["__init__", "__main__", "cli", "protocol", "zerocopy"], top
    assert (ROOT / "client" / "__init__.py").exists() and (ROOT / "commands" / "__init__.py").exists()


def test_nothing_below_the_edge_imports_it() -> None:
    broken = [f"{path.relative_to(ROOT.parent)}:{line} imports {mod}"
              for name, path in modules().items() if any(under(name, r) for r in BELOW_THE_EDGE)
              for mod, line in imports(path) if under(mod, "diffusiond.daemon.edge")]
    assert not broken, "\n".join(broken)


def test_no_module_is_over_500_lines() -> None:
    """A module that long has more than one job: split it along them (docs/architecture.md)."""
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_layering_between_processes_and_the_layer_between_them() -> None:
    broken = []
    for name, path in modules().items():
        for importer, banned, why in RULES:
            if not under(name, importer):
                continue
            for mod, line in imports(path):
                if any(mod.startswith(b) if b.endswith(".") else under(mod, b) for b in banned):
                    broken.append(f"{path.relative_to(ROOT.parent)}:{line} imports {mod} ({why})")
    assert not broken, "\n".join(broken)


def test_no_import_cycles() -> None:
    graph = {name: {m for m, _ in imports(path, module_level_only=True) if m != name}
             for name, path in modules().items()}
    # a package's __init__ is imported before any of its modules: an edge to it is an edge to its imports
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_function_level_imports_are_not_hidden_cycles() -> None:
    """An import moved into a function to dodge a cycle is still a cycle in the design."""
    graph = {name: {m for m, _ in imports(path) if m != name} for name, path in modules().items()}
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                    if a in graph.get(b, set()) and not (under(a, b) or under(b, a))})
    assert not pairs, f"modules that import each other: {pairs}"


def test_the_engine_process_never_loads_torch() -> None:
    """The engine only moves bytes and bookkeeping: torch (and the memory and start-up time it
    costs) lives in the workers."""
    code = "import sys, diffusiond.daemon.server; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'diffusers', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ray_loads_only_with_the_ray_adapter() -> None:
    """``diffusiond[ray]`` is optional: the package, the client and the CLI load without it, and
    ``import diffusiond.ray`` (what ``serve run`` does first) loads Ray only when ``build`` runs."""
    code = "import sys, diffusiond, diffusiond.client, diffusiond.cli, diffusiond.ray; " \
           "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
