"""Remat: recompute each block's activations in the backward instead of saving them.

Requires: forward nodes tagged with their block (the blocks pass).
Ensures, with `policy="block"`: no forward value computed inside a block is read by the backward,
except (a) the block's outputs (values that other blocks' forward reads: the next block's inputs,
saved anyway), and (b) values that cannot be recomputed: random ops (recomputing would draw a new
dropout mask) and mutating ops. Each recomputed copy is placed right before the first backward node
that needs it (NOTE: [Late recompute]), tagged with recompute "activation" (`meta.recompute`). With
`policy="none"` the pass declines and says so in the history. `per_block` sets the policy of single blocks.

NOTE: [Selective]
`policy="selective"` saves the outputs of a block's expensive ops (matrix products, attention) and
recomputes everything else (norms, activations, RoPE, casts, residual adds) from them and the block
inputs: most of the memory of "none", at the price of re-running cheap, memory-bound ops that a
compiled backward fuses, some of which (a norm's mean square, RoPE) save nothing by being rerun.
`policy="mincut"` recomputes only those cheap ops whose recompute saves memory (NOTE: [Min-cut]).

NOTE: [Auto recompute]
`remat="auto", memory_budget=B` chooses each block's policy so that the step's simulated peak fits
in B bytes at the least recompute time. Per block and policy, `block_costs` takes the bytes of the
block's own values that the backward reads and the simulated seconds of what it recomputes; blocks
add up (a block's inputs are the previous block's outputs, which that block saves under every
policy). The peak is the saved bytes plus what does not depend on the choice (gathered buffers, the
backward's working set, the gradients): that rest is measured by simulating the program with every
block recomputed, the least memory there is; if even that exceeds B, the error names it as the
smallest budget that fits. `cheapest_within` then solves the multiple-choice knapsack (least
seconds, saved bytes within B minus the rest) by dynamic programming, and the pipeline simulates
the program it gives; where the peak still exceeds B (the sum is a model of the peak, not the
peak), the capacity shrinks by the excess and the choice is made again. Where the user set no
prefetch depth (neither `prefetch=` nor the strategy's `depth` option) and the strategy takes one,
this runs for depths 1, 2 and 3 (`pipeline.DEPTHS`), and the depth whose choice simulates the
fastest step wins, the shallowest of those within 1% of it: a deeper prefetch hides more
communication and holds more gathered parameters, so it may leave less room for saved activations.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch.fx as fx

from fbmt.compiler import meta, ops
from fbmt.compiler.ops import expensive, is_view, nbytes, size
from fbmt.compiler.program import BWD, FWD, Program, per_block

POLICIES = ("block", "selective", "mincut", "none")  # and "auto", which the pipeline resolves to these per block


def recomputable(n: fx.Node) -> bool:
    """A pure forward op: running it again in the backward gives the same value."""
    return meta.phase(n) == FWD and ops.pure(n)


class Recompute(NamedTuple):
    """What the backward recomputes of one block."""

    block: str
    needed: list[fx.Node]  # the forward values the backward reads
    closure: set[fx.Node]  # what recomputes them


@dataclass(frozen=True)
class RematChoice:
    """What remat="auto" chose (NOTE: [Auto recompute]): the record the remat pass applies and reports.

    A search outside the compiler makes it (`fbmt.tools.auto_remat`, given to the compiler by
    `fbmt.compile`), on a fixed cost model unless the user passed one, so every rank makes the same."""

    policies: dict[str, str]  # every block's policy: the chosen, the fixed ("none") and those set by name
    chosen: dict[str, str] = field(default_factory=dict)  # the blocks the search chose for, and what
    budget: int = 0  # memory_budget, bytes
    peak: int | None = None  # the simulated peak of the chosen program
    depth: int | None = None  # the prefetch depth chosen, where the search chose one
    steps: dict[int, float] = field(default_factory=dict)  # the simulated step (s) at each depth tried
    reason: str | None = None  # why nothing was chosen (a forward-only program)

    def __str__(self) -> str:
        if self.reason is not None:
            return f"auto: {self.reason}"
        counts = {p: sum(v == p for v in self.chosen.values()) for p in POLICIES}
        shown = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
        line = f"auto under {size(self.budget)}: {shown or 'no block to choose'}; simulated peak {size(self.peak or 0)}"
        if len(self.steps) > 1:
            steps = ", ".join(f"{d}: {step * 1e3:.4g} ms" for d, step in self.steps.items())
            line += f"; prefetch depth {self.depth} (simulated step by depth {steps})"
        return line


@dataclass(frozen=True)
class BlockRecompute:
    """What the backward recomputes of one block."""

    block: str
    recomputed: int  # nodes copied into the backward
    late: int  # of those, copies of cheap values placed at their reader (NOTE: [Late recompute])
    saved: int  # forward values the recompute reads (saved for the backward)

    def __str__(self) -> str:
        return f"{self.block or '<root>'}: {self.text()}"

    def text(self) -> str:
        late = f" ({self.late} late)" if self.late else ""
        return f"{self.recomputed} recomputed{late}, {self.saved} saved"


@dataclass(frozen=True)
class Trailing:
    """The blocks at the end of the forward that save their activations although their policy
    recomputes them (NOTE: [Trailing blocks]); or, with `saved=False`, the last ones that could not."""

    blocks: tuple[str, ...]  # in forward order
    saved: bool
    saved_bytes: int  # what the backward would read with them saved
    gradient_bytes: int  # the gradient shards the step holds after the backward

    def __str__(self) -> str:
        names = [b or "<root>" for b in self.blocks]
        if not self.saved:
            return (
                f"{', '.join(names)}: recomputed although the backward begins with them "
                f"({_size(self.saved_bytes)} saved for the backward > {_size(self.gradient_bytes)} of gradients)"
            )
        listed = ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]} ({len(names)} blocks)"
        return (
            f"{listed}: saved, the backward begins with them "
            f"({_size(self.saved_bytes)} saved for the backward <= {_size(self.gradient_bytes)} of gradients)"
        )


@dataclass(frozen=True)
class RematStats:
    """What the remat pass did (NOTE: [Pass stats])."""

    applied: dict[str, str]  # the policy applied to each block (a saved trailing block's is "mincut")
    blocks: tuple[BlockRecompute, ...] = ()  # in forward order
    trailing: Trailing | None = None
    declined: str | None = None  # why nothing is recomputed
    chosen: RematChoice | None = None  # what remat="auto" chose, where it did

    def __str__(self) -> str:
        if self.declined is not None:
            body = f"declined: {self.declined}; activations are saved"
        else:
            parts = per_block([(b.block, b.text()) for b in self.blocks]) + (
                [str(self.trailing)] if self.trailing else []
            )
            body = "; ".join(parts) or "no block activations reach the backward"
        return f"{self.chosen}; {body}" if self.chosen is not None else body


def recompute_blocks(
    program: Program,
    *,
    policy: str = "block",
    per_block: Mapping[str, str] | None = None,
    chosen: RematChoice | None = None,
) -> tuple[Program, RematStats]:
    """`per_block` overrides `policy` for the named blocks (BMTrain's `Block(use_checkpoint=...)`, a
    replayed Schedule's); `chosen`, remat="auto"'s choice, sets every block's."""
    per_block = dict(chosen.policies if chosen is not None else per_block or {})
    program = program.copy()
    recomputing = [b for b in program.layout.blocks if per_block.get(b, policy) != "none"]
    program.remat = {b: per_block.get(b, policy) if program.needs_grad else "none" for b in program.layout.blocks}
    if not recomputing or not program.needs_grad:
        why = "forward-only program" if not program.needs_grad else "no block recomputes (remat='none')"
        return program, RematStats(dict(program.remat), declined=why, chosen=chosen)

    g = program.graph
    fwd = forward_nodes(g)
    plans = [plan for block in recomputing if (plan := _plan(fwd, block, per_block.get(block, policy)))]

    def forward_order(plan: Recompute) -> fx.Node:
        return min(plan.closure)  # nodes compare by their place in the graph

    plans.sort(key=forward_order)
    lighter = functools.cache(lambda block: _plan(fwd, block, "mincut"))  # what a saved trailing block recomputes
    saved_blocks, trailing = _trailing(g, plans, lighter, per_block, _grad_bytes(program))
    plans = [plan for plan in plans if plan.block not in saved_blocks] + [
        plan for block in saved_blocks if (plan := lighter(block))
    ]
    program.remat.update(dict.fromkeys(saved_blocks, "mincut"))  # what a saved trailing block does
    done = []
    for block, needed, closure in sorted(plans, key=forward_order):
        late = 0
        if per_block.get(block, policy) == "block" and block not in saved_blocks and (inner := lighter(block)):
            # NOTE: [Late recompute]: the cheap values from what mincut saves, and that from the block's inputs
            late = _recompute(g, inner.needed, inner.closure)
            _, needed, closure = _plan(fwd, block, "block") or Recompute(block, [], set())
        copies = _recompute(g, needed, closure) + late
        read = {a for n in closure for a in n.all_input_nodes if a not in closure and a.op != "placeholder"}
        done.append(BlockRecompute(block, copies, late, len(read)))
    return program, RematStats(dict(program.remat), tuple(done), trailing, chosen=chosen)


def forward_nodes(g: fx.Graph) -> dict[str, list[fx.Node]]:
    """Each block's forward nodes, in graph order, found in one walk: what a block's plan reads. The
    backward's copies do not change it, so one index serves a whole pass, and the pass stays linear
    in the graph however many blocks it has."""
    out: dict[str, list[fx.Node]] = {}
    for n in g.nodes:
        if meta.phase(n) == FWD and (b := meta.block(n)) is not None:
            out.setdefault(b, []).append(n)
    return out


def _plan(fwd: Mapping[str, list[fx.Node]], block: str, policy: str) -> Recompute | None:
    """What the backward recomputes of `block` under `policy` (`fwd`: `forward_nodes`); None if nothing."""
    own = fwd.get(block, [])
    inside = {
        n
        for n in own
        if recomputable(n)
        and not (policy in ("selective", "mincut") and expensive(n))
        and all(meta.block(u) == block for u in n.users if meta.phase(u) == FWD)
    }
    if policy == "mincut":
        inside = _mincut(own, inside)
    needed = [n for n in inside if any(meta.phase(u) == BWD for u in n.users)]
    if not needed:
        return None
    closure: set[fx.Node] = set()
    todo = list(needed)
    while todo:
        n = todo.pop()
        if n in closure:
            continue
        closure.add(n)
        todo += [a for a in n.all_input_nodes if a in inside]
    return Recompute(block, needed, closure)


def _trailing(
    g: fx.Graph,
    plans: list[Recompute],
    lighter: Callable[[str], Recompute | None],
    per_block: dict[str, str],
    budget: int,
) -> tuple[set[str], Trailing | None]:
    """The blocks at the end of the forward that save their activations although their policy
    recomputes them (`plans` in forward order), and the record of it. `lighter(block)`: what such
    a block recomputes still.

    NOTE: [Trailing blocks]
    The backward begins where the forward ends, and holds every value saved for the backward as it
    begins; from its end to the optimizer the step holds every gradient shard instead. While the
    first weighs less than the second, saving more activations does not raise the step's peak. So
    the last blocks save their activations as `remat="mincut"` would (no matrix product or
    attention is recomputed, only cheap ops whose recompute saves memory: the lighter the saved
    blocks, the more of them fit), as many of them as keep the values saved for the backward within
    the gradient shards (both estimated from the traced shapes; of symbolic sizes, at the largest the
    program admits: NOTE: [Dynamic sizes]). The first to save is the last
    block whose recompute involves a matrix product or attention (as an op, or as a saved input with
    "selective"), together with the blocks after it (a final norm, the output layer); then the
    blocks before it, one at a time. Where what the backward reads with every block recomputed
    already outweighs the gradients (many tokens per rank), every block recomputes. A block whose
    policy is set by name (`blocks={path: {"remat": ...}}`, BMTrain's `Block`) keeps it, and so do
    the blocks before it.
    """
    units: list[list[str]] = []  # candidates, last first: each saves together with those before it
    unit: list[str] = []
    for block, _, closure in reversed(plans):
        if block in per_block:
            break
        unit.append(block)
        if any(expensive(n) or any(expensive(a) for a in n.all_input_nodes) for n in closure):
            units.append(unit)
            unit = []
    if not units:
        return set(), None

    @functools.cache  # the search and the summary ask for the same k again
    def saved_with(k: int) -> tuple[set[str], int]:
        keep = {b for u in units[:k] for b in u}
        return keep, saved_bytes(g, [p for p in plans if p.block not in keep] + [p for b in keep if (p := lighter(b))])

    lo, hi = 0, len(units)  # the most units that fit: the saved bytes grow with every unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if saved_with(mid)[1] <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return set(), Trailing(tuple(reversed(units[0])), False, saved_with(1)[1], budget)
    keep, saved = saved_with(lo)
    return keep, Trailing(tuple(p.block for p in plans if p.block in keep), True, saved, budget)


_INF = float("inf")


def _mincut(own: list[fx.Node], cheap: set[fx.Node]) -> set[fx.Node]:
    """The nodes of `cheap` (a block's recomputable ops other than matrix products and attention)
    that the backward should recompute rather than read, so that the block saves the fewest bytes
    (`own`: the block's forward nodes).

    NOTE: [Min-cut]
    `policy="mincut"` recomputes no matrix product or attention, like "none", but lets the backward
    recompute cheap ops where that saves memory, as torch.compile's partitioner does: a norm's fp32
    copy of its input comes back from the bf16 input and the saved reciprocal root mean square,
    SwiGLU's activation from its two projections. It is a minimum cut in the block's forward graph.
    Each value is split into an edge `in -> out` whose capacity is its bytes (the price of saving
    it); each read is an edge `producer out -> consumer in`, and each value the backward reads an
    edge `out -> sink`, both unbounded; values that cannot be recomputed (products, attention,
    random ops, the block's inputs) hang from the source. A cut then saves some values, and
    everything on the sink's side of it is recomputed from them. Views cost nothing to recompute,
    and parameters nothing to save (they are held anyway). Two kinds of cheap value hang from the
    source too:
    - reductions (an output a quarter of its inputs' size or less, a norm's mean square): saving
      their small output is cheaper than reading their input again;
    - the operands of products and attention in both passes (a norm's output, SwiGLU's product,
      attention's reshaped output), NOTE: [Operands]: the forward writes them to memory for its
      product anyway, and a backward product must read them from memory, so recomputing one saves
      its bytes only by writing them a second time, reading its own inputs to do so: under a compiled
      backward saving them is faster, for more memory than recomputing them (BENCHMARKS.md).
    Of the minimum cuts the one that recomputes least is taken.
    """
    nodes = [n for n in own if n.op == "call_function"]
    members = set(nodes) | {a for n in nodes for a in n.all_input_nodes}
    cap: dict[object, dict[object, float]] = {"source": {}, "sink": {}}

    def edge(u: object, v: object, c: float) -> None:
        cap.setdefault(u, {})[v] = cap.get(u, {}).get(v, 0) + c
        cap.setdefault(v, {}).setdefault(u, 0)

    def shrinks(n: fx.Node) -> bool:  # a reduction: recomputing it would read far more than it saves
        return 4 * nbytes(n.meta.get("val")) < sum(nbytes(a.meta.get("val")) for a in n.all_input_nodes)

    for n in members:
        if n in cheap and not shrinks(n) and not (operand(n, FWD) and operand(n, BWD)):
            price = _INF if is_view(n) else nbytes(n.meta.get("val"))
        else:
            edge("source", (n, "in"), _INF)
            price = 0 if ops.view_base(n).op == "placeholder" else nbytes(n.meta.get("val"))
        edge((n, "in"), (n, "out"), price)
        if any(meta.phase(u) == BWD for u in n.users):
            edge((n, "out"), "sink", _INF)
    for n in nodes:
        for a in n.all_input_nodes:
            edge((a, "out"), (n, "in"), _INF)
    _max_flow(cap, "source", "sink")
    reaches_sink, todo = {"sink"}, ["sink"]  # vertices that still reach the sink: the least recompute
    while todo:
        v = todo.pop()
        for u in cap[v]:
            if u not in reaches_sink and cap[u][v] > 0:
                reaches_sink.add(u)
                todo.append(u)
    return {n for n in cheap if (n, "in") in reaches_sink}  # never a reduction: those hang from the source


def operand(n: fx.Node, phase: str) -> bool:
    """Whether a matrix product or attention of `phase` reads `n`, directly or through views
    (NOTE: [Min-cut])."""
    for u in n.users:
        if meta.phase(u) != phase:
            continue
        if expensive(u) or (ops.aliases(u) and operand(u, phase)):
            return True
    return False


def _max_flow(cap: dict[object, dict[object, float]], source: object, sink: object) -> None:
    """Edmonds-Karp: push flow along shortest augmenting paths until none is left; `cap` becomes
    the residual capacities."""
    while True:
        parent, todo = {source: None}, [source]
        for u in todo:  # breadth first
            for v, c in cap[u].items():
                if c > 0 and v not in parent:
                    parent[v] = u
                    todo.append(v)
            if sink in parent:
                break
        if sink not in parent:
            return
        path, v = [], sink
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        pushed = min(cap[u][v] for u, v in path)
        for u, v in path:
            cap[u][v] -= pushed
            cap[v][u] += pushed


def _recompute(g: fx.Graph, needed: list[fx.Node], closure: set[fx.Node]) -> int:
    """Copy `closure` into the backward, each node as late as it can go, and make the backward read
    the copies; the number of copies.

    NOTE: [Late recompute]
    A recomputed value goes right before the first backward node that reads it, or reads a copy that
    needs it, so each copy lives no longer than the backward needs it: a norm's recomputed fp32 input
    is not held through the rest of its block's backward. With `remat="block"` that alone would change
    little: recomputing a block's forward makes every value on the way to its output early in its
    backward, and the backward would read those. So a block is recomputed in two layers: at the start
    of its backward, the values that `remat="mincut"` would save (NOTE: [Min-cut]) are recomputed from
    the block's inputs, and from them, where the backward reads them, the cheap values that
    `remat="mincut"` would recompute (SwiGLU's activation, a norm's fp32 copy of its input). Under a
    compiled backward the late copies fuse into the kernels that read them. The step's peak, at the
    end of the backward, falls by what the late copies no longer hold (BENCHMARKS.md). A
    multi-output op's outputs stay right after it: a compiled region (NOTE: [Regions]) returns
    tensors, and would otherwise have to return the op's tuple.
    """
    anchor: dict[fx.Node, fx.Node] = {}  # the backward node each copy goes right before
    for n in sorted(closure, reverse=True):  # readers before what they read (nodes compare by place)
        readers = [u for u in n.users if meta.phase(u) == BWD]
        readers += [anchor[u] for u in n.users if u in closure]
        anchor[n] = min(readers)
    for n in closure:  # a multi-output op's outputs stay right after it
        if n.target is operator.getitem and n.args[0] in closure:
            anchor[n] = anchor[n.args[0]]
    env: dict[fx.Node, fx.Node] = {}
    for n in sorted(closure):
        with g.inserting_before(anchor[n]):
            env[n] = ops.copy_node(g, n, lambda a: env.get(a, a))  # NOTE: [Names of copies]
        meta.tag(env[n], phase=BWD, recompute="activation")
    copies = set(env.values())
    for n in needed:
        for u in list(n.users):
            if meta.phase(u) == BWD and u not in copies:
                u.replace_input_with(n, env[n])
    return len(env)


def saved_bytes(g: fx.Graph, recomputed: list[Recompute]) -> int:
    """Bytes of the forward values the backward reads once the `recomputed` plans are recomputed (a
    view counts as its base, once; inputs and parameters are held anyway)."""
    read = {
        n
        for n in g.nodes
        if n.op != "placeholder" and meta.phase(n) == FWD and any(meta.phase(u) == BWD for u in n.users)
    }
    for _, needed, closure in recomputed:  # the backward reads the closure's inputs, not `needed`
        read.difference_update(needed)
        read.update(a for n in closure for a in n.all_input_nodes if a not in closure)
    bases = {base for base in map(ops.view_base, read) if base.op != "placeholder"}
    return sum(nbytes(n.meta.get("val")) for n in bases)


def _grad_bytes(program: Program) -> int:
    """Bytes of this rank's gradient shards: what a step holds from the end of its backward on."""
    return sum(g.shard_numel * g.dtype.itemsize for g in program.layout.groups if g.requires_grad)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---- remat="auto": what each block costs under each policy (the search is fbmt.tools.auto_remat) -----

Costs = dict[str, dict[str, tuple[int, float]]]  # block -> policy -> (bytes saved for the backward, seconds recomputed)


def block_costs(program: Program, price: Callable[[fx.Node], float]) -> Costs:
    """For every block and policy: the bytes of the block's own values the backward reads, and the
    seconds its recompute takes (`price(node)` per recomputed node; NOTE: [Auto recompute])."""
    g = program.graph
    fwd = forward_nodes(g)
    # the forward values the backward reads, by the block of what they view: a block's bytes are its own values'
    read_by_bwd: dict[str | None, set[fx.Node]] = {}
    for n in g.nodes:
        if n.op != "placeholder" and meta.phase(n) == FWD and any(meta.phase(u) == BWD for u in n.users):
            read_by_bwd.setdefault(meta.block(ops.view_base(n)), set()).add(n)
    out: Costs = {}
    for block in program.layout.blocks:
        out[block] = {}
        for policy in POLICIES:
            plan = _plan(fwd, block, policy) if policy != "none" else None
            read = set(read_by_bwd.get(block, ()))
            if plan is not None:
                read.difference_update(plan.needed)
                read.update(a for n in plan.closure for a in n.all_input_nodes if a not in plan.closure)
            bases = {ops.view_base(n) for n in read}
            own = sum(nbytes(b.meta.get("val")) for b in bases if b.op != "placeholder" and meta.block(b) == block)
            seconds = sum(price(n) for n in plan.closure) if plan is not None else 0.0
            out[block][policy] = (own, seconds)
    return out
