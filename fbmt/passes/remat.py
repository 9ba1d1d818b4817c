"""Remat: recompute each block's activations in the backward instead of saving them.

Requires: forward nodes tagged with `fbmt_block` (the blocks pass).
Ensures, with `policy="block"`: no forward value computed inside a block is read by the backward,
except (a) the block's outputs (values that other blocks' forward reads: the next block's inputs,
saved anyway), and (b) values that cannot be recomputed: random ops (recomputing would draw a new
dropout mask) and mutating ops. Each recomputed copy is placed right before the first backward node
that needs it (NOTE: [Late recompute]), tagged `fbmt_recompute="activation"`. With `policy="none"` the pass
declines and says so in the history. `per_block` sets the policy of single blocks.

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
import math
import operator
from collections.abc import Callable
from typing import NamedTuple

import torch.fx as fx

from fbmt import ops
from fbmt.ops import expensive, is_view, nbytes
from fbmt.program import BWD, FWD, Program

POLICIES = ("block", "selective", "mincut", "none")  # and "auto", which the pipeline resolves to these per block


def recomputable(n: fx.Node) -> bool:
    """A pure forward op: running it again in the backward gives the same value."""
    return n.meta.get("fbmt_phase") == FWD and ops.pure(n)


class Plan(NamedTuple):
    """What the backward recomputes of one block."""

    block: str
    needed: list[fx.Node]  # the forward values the backward reads
    closure: set[fx.Node]  # what recomputes them


def recompute_blocks(
    program: Program, *, policy: str = "block", per_block: dict[str, str] | None = None, note: str = ""
) -> tuple[Program, str]:
    """`per_block` overrides `policy` for the named blocks (BMTrain's `Block(use_checkpoint=...)`);
    `note` opens the summary (what chose the policies)."""
    program, summary = _recompute_blocks(program, policy, per_block)
    return program, f"{note}; {summary}" if note else summary


def _recompute_blocks(program: Program, policy: str, per_block: dict[str, str] | None) -> tuple[Program, str]:
    per_block = per_block or {}
    program = program.copy()
    chosen = [b for b in program.layout.blocks if per_block.get(b, policy) != "none"]
    program.remat = {b: per_block.get(b, policy) if program.needs_grad else "none" for b in program.layout.blocks}
    if not chosen or not program.needs_grad:
        why = "forward-only program" if not program.needs_grad else "no block recomputes (remat='none')"
        return program, f"declined: {why}; activations are saved"

    g = program.graph
    order = ops.node_order(g)
    plans = [plan for block in chosen if (plan := _plan(g, block, per_block.get(block, policy)))]

    def forward_order(plan: Plan) -> int:
        return min(map(order.__getitem__, plan.closure))

    plans.sort(key=forward_order)
    lighter = functools.cache(lambda block: _plan(g, block, "mincut"))  # what a saved trailing block recomputes
    saved_blocks, note = _trailing(g, plans, lighter, per_block, _grad_bytes(program))
    plans = [plan for plan in plans if plan.block not in saved_blocks] + [
        plan for block in saved_blocks if (plan := lighter(block))
    ]
    program.remat.update(dict.fromkeys(saved_blocks, "mincut"))  # what a saved trailing block does
    stats = []
    for block, needed, closure in sorted(plans, key=forward_order):
        late = 0
        if per_block.get(block, policy) == "block" and block not in saved_blocks and (inner := lighter(block)):
            late = _recompute(g, inner.needed, inner.closure)  # NOTE: [Late recompute]: the cheap values from
            _, needed, closure = _plan(g, block, "block") or Plan(block, [], set())  # what mincut saves, and that
        copies = _recompute(g, needed, closure) + late  # from the block's inputs
        read = {a for n in closure for a in n.all_input_nodes if a not in closure and a.op != "placeholder"}
        stats.append(f"{block or '<root>'}: {copies} recomputed{f' ({late} late)' if late else ''}, {len(read)} saved")
    return program, "; ".join(stats + [note] if note else stats) or "no block activations reach the backward"


def _plan(g: fx.Graph, block: str, policy: str) -> Plan | None:
    """What the backward recomputes of `block` under `policy`; None if nothing."""
    inside = {
        n
        for n in g.nodes
        if n.meta.get("fbmt_block") == block
        and recomputable(n)
        and not (policy in ("selective", "mincut") and expensive(n))
        and all(u.meta.get("fbmt_block") == block for u in n.users if u.meta.get("fbmt_phase") == FWD)
    }
    if policy == "mincut":
        inside = _mincut(g, block, inside)
    needed = [n for n in inside if any(u.meta.get("fbmt_phase") == BWD for u in n.users)]
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
    return Plan(block, needed, closure)


def _trailing(
    g: fx.Graph, plans: list[Plan], lighter: Callable[[str], Plan | None], per_block: dict[str, str], budget: int
) -> tuple[set[str], str]:
    """The blocks at the end of the forward that save their activations although their policy
    recomputes them (`plans` in forward order), and what to say about it. `lighter(block)`: what such
    a block recomputes still.

    NOTE: [Trailing blocks]
    The backward begins where the forward ends, and holds every value saved for the backward as it
    begins; from its end to the optimizer the step holds every gradient shard instead. While the
    first weighs less than the second, saving more activations does not raise the step's peak. So
    the last blocks save their activations as `remat="mincut"` would (no matrix product or
    attention is recomputed, only cheap ops whose recompute saves memory: the lighter the saved
    blocks, the more of them fit), as many of them as keep the values saved for the backward within
    the gradient shards (both estimated from the traced shapes). The first to save is the last
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
        return set(), ""

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
        names = ", ".join(b or "<root>" for b in reversed(units[0]))
        return set(), (
            f"{names}: recomputed although the backward begins with them "
            f"({_size(saved_with(1)[1])} saved for the backward > {_size(budget)} of gradients)"
        )
    keep, saved = saved_with(lo)
    names = [p.block or "<root>" for p in plans if p.block in keep]
    listed = ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]} ({len(names)} blocks)"
    return keep, (
        f"{listed}: saved, the backward begins with them "
        f"({_size(saved)} saved for the backward <= {_size(budget)} of gradients)"
    )


_INF = float("inf")


def _mincut(g: fx.Graph, block: str, cheap: set[fx.Node]) -> set[fx.Node]:
    """The nodes of `cheap` (a block's recomputable ops other than matrix products and attention)
    that the backward should recompute rather than read, so that the block saves the fewest bytes.

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
    nodes = [
        n
        for n in g.nodes
        if n.meta.get("fbmt_block") == block and n.meta.get("fbmt_phase") == FWD and n.op == "call_function"
    ]
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
        if any(u.meta.get("fbmt_phase") == BWD for u in n.users):
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
        if u.meta.get("fbmt_phase") != phase:
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
    order = ops.node_order(g)
    anchor: dict[fx.Node, fx.Node] = {}  # the backward node each copy goes right before
    for n in sorted(closure, key=order.__getitem__, reverse=True):  # readers before what they read
        readers = [u for u in n.users if u.meta.get("fbmt_phase") == BWD]
        readers += [anchor[u] for u in n.users if u in closure]
        anchor[n] = min(readers, key=order.__getitem__)
    for n in closure:  # a multi-output op's outputs stay right after it
        if n.target is operator.getitem and n.args[0] in closure:
            anchor[n] = anchor[n.args[0]]
    env: dict[fx.Node, fx.Node] = {}
    for n in sorted(closure, key=order.__getitem__):
        with g.inserting_before(anchor[n]):
            env[n] = g.node_copy(n, lambda a: env.get(a, a))
        env[n].meta.update(fbmt_phase=BWD, fbmt_recompute="activation")
    copies = set(env.values())
    for n in needed:
        for u in list(n.users):
            if u.meta.get("fbmt_phase") == BWD and u not in copies:
                u.replace_input_with(n, env[n])
    return len(env)


def saved_bytes(g: fx.Graph, recomputed: list[Plan]) -> int:
    """Bytes of the forward values the backward reads once the `recomputed` plans are recomputed (a
    view counts as its base, once; inputs and parameters are held anyway)."""
    read = {
        n
        for n in g.nodes
        if n.op != "placeholder"
        and n.meta.get("fbmt_phase") == FWD
        and any(u.meta.get("fbmt_phase") == BWD for u in n.users)
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


# ---- remat="auto": what each block costs under each policy, and the cheapest choice that fits ------

Costs = dict[str, dict[str, tuple[int, float]]]  # block -> policy -> (bytes saved for the backward, seconds recomputed)


def block_costs(program: Program, price: Callable[[fx.Node], float]) -> Costs:
    """For every block and policy: the bytes of the block's own values the backward reads, and the
    seconds its recompute takes (`price(node)` per recomputed node; NOTE: [Auto recompute])."""
    g = program.graph
    read_by_bwd = {
        n
        for n in g.nodes
        if n.op != "placeholder"
        and n.meta.get("fbmt_phase") == FWD
        and any(u.meta.get("fbmt_phase") == BWD for u in n.users)
    }
    out: Costs = {}
    for block in program.layout.blocks:
        out[block] = {}
        for policy in POLICIES:
            plan = _plan(g, block, policy) if policy != "none" else None
            read = set(read_by_bwd)
            if plan is not None:
                read.difference_update(plan.needed)
                read.update(a for n in plan.closure for a in n.all_input_nodes if a not in plan.closure)
            bases = {ops.view_base(n) for n in read}
            own = sum(
                nbytes(b.meta.get("val")) for b in bases if b.op != "placeholder" and b.meta.get("fbmt_block") == block
            )
            seconds = sum(price(n) for n in plan.closure) if plan is not None else 0.0
            out[block][policy] = (own, seconds)
    return out


def cheapest_within(costs: Costs, capacity: float, bins: int = 2000) -> dict[str, str] | None:
    """The policy per block that recomputes the fewest seconds while the blocks' saved bytes sum to
    at most `capacity`; None if even the least memory does not fit (NOTE: [Auto recompute]).

    A multiple-choice knapsack, solved by dynamic programming over the capacity cut into `bins`
    steps (each block's bytes rounded up, so a choice that fits here fits exactly): blocks x policies
    x bins steps, a few million for 80 blocks."""
    if capacity < 0:
        return None
    bins = max(0, min(bins, int(capacity)))  # a step is at least a byte
    step = capacity / bins if bins else 1.0
    blocks = list(costs)
    inf = float("inf")
    best = [0.0] + [inf] * bins  # best[w]: least seconds with exactly w steps used so far
    choice: list[list[tuple[int, str] | None]] = []
    for block in blocks:
        nxt = [inf] * (bins + 1)
        pick: list[tuple[int, str] | None] = [None] * (bins + 1)
        for policy, (b, s) in costs[block].items():
            w = math.ceil(b / step - 1e-9)
            if w > bins:
                continue
            for used in range(bins + 1 - w):
                if best[used] + s < nxt[used + w]:
                    nxt[used + w] = best[used] + s
                    pick[used + w] = (used, policy)
        best = nxt
        choice.append(pick)
    end = min(range(bins + 1), key=best.__getitem__)
    if best[end] == inf:
        return None
    chosen: dict[str, str] = {}
    for block, pick in zip(reversed(blocks), reversed(choice)):
        used, policy = pick[end]
        chosen[block] = policy
        end = used
    return chosen
