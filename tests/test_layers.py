"""The layers of fbmt/, read from the code: every import (at module level or inside a function)
between fbmt's modules must point down or sideways in the picture of docs/ARCHITECTURE.md, never up
and never in a circle. Imports under `if TYPE_CHECKING:` serve annotations only and are not counted.

    base          flags, logs, job, files, kernels/ (numba), _C                   imports only base
    compiler      compiler/: its own layers below                                 + base
    integrations  integrations/ (bmt, optim, transformers, torch_guards)         + base, compiler's public names
    tools         tools/ (sim, calibration, profiling, viz, auto_remat)          + base, compiler's public names
    models        models/                                                         nothing of fbmt
    top           fbmt/__init__.py, api, train, checkpoint, cache                 + all, compiler's public names

Inside the compiler:

    ir       meta, collectives/, ops/, layout, program, objects, decisions, owners      + base
    trace    trace, masks, stamp, host_draws, host_calls, assertions                    + ir
    passes   passes/                                                                    + ir
    runtime  runtime/                                                                   + ir (never passes)
    front    options, plan, pipeline, module, agreement, api, the package               + the compiler

The compiler's public names are the `__all__` of `fbmt.compiler` and of its packages `collectives`,
`ops` and `passes`, the public names of `meta`, and the recording ops (`ops.record`, BMTrain's
`inspect.record_tensor`). Every module of fbmt/ must be in one of these layers: a module the picture
does not name is an error too.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fbmt"

GROUPS = [  # (module prefix, group); the longest matching prefix decides; a module matching none is an error
    ("fbmt.flags", "base"),
    ("fbmt.logs", "base"),
    ("fbmt.job", "base"),
    ("fbmt.files", "base"),
    ("fbmt.kernels", "base"),
    ("fbmt._C", "base"),
    ("fbmt.compiler", "compiler.front"),
    ("fbmt.compiler.meta", "compiler.ir"),
    ("fbmt.compiler.collectives", "compiler.ir"),
    ("fbmt.compiler.ops", "compiler.ir"),
    ("fbmt.compiler.layout", "compiler.ir"),
    ("fbmt.compiler.program", "compiler.ir"),
    ("fbmt.compiler.objects", "compiler.ir"),
    ("fbmt.compiler.decisions", "compiler.ir"),
    ("fbmt.compiler.owners", "compiler.ir"),
    ("fbmt.compiler.sizes", "compiler.ir"),
    ("fbmt.compiler.trace", "compiler.trace"),
    ("fbmt.compiler.masks", "compiler.trace"),
    ("fbmt.compiler.stamp", "compiler.trace"),
    ("fbmt.compiler.host_draws", "compiler.trace"),
    ("fbmt.compiler.host_calls", "compiler.trace"),
    ("fbmt.compiler.assertions", "compiler.trace"),
    ("fbmt.compiler.passes", "compiler.passes"),
    ("fbmt.compiler.runtime", "compiler.runtime"),
    ("fbmt.integrations", "integrations"),
    ("fbmt.tools", "tools"),
    ("fbmt.models", "models"),
    ("fbmt.api", "top"),
    ("fbmt.train", "top"),
    ("fbmt.checkpoint", "top"),
    ("fbmt.cache", "top"),
]
TOP_PACKAGE = "fbmt"  # fbmt/__init__.py itself: the public names
COMPILER = {"compiler.ir", "compiler.trace", "compiler.passes", "compiler.runtime", "compiler.front"}
ALLOWED = {
    "base": {"base"},
    "compiler.ir": {"base", "compiler.ir"},
    "compiler.trace": {"base", "compiler.ir", "compiler.trace"},
    "compiler.passes": {"base", "compiler.ir", "compiler.passes"},
    "compiler.runtime": {"base", "compiler.ir", "compiler.runtime"},
    "compiler.front": {"base"} | COMPILER,
    "integrations": {"base", "integrations"} | COMPILER,  # the compiler through PUBLIC only
    "tools": {"base", "tools"} | COMPILER,  # the compiler through PUBLIC only
    "models": {"models"},
    "top": {"base", "integrations", "tools", "models", "top"} | COMPILER,  # the compiler through PUBLIC only
}
# The compiler's entry points for what is built on it, and nothing else of it (names in their __all__).
PUBLIC = {
    "fbmt.compiler",
    "fbmt.compiler.collectives",
    "fbmt.compiler.ops",
    "fbmt.compiler.ops.record",
    "fbmt.compiler.passes",
    "fbmt.compiler.meta",
}


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
            for a in node.names:  # `from fbmt.compiler import ops` imports the submodule fbmt.compiler.ops
                if f"{base}.{a.name}" in modules:
                    found.append((f"{base}.{a.name}", [], node.lineno))
                else:
                    found.append((base, [a.name], node.lineno))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def group(name: str) -> str | None:
    if name == TOP_PACKAGE:
        return "top"
    matches = [(p, g) for p, g in GROUPS if name == p or name.startswith(p + ".")]
    return max(matches, key=lambda pg: len(pg[0]))[1] if matches else None


def exported(path: Path) -> set[str] | None:
    """The names a module's `__all__` lists (None where it has none)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts}
    return None


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


def violations(name: str, modules: dict[str, Path], edges: dict) -> list[str]:
    """What module `name` imports against the picture."""
    mine = group(name)
    bad = []
    for target, names, line in edges[name]:
        theirs = group(target)
        where = f"{name} (line {line}) imports {target}"
        if theirs is None:
            bad.append(f"{where}: {target} is in no layer")
        elif theirs not in ALLOWED[mine]:
            bad.append(f"{where}: {mine} may import only {sorted(ALLOWED[mine])}, not {theirs}")
        elif mine not in COMPILER and theirs in COMPILER:
            public = exported(modules[target]) if target in modules else None
            private = [n for n in names if n.startswith("_") or (public is not None and n not in public)]
            if target not in PUBLIC or private:
                bad.append(
                    f"{where} {names}: outside the compiler, only the public names of {sorted(PUBLIC)} "
                    f"(their __all__) may be imported{f'; not {private}' if private else ''}"
                )
    return bad


MODULES, EDGES = read_tree(ROOT)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_is_in_a_layer(name):
    assert group(name) is not None, f"{name} is in no layer of the picture (tests/test_layers.py, docs/ARCHITECTURE.md)"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_the_layers(name):
    bad = violations(name, MODULES, EDGES)
    assert not bad, "\n".join(dict.fromkeys(bad))


def test_no_import_cycles():
    cycle = find_cycle(EDGES)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_sees_a_violation_a_private_name_and_a_cycle(tmp_path):
    """The checks above can fail: an upward import, a name the compiler does not export, a module in
    no layer, and a two-module cycle, written to a scratch tree."""
    fake = tmp_path / "fbmt"
    for folder in ("compiler/passes", "compiler/runtime", "tools"):
        (fake / folder).mkdir(parents=True)
    for p in ("__init__.py", "compiler/__init__.py", "compiler/passes/__init__.py", "compiler/runtime/__init__.py"):
        (fake / p).write_text("__all__ = ['compile_module']\n")
    (fake / "tools" / "__init__.py").write_text("")
    (fake / "compiler" / "passes" / "x.py").write_text("from fbmt.compiler.runtime import y\n")
    (fake / "compiler" / "runtime" / "y.py").write_text("def f():\n    from fbmt.compiler.passes.x import g\n")
    (fake / "tools" / "z.py").write_text(
        "from fbmt.compiler import _hidden, compile_module\nfrom fbmt.tools import w\n"
    )
    (fake / "pipeline.py").write_text("from fbmt.tools import z\n")
    modules, edges = read_tree(fake)
    assert ("fbmt.compiler.runtime.y", [], 1) in edges["fbmt.compiler.passes.x"]
    assert any("compiler.passes may import only" in v for v in violations("fbmt.compiler.passes.x", modules, edges))
    assert ("fbmt.compiler.passes.x", ["g"], 2) in edges["fbmt.compiler.runtime.y"]  # a function-level import counts
    assert any("not ['_hidden']" in v for v in violations("fbmt.tools.z", modules, edges))
    assert group("fbmt.pipeline") is None  # the old tree's top-level compiler modules are in no layer
    assert find_cycle(edges) == ["fbmt.compiler.passes.x", "fbmt.compiler.runtime.y", "fbmt.compiler.passes.x"]


def environment_reads(path: Path) -> list[int]:
    """Lines where a module reads an environment variable itself (`os.environ[...]`, `.get`, `in`,
    `os.getenv`) rather than through fbmt.flags; handing the whole environment on (`dict(os.environ,
    ...)` for a child process) is no read."""
    tree = ast.parse(path.read_text())
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "getenv":
            lines.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr == "environ":
            parent = parents.get(id(node))
            if not (isinstance(parent, ast.Call) and getattr(parent.func, "id", None) == "dict"):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_flags_reads_the_environment(name):
    if name == "fbmt.flags":
        return
    lines = environment_reads(MODULES[name])
    assert not lines, f"{name} reads the environment at lines {lines}: declare the variable in fbmt/flags.py"
