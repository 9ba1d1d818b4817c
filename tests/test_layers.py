"""The layers of fbmt/, read from the code: every import (at module level or inside a function)
between fbmt's modules must point down or sideways in the picture of docs/ARCHITECTURE.md, never up
and never in a circle. Imports under `if TYPE_CHECKING:` serve annotations only and are not counted.

    base      flags, distributed, files, kernels/ (numba), _C                imports only base
    ir        ops/, layout, program, objects, decisions                      + base
    trace     trace                                                          + ir
    sim       sim                                                            + ir
    passes    passes/                                                        + ir, sim
    runtime   runtime/                                                       + ir (never passes)
    compiler  options, pipeline, compiled, api                               + trace, sim, passes, runtime
    bmt       bmt/ (BMTrain's names)    only through the compiler's public entry points (PUBLIC)
    optim     optim/                                                         + bmt (OptimManager)
    models    models/                                                        nothing of fbmt
    top       fbmt/__init__.py, train, checkpoint, calibration, profiling    anything
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fbmt"

GROUPS = [  # (module prefix, group); the longest matching prefix decides
    ("fbmt.flags", "base"),
    ("fbmt.distributed", "base"),
    ("fbmt.files", "base"),
    ("fbmt.checkpoint", "top"),
    ("fbmt.calibration", "top"),
    ("fbmt.profiling", "top"),
    ("fbmt.viz", "top"),
    ("fbmt.kernels", "base"),
    ("fbmt._C", "base"),
    ("fbmt.ops", "ir"),
    ("fbmt.layout", "ir"),
    ("fbmt.program", "ir"),
    ("fbmt.objects", "ir"),
    ("fbmt.decisions", "ir"),
    ("fbmt.trace", "trace"),
    ("fbmt.sim", "sim"),
    ("fbmt.passes", "passes"),
    ("fbmt.runtime", "runtime"),
    ("fbmt.options", "compiler"),
    ("fbmt.pipeline", "compiler"),
    ("fbmt.compiled", "compiler"),
    ("fbmt.api", "compiler"),
    ("fbmt.bmt", "bmt"),
    ("fbmt.optim", "optim"),
    ("fbmt.models", "models"),
    ("fbmt.train", "top"),
    ("fbmt", "top"),
]
ALLOWED = {
    "base": {"base"},
    "ir": {"base", "ir"},
    "trace": {"base", "ir", "trace"},
    "sim": {"base", "ir", "sim"},
    "passes": {"base", "ir", "sim", "passes"},
    "runtime": {"base", "ir", "runtime"},
    "compiler": {"base", "ir", "trace", "sim", "passes", "runtime", "compiler"},
    "bmt": {"base", "bmt", "ir", "trace", "compiler"},  # the last three only through PUBLIC
    "optim": {"base", "bmt", "optim"},
    "models": {"models"},
    "top": {"base", "ir", "trace", "sim", "passes", "runtime", "compiler", "bmt", "optim", "models", "top"},
}
# The compiler's entry points the BMTrain layer may use, and nothing else of it (public names only).
PUBLIC = {"fbmt.api", "fbmt.layout", "fbmt.trace", "fbmt.ops.record"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path, modules: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported fbmt module, names taken from it, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    typing_only = {  # imports under `if TYPE_CHECKING:` serve annotations and never run
        id(n)
        for stmt in ast.walk(tree)
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test)
        for n in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "fbmt"]
        elif isinstance(node, ast.ImportFrom):
            base = (
                importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                if node.level
                else node.module
            )
            if base is None or base.split(".")[0] != "fbmt":
                continue
            for a in node.names:  # `from fbmt import ops` imports the submodule fbmt.ops
                if f"{base}.{a.name}" in modules:
                    found.append((f"{base}.{a.name}", [], node.lineno))
                else:
                    found.append((base, [a.name], node.lineno))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def group(name: str) -> str:
    return max(((p, g) for p, g in GROUPS if name == p or name.startswith(p + ".")), key=lambda pg: len(pg[0]))[1]


def read_tree(root: Path) -> tuple[dict[str, Path], dict[str, list[tuple[str, list[str], int]]]]:
    """Every module under `root`, and what each imports."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    names = set(modules) | {"fbmt._C"}
    return modules, {name: imports(path, root, names) for name, path in modules.items()}


def find_cycle(edges: dict[str, list[tuple[str, list[str], int]]]) -> list[str] | None:
    graph = {name: sorted({t for t, _, _ in edges[name] if t in edges and t != name}) for name in edges}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        state[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


MODULES, EDGES = read_tree(ROOT)


def test_every_module_is_in_a_layer():
    assert all(group(name) for name in MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_the_layers(name):
    mine = group(name)
    bad = []
    for target, names, line in EDGES[name]:
        theirs = group(target)
        where = f"{MODULES[name].relative_to(ROOT.parent)}:{line} imports {target}"
        if theirs not in ALLOWED[mine]:
            bad.append(f"{where}: {mine} may import only {sorted(ALLOWED[mine])}, not {theirs}")
        elif (
            mine == "bmt"
            and theirs in ("ir", "trace", "compiler")
            and (target not in PUBLIC or any(n.startswith("_") for n in names))
        ):
            bad.append(
                f"{where} {names}: the BMTrain layer uses the compiler only through the public names of "
                f"{sorted(PUBLIC)}"
            )
    assert not bad, "\n".join(dict.fromkeys(bad))


def test_no_import_cycles():
    cycle = find_cycle(EDGES)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_sees_a_violation_and_a_cycle(tmp_path):
    """The checks above can fail: an upward import and a two-module cycle, written to a scratch tree."""
    fake = tmp_path / "fbmt"
    (fake / "passes").mkdir(parents=True)
    (fake / "runtime").mkdir()
    for p in ("__init__.py", "passes/__init__.py", "runtime/__init__.py"):
        (fake / p).write_text("")
    (fake / "passes" / "x.py").write_text("from fbmt.runtime import y\n")
    (fake / "runtime" / "y.py").write_text("def f():\n    from fbmt.passes.x import g\n")
    _, edges = read_tree(fake)
    assert ("fbmt.runtime.y", [], 1) in edges["fbmt.passes.x"] and group("fbmt.runtime.y") not in ALLOWED["passes"]
    assert ("fbmt.passes.x", ["g"], 2) in edges["fbmt.runtime.y"]  # a function-level import counts too
    assert find_cycle(edges) == ["fbmt.passes.x", "fbmt.runtime.y", "fbmt.passes.x"]
