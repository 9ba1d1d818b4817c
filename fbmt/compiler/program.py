"""The IR every pass reads and returns: a joint forward+backward fx graph plus typed metadata.

A `Program` is what `trace` produces and what each pass in `passes/` transforms. It
holds:

- `graph`: one aten-level `torch.fx.Graph` with the forward *and* the backward of one call of the
  model. Every node carries its phase (``"fwd"`` or ``"bwd"``); forward nodes carry their module
  (the innermost module path that produced them) and, after the blocks pass, their block: facts
  read and written through `fbmt.compiler.meta`.
- `inputs` / `outputs`: the role of each placeholder and each output slot (a parameter, a buffer,
  a user input, a tangent, a shard, a shard gradient, ...), so the runtime knows what to feed.
- `layout`: how parameters are grouped into flat, sharded buffers (`layout`, decided at
  compile time, since `model.parameters()` must exist before the first call).
- `history`: one record per pass: its name, time, a summary, and the program text after it, so a
  notebook can show each pass's diff.

Its nodes are aten ops, the communication nodes of `collectives/`, and the recording ops of
`ops.record`.

See NOTE: [Phases] below for how forward and backward are told apart.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fbmt.compiler import collectives, meta, objects, ops
from fbmt.compiler.layout import Layout
from fbmt.compiler.meta import BWD as BWD
from fbmt.compiler.meta import FWD as FWD

# NOTE: [Phases]
# The joint graph is traced as "forward, then autograd.grad", so every forward node precedes every
# backward node. Trace stamps each node's phase (`meta.phase`); passes stamp the nodes they insert.
# The partitioner splits by phase, never by re-deriving dependencies, and `verify` checks that the
# phases are contiguous (all "fwd" before all "bwd") and that no forward node reads a tangent.
# The two values are defined with the node facts (fbmt.compiler.meta) and named here too.


@dataclass(frozen=True)
class Role:
    """What a placeholder or output slot is. `key` is a name or an index, by kind."""

    # param | buffer | input | constant | tangent | shard | output | grad | input_grad | shard_grad
    kind: str
    key: Any

    def __str__(self) -> str:
        return f"{self.kind}[{self.key}]"


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its name, how long it took, its stats, and the program after it.

    `stats` is the pass's own typed record (`BlockStats`, `RematStats`, `ShardStats`, ...: counts,
    the policies it applied, what it declined and why), which tests and tools read; its `str()` is
    the one line `print(program)` shows (NOTE: [Pass stats] in passes/__init__.py)."""

    name: str
    seconds: float
    stats: Any
    text: str

    @property
    def summary(self) -> str:
        """The stats as the one line `print(program)` shows."""
        return str(self.stats)


@dataclass(frozen=True)
class Note:
    """The stats of a step that has nothing to count: one sentence (what tracing left out, a pass
    disabled by the user)."""

    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class Results:
    """How a call's result is put together from a program's outputs (NOTE: [Objects in a call]).

    Output slots are keyed `i` (leaf `i` of the result is that tensor), `("object", i, j)` (the
    j-th tensor of the object at leaf `i`, one the forward made), `("state", a, j)` (the j-th
    tensor of the argument object at input leaf `a`, as the forward leaves it) and `("kept", k, j)`
    (leaf `j` of the k-th value the forward assigned to a module's attribute: NOTE: [What a forward
    keeps on its modules] in fbmt/compiler/trace.py)."""

    n_leaves: int
    constants: dict[int, Any] = field(default_factory=dict)  # leaves that are no tensor: as traced
    objects: dict[int, Any] = field(default_factory=dict)  # leaf -> the traced object, the template
    returned: dict[int, int] = field(default_factory=dict)  # leaf -> input leaf of the object returned
    states: dict[int, Any] = field(default_factory=dict)  # input leaf -> that object after the forward
    notes: list[str] = field(default_factory=list)  # what tracing left out, for the program's summary
    # (module path, attribute, how, structure, leaves, which leaves are the outputs' tensors) of each
    # value the forward assigned to a module's attribute ("attribute") or buffer ("buffer", "buffer, not
    # persistent": one it registered or assigned in another shape)
    kept: list[tuple[str, str, str, Any, list, tuple[int, ...]]] = field(default_factory=list)
    # ("state", a) / ("object", i) / ("constant", i) -> (path, `objects.Size`) of each number its template holds
    # (a constant: is) as an expression in a symbolic program's sizes (NOTE: [Numbers in an object])
    sized: dict[tuple[str, int], list[tuple[tuple, Any]]] = field(default_factory=dict)

    def assemble(
        self, values: dict[Any, Any], inputs: list[Any], root: nn.Module, sizes: dict[Any, int] | None = None
    ) -> list[Any]:
        """The result's leaves from the program's outputs by key; brings every argument object
        (`inputs`: the call's input leaves) to the state the forward leaves it in, and sets the
        attributes of `root`'s modules the forward assigns. `sizes`: the call's value of each symbol of
        a program of symbolic sizes whose objects hold numbers (`sized`)."""
        for k, (path, name, how, spec, template, tensors) in enumerate(self.kept):
            leaves = list(template)
            for j in tensors:
                leaves[j] = values[("kept", k, j)]
            owner, value = root.get_submodule(path), pytree.tree_unflatten(leaves, spec)
            if how == "attribute":
                setattr(owner, name, value)
            else:
                owner.register_buffer(name, value, persistent=how == "buffer")

        def held(where: str, i: int, template: Any) -> Any:
            out = objects.rebuild(template, [values[(where, i, j)] for j in range(len(objects.tensors_in(template)))])
            for path, size in self.sized.get((where, i), ()):
                objects.put(out, path, ("plain", int, size.value(sizes)))
            return out

        for a, template in self.states.items():
            objects.update_in_place(inputs[a], held("state", a, template))
        leaves: list[Any] = [values.get(i) for i in range(self.n_leaves)]
        for i, v in self.constants.items():
            leaves[i] = v.value(sizes) if isinstance(v, objects.Size) else v
        for i, template in self.objects.items():
            leaves[i] = held("object", i, template)
        for i, a in self.returned.items():
            leaves[i] = inputs[a]
        return leaves


@dataclass
class Program:
    graph: fx.Graph
    inputs: list[Role]  # one per placeholder, in order
    outputs: list[Role]  # one per slot of the output node's flat list
    layout: Layout
    out_spec: Any  # pytree spec of the user's output
    results: Results  # how the "output" slots and the traced values make that output's leaves
    needs_grad: bool  # False: a forward-only (inference) program, no tangents, no backward
    # tensors the forward made from Python values (placeholders of kind "constant"), by name
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    # the recompute policy the remat pass applied to each block (NOTE: [Schedules] in fbmt/compiler/decisions.py)
    remat: dict[str, str] = field(default_factory=dict)
    history: list[PassRecord] = field(default_factory=list)
    # where it came from: "compiled in 3.1s; saved to the compile cache (...)", "loaded from the compile cache (...)"
    origin: str = ""
    # a program for many input sizes: which dimensions are symbolic, what it assumes (NOTE: [Dynamic sizes])
    sizes: Any = None
    # (argument leaf, path in it) of each number an argument object holds that the program takes as the size of
    # an input of its own, after the call's tensors (NOTE: [Numbers in an object])
    numbers: tuple[tuple[int, tuple], ...] = ()
    # the submodule a call of it alone runs, "" for the model (NOTE: [Submodules through the program])
    entry: str = ""
    # (module path, attribute, value) of each value the forward set on its modules, as one run left it:
    # a program loaded from the compile cache sets them again; None: it did what the cache cannot do
    # again (NOTE: [What a forward keeps on its modules] in fbmt/compiler/trace.py)
    writes: list[tuple[str, str, Any]] | None = field(default_factory=list)
    # (generator, state) of each host generator the forward seeded, as its draws left it: set again after
    # every call, where eager's call leaves it (NOTE: [Host draws] in fbmt/compiler/host_draws.py)
    seeded: list[tuple[str, Any]] = field(default_factory=list)
    # Not fields: set by the pass runner for one pass (`copy`). _owned: no one else holds this program
    # (the pass before made it), so the pass may write to it; _written: the pass did.
    _owned = False
    _written = False

    # ---- structure helpers passes share -------------------------------------------------
    def placeholders(self) -> list[fx.Node]:
        """The graph's inputs, in the order of `self.inputs`."""
        return list(self.graph.find_nodes(op="placeholder"))  # fx indexes nodes by op: no walk of the graph

    def placeholder(self, kind: str, key: Any) -> fx.Node | None:
        """The input node with role (`kind`, `key`), e.g. ("param", "fc.weight"); None if absent."""
        for node, role in zip(self.placeholders(), self.inputs):
            if role.kind == kind and role.key == key:
                return node
        return None

    def output_node(self) -> fx.Node:
        """The graph's output node (the last)."""
        return next(iter(reversed(self.graph.nodes)))

    def output_values(self) -> list[Any]:
        """What the program returns, in the order of `self.outputs`."""
        return list(self.output_node().args[0])

    def set_outputs(self, values: list[Any], roles: list[Role]) -> None:
        """Replace what the program returns, with the role of each value."""
        out = self.output_node()
        out.args = (list(values),)
        self.outputs = list(roles)

    def copy(self, shared: bool = False) -> Program:
        """A deep copy of the graph (node metadata included) with the same layout. `shared=True`: the
        same graph, for a pass that changes nothing (every pass copies before it writes). Within the
        pass runner, a program that an earlier pass made and no one else holds is given to the pass
        that writes to it instead of copied: a copy of a graph of tens of thousands of nodes cost
        more than some of the passes."""
        if shared:
            return dataclasses.replace(
                self, inputs=list(self.inputs), outputs=list(self.outputs), history=list(self.history)
            )
        if self._owned:
            self._owned, self._written = False, True
            return self
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        graph.output(graph.graph_copy(self.graph, env))  # graph_copy returns the mapped outputs
        return dataclasses.replace(
            self, graph=graph, inputs=list(self.inputs), outputs=list(self.outputs), history=list(self.history)
        )

    def record(self, name: str, seconds: float, stats: Any, unchanged: bool = False) -> None:
        """Append a pass's record (the runner does this after every pass). `unchanged`: the pass
        returned the graph it was given, whose text the last record holds already."""
        text = self.history[-1].text if unchanged and self.history else format_graph(self)
        self.history.append(PassRecord(name, seconds, stats, text))

    def stats(self, name: str) -> Any:
        """What pass `name` did, as its typed record (its last), e.g. `program.stats("shard").gathers`."""
        for r in reversed(self.history):
            if r.name == name:
                return r.stats
        raise KeyError(f"no pass named {name!r} ran; passes: {[r.name for r in self.history]}")

    def summary(self, name: str) -> str:
        """What pass `name` did, as the line `print(program)` shows, e.g. `program.summary("remat")`."""
        return str(self.stats(name))

    def schedule(self) -> Any:
        """The decisions the passes made on this program, as an `fbmt.Schedule` (to print, save,
        compare with another and replay: NOTE: [Schedules] in fbmt/compiler/decisions.py)."""
        from fbmt.compiler.decisions import Schedule

        return Schedule.of(self)

    def collectives(self) -> list[fx.Node]:
        """The start node of every collective, in program order."""
        return [n for n in self.graph.nodes if collectives.is_start(n)]

    def collective_signature(self) -> str:
        """A digest of the ordered collective sequence (kind, group, phase) and the groups' sizes: the
        runtime compares it across ranks before a program first runs, so ranks that traced different
        programs fail with a message instead of hanging in mismatched collectives."""
        parts = [f"{n.target.__name__}:{meta.group(n)}:{meta.phase(n)}:{meta.bucket(n)}" for n in self.collectives()]
        sizes = [f"{grp.index}:{grp.padded_numel}:{grp.dtype}" for grp in self.layout.groups]
        return hashlib.sha1("|".join(parts + sizes).encode()).hexdigest()[:16]

    def fake(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A fake tensor in this program's fake mode, on its parameters' device (None if untraced)."""
        for n in self.placeholders():
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
                return ops.fake_like(v, shape, dtype)
        return None

    def __str__(self) -> str:
        head = [
            f"# fbmt Program: world_size={self.layout.world_size}, "
            f"{len(self.layout.blocks)} blocks, {len(self.layout.groups)} flat groups, "
            f"{'forward+backward' if self.needs_grad else 'forward only'}"
        ]
        if self.entry:
            head.append(f"# a call of submodule `{self.entry}` on its own, over the model's shards")
        if self.origin:
            head.append(f"# {self.origin}")
        if self.sizes is not None:
            head.append(f"# {self.sizes}")
        for r in self.history:
            head.append(f"# pass {r.name:<10} {r.seconds * 1e3:7.1f} ms  {r.summary}")
        return "\n".join(head) + "\n" + format_graph(self)

    __repr__ = __str__


# ---- printing -----------------------------------------------------------------------------


def per_block(items: list[tuple[str, str]]) -> list[str]:
    """`block: text` for each (block, text), in order, with a run of three or more repeated layers
    (`h.0`, `h.1`, ... as a list numbers them) that read the same as one entry, `h.0 ... h.127 (128
    blocks): text`: a pass's line for a deep model stays a line (the root block is "<root>")."""
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i + 1
        while j < len(items) and items[j][1] == items[i][1] and _next_layer(items[j - 1][0], items[j][0]):
            j += 1
        first, text = items[i][0] or "<root>", items[i][1]
        out += (
            [f"{first} ... {items[j - 1][0]} ({j - i} blocks): {text}"]
            if j - i >= 3
            else [f"{b or '<root>'}: {t}" for b, t in items[i:j]]
        )
        i = j
    return out


def _next_layer(a: str, b: str) -> bool:
    """Whether block `b` is the layer after `a` in one list (`h.3` after `h.2`)."""
    pa, _, ia = a.rpartition(".")
    pb, _, ib = b.rpartition(".")
    return bool(pa) and pa == pb and ia.isdigit() and ib.isdigit() and int(ib) == int(ia) + 1


def _fmt_arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return "%" + a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return str(a).removeprefix("torch.")
    return repr(a)


def _fmt_val(node: fx.Node) -> str:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    return ""


@functools.cache
def _target_name(t: Any) -> str:
    if isinstance(t, torch._ops.OpOverload):
        return str(t).removeprefix("aten.").removesuffix(".default")
    return getattr(t, "__name__", str(t))


# NOTE: [Lines of unchanged nodes]
# The runner formats the program after every pass (its history), and most passes change a few nodes
# of thousands, handing the rest on as they were (Program.copy). A node's line is a function of its
# name, target, arguments, value and four meta facts: the node keeps its line with those (an
# attribute of the node itself: a table of nodes would hold every graph ever formatted alive through
# the arguments it keeps) and it is made again where any differs. The target, the arguments (fx
# replaces a node's args and kwargs as a whole, never in place) and the value are compared by
# identity, which costs no comparison of their contents (a symbolic size compared by value would add
# a guard); a node is never renamed once in a graph. A copy of the graph has other nodes, formatted
# anew.
_LINE = "_fbmt_line"


def _line(n: fx.Node, note: str) -> str:
    args = [_fmt_arg(a) for a in n.args]
    if n.kwargs:
        args += [f"{k}={_fmt_arg(v)}" for k, v in n.kwargs.items()]
    value = _fmt_val(n)
    lhs = f"%{n.name}: {value}" if value else f"%{n.name}"
    return f"{lhs} = {_target_name(n.target)}({', '.join(args)})   # {note}"


def format_graph(program: Program) -> str:
    """One line per node: `%name: dtype[shape] = op(args)   # phase block [recompute]`.

    The runner formats the program after every pass (its history), so this is written for speed:
    each node's value and target are formatted once, and a node unchanged since the last
    formatting keeps its line (NOTE: [Lines of unchanged nodes])."""
    roles = dict(zip(program.placeholders(), program.inputs))
    kept = program.results.kept

    def said(r: Role) -> str:  # a kept value by its module's attribute: output[layers.0.aux], tangent[kl]
        if isinstance(r.key, tuple) and r.key[0] == "kept":
            path, name, _, _, _, tensors = kept[r.key[1]]
            leaf = f"[{r.key[2]}]" if tensors != (0,) else ""
            return f"{r.kind}[{path + '.' if path else ''}{name}{leaf}]"
        return str(r)

    lines = []
    for n in program.graph.nodes:
        if n.op == "placeholder":
            lines.append(f"%{n.name}: {_fmt_val(n)} = input {said(roles[n]) if n in roles else '?'}")
            continue
        if n.op == "output":
            outs = ", ".join(
                f"{said(r)}=%{v.name}" if isinstance(v, fx.Node) else f"{said(r)}={v!r}"
                for r, v in zip(program.outputs, n.args[0])
            )
            lines.append(f"return {outs}")
            continue
        phase, block, recompute, bucket = meta.phase(n), meta.block(n), meta.recompute(n), meta.bucket(n)
        facts = (n.target, n.args, n.kwargs, n.meta.get("val"), phase, block, recompute, bucket)
        had = getattr(n, _LINE, None)
        if had is not None and all(a is b for a, b in zip(had[0][:4], facts)) and had[0][4:] == facts[4:]:
            lines.append(had[1])
            continue
        note = phase or "?"
        if block is not None:
            note += " " + (block or "<root>")
        if recompute:
            note += f" recompute:{recompute}"
        if bucket is not None:
            note += f" bucket:{bucket}"
        line = _line(n, note)
        try:  # not Node.__setattr__: it re-indexes the node on a change
            object.__setattr__(n, _LINE, (facts, line))
        except (AttributeError, TypeError):  # a torch whose nodes take no attribute of ours: formatted every time
            pass
        lines.append(line)
    return "\n".join(lines)
