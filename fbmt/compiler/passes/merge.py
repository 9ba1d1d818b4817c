"""Merge: matrix products that read one input, with weights side by side, become one product.

Requires: a joint Program after `remat` (the forward's products and their recomputed copies in
place), parameters still `param` placeholders.
Ensures, for each run of two or more products `mm(view(A), t(W_i))` of one phase that read the same
input `A` and whose weights lie back to back in one flat group (a Llama block's q, k, v projections;
its gate and up projections):
- one `mm(view(A), t(cat(W_i)))` computes them, and each old product is a column `slice` of it;
  the shard pass turns the `cat` of adjacent parameters into one view of the gathered buffer, so
  merging copies nothing;
- where every product's gradient has the shape autograd gives a linear layer (`dX_i = G_i W_i`
  summed by adds, `dW_i = G_i^T X`), the backward is merged too: `G = cat(G_i)`, one `dX = G W`
  replaces the products and their sum, one `dW = G^T X` gives every weight's gradient as a row
  slice (contiguous: the reduce-scatter reads it in place).
Values are unchanged up to the order of summation.

NOTE: [Merged products]
Why: one product of the summed width runs faster than the separate ones (benchmarks/gemm_merge.py
times them; BENCHMARKS.md), and the merged input gradient does the adds of the separate ones inside
its accumulation; the launches and the `Memset`s cuBLAS issues before each product go too.
Which runs: products of a forward run are split by whether the backward reads them (saves them). A
column slice that is saved keeps the whole merged output alive, so merging q, k (not saved: the
rotary embedding makes new tensors) with v (saved for attention's backward) would hold three times
v's memory from the forward to the backward; q and k merge, v stays alone. Products the remat pass
recomputes in the backward are never saved, and merge whole.
A run whose slices some later view cannot take (a view that needs the old contiguous layout) is left
as it was: each slice's views are re-derived on fake tensors first.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fbmt.compiler import meta, ops
from fbmt.compiler.layout import FlatGroup, ParamSlot
from fbmt.compiler.ops import emit
from fbmt.compiler.ops.tables import RESHAPES
from fbmt.compiler.program import BWD, FWD, Program

aten = torch.ops.aten
_CARRIED = ("block", "module", "recompute")  # the facts a merged node takes from what it replaces


@dataclass(frozen=True)
class MergeStats:
    """What the merge pass did (NOTE: [Pass stats])."""

    runs: tuple[int, ...]  # the number of products of each run merged into one, in program order
    gradients: int  # weight-gradient products merged with their run's

    def __str__(self) -> str:
        sizes = "/".join(map(str, sorted(set(self.runs)))) or "0"
        return f"{len(self.runs)} runs of {sizes} products merged, gradients merged for {self.gradients}"


def merge_products(program: Program) -> tuple[Program, MergeStats]:
    program = program.copy()
    g = program.graph
    slots = _param_slots(program)
    runs = [run for key, members in _products(g, slots).items() for run in _runs(key, members, slots)]
    merged, weight_sets = [], []
    for run in runs:
        if _merge_run(g, run):
            merged.append(len(run))
            if meta.phase(run[0][0]) == FWD:
                weight_sets.append([w for _, w in run])
    grads = sum(_merge_gradients(program, ws, slots) for ws in weight_sets)
    g.lint()
    return program, MergeStats(tuple(merged), grads)


def _param_slots(program: Program) -> dict[fx.Node, tuple[FlatGroup, ParamSlot]]:
    """Parameter placeholders that are matrices -> where they live in their flat group."""
    out = {}
    for n, role in zip(program.placeholders(), program.inputs):
        if role.kind == "param":
            group, slot = program.layout.group_of(role.key)
            if len(slot.shape) == 2:
                out[n] = (group, slot)
    return out


def _shape(node: fx.Node) -> tuple[str, ...]:
    """A node's shape as a key: a symbolic size by its expression (a SymInt has no hash, and comparing
    two would add a guard to the program's assumptions)."""
    return tuple(map(str, node.meta["val"].shape))


def _products(g: fx.Graph, slots: dict) -> dict[tuple, list[tuple[fx.Node, fx.Node]]]:
    """`mm(X, t(W))` nodes by (phase, recompute tag, what X views, X's shape): (product, W)."""
    found: dict[tuple, list] = defaultdict(list)
    for n in g.nodes:
        if n.target is not aten.mm.default:
            continue
        x, tw = n.args
        if not (isinstance(tw, fx.Node) and tw.target is aten.t.default and tw.args[0] in slots):
            continue
        base = x.args[0] if x.target in RESHAPES else x
        found[(meta.phase(n), meta.recompute(n), base, _shape(x))].append((n, tw.args[0]))
    return found


def _runs(key: tuple, members: list, slots: dict) -> list[list[tuple[fx.Node, fx.Node]]]:
    """Members split into runs of weights back to back in one flat group (in buffer order); in the
    forward, saved and unsaved products apart (NOTE: [Merged products])."""
    if len(members) < 2 or len({w for _, w in members}) < len(members):
        return []
    saved = {p: key[0] == FWD and _outlives_forward(p) for p, _ in members}
    runs: list[list] = []
    for p, w in sorted(members, key=lambda m: (slots[m[1]][0].index, slots[m[1]][1].offset)):
        if runs:
            lp, lw = runs[-1][-1]
            (group, slot), (lgroup, lslot) = slots[w], slots[lw]
            if (
                group is lgroup
                and slot.offset == lslot.offset + lslot.numel
                and slot.shape[1] == lslot.shape[1]
                and saved[p] == saved[lp]
            ):  # one flat group: one dtype
                runs[-1].append((p, w))
                continue
        runs.append([(p, w)])
    return [r for r in runs if len(r) >= 2]


def _outlives_forward(node: fx.Node) -> bool:
    """The backward reads the node or a view of it (so the partitioner saves it), or the program
    returns one: either way it outlives the forward."""
    todo = [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if meta.phase(u) == BWD or u.op == "output":
                return True
            if ops.aliases(u) and u.args[0] is n:
                todo.append(u)
    return False


def _merge_run(g: fx.Graph, run: list[tuple[fx.Node, fx.Node]]) -> bool:
    products = [p for p, _ in run]
    first = min(products)  # nodes compare by their place in the graph
    x = first.args[0]
    y_val = ops.fake_like(first.meta["val"], (first.meta["val"].shape[0], sum(w.meta["val"].shape[0] for _, w in run)))
    bounds, start = [], 0
    for _, w in run:
        bounds.append((start, start + w.meta["val"].shape[0]))
        start = bounds[-1][1]
    updates: dict[fx.Node, Any] = {}
    for p, (a, b) in zip(products, bounds):
        if not _views_follow(p, ops.fake_value(y_val.fake_mode, aten.slice.Tensor, (y_val, 1, a, b), {}), updates):
            return False
    tags = meta.facts(first, *_CARRIED)
    phase = meta.phase(first)
    with g.inserting_before(first):
        weights = emit(g, aten.cat.default, ([w for _, w in run], 0), phase, **tags)
        y = emit(g, aten.mm.default, (x, emit(g, aten.t.default, (weights,), phase, **tags)), phase, **tags)
        for p, (a, b) in zip(products, bounds):
            piece = emit(g, aten.slice.Tensor, (y, 1, a, b), phase, **tags)
            p.replace_all_uses_with(piece)
    for n, val in updates.items():
        n.meta["val"] = val
    _erase_dead(g, [n for p in products for n in (p, *p.args)])
    return True


def _views_follow(node: fx.Node, val: torch.Tensor, updates: dict) -> bool:
    """Re-derive the values of `node`'s views (transitively) with `node` taking `val`; False if
    one of them cannot take it (a view that needs the old layout)."""
    for u in node.users:
        if not (ops.aliases(u) and u.args[0] is node):
            continue
        # a symbolic size's node inside a list of sizes too ([2, sym_size_int, 8])
        args = (val, *fx.node.map_arg(tuple(u.args[1:]), lambda a: a.meta.get("val")))
        try:  # every layer's slices take the same views: memoized by metadata (NOTE: [Values by their metadata])
            new = ops.fake_value(val.fake_mode, u.target, args, u.kwargs)
        except (RuntimeError, ValueError):  # a view that needs the old layout: "Cannot view a tensor ..."
            return False
        updates[u] = new
        if not _views_follow(u, new, updates):
            return False
    return True


def _erase_dead(g: fx.Graph, candidates: list[fx.Node]) -> None:
    """Erase the candidates that nothing reads any more, and what only they read, transitively."""
    todo = list(candidates)
    while todo:
        n = todo.pop()
        if n.op != "call_function" or n.users or getattr(n, "_erased", False):  # listed twice, or still read
            continue
        inputs = list(n.all_input_nodes)
        g.erase_node(n)
        todo.extend(inputs)


def _merge_gradients(program: Program, weights: list[fx.Node], slots: dict) -> int:
    """The backward of one merged forward run (NOTE: [Merged products]); 1 if merged, else 0."""
    g = program.graph
    grads = {
        r.key: (i, v) for i, (r, v) in enumerate(zip(program.outputs, program.output_values())) if r.kind == "grad"
    }
    found = [_linear_backward(w, grads.get(slots[w][1].name)) for w in weights]
    if any(f is None for f in found):
        return 0
    dxs, gs, dws, xs, chains = zip(*found)
    if len({(x.args[0] if x.target in RESHAPES else x, _shape(x)) for x in xs}) != 1:
        return 0
    tree = _sum_tree(list(dxs))
    if tree is None:
        return 0
    root, others, internal = tree
    tags = meta.facts(root, *_CARRIED)
    with g.inserting_before(root):
        grad_out = emit(g, aten.cat.default, (list(gs), 1), BWD, **tags)
        w = emit(g, aten.cat.default, (list(weights), 0), BWD, **tags)
        dx = emit(g, aten.mm.default, (grad_out, w), BWD, **tags)
        if _shape(dx) != _shape(root):  # the sizes as the products' own reshapes give them: a symbolic
            # size as the node that computes it, which comes before the root they all feed
            sizes = next(n.args[1] for n in internal if n.target in RESHAPES and _shape(n) == _shape(root))
            dx = emit(g, aten.view.default, (dx, sizes), BWD, **tags)
        for o in others:
            dx = emit(g, aten.add.Tensor, (dx, o), BWD, **tags)
        dw = emit(g, aten.mm.default, (emit(g, aten.t.default, (grad_out,), BWD, **tags), xs[0]), BWD, **tags)
        start, pieces = 0, []
        for wt in weights:
            rows = wt.meta["val"].shape[0]
            pieces.append(emit(g, aten.slice.Tensor, (dw, 0, start, start + rows), BWD, **tags))
            start += rows
    root.replace_all_uses_with(dx)
    values = program.output_values()
    for (index, _), piece in zip((grads[slots[wt][1].name] for wt in weights), pieces):
        values[index] = piece
    program.set_outputs(values, program.outputs)
    _erase_dead(g, [root, *internal, *dxs, *(n for c in chains for n in c)])
    return 1


def _linear_backward(w: fx.Node, grad: tuple[int, Any] | None) -> tuple | None:
    """(dX, G, dW, X, chain from dW to the weight's gradient) where the backward of `mm(X, t(w))` is
    `dX = mm(G, t(t(w)))` and `dW = mm(t(G), X)`, transposed back to `w`'s gradient; else None."""
    if grad is None or not isinstance(grad[1], fx.Node):
        return None
    dxs = [
        m
        for tw in w.users
        if tw.target is aten.t.default
        for tt in tw.users
        if tt.target is aten.t.default and meta.phase(tt) == BWD
        for m in tt.users
        if m.target is aten.mm.default and m.args[1] is tt
    ]
    if len(dxs) != 1:
        return None
    dx = dxs[0]
    gout = dx.args[0]
    dws = [
        m
        for tg in gout.users
        if tg.target is aten.t.default
        for m in tg.users
        if m.target is aten.mm.default and m.args[0] is tg
    ]
    if len(dws) != 1 or len(dx.users) != 1:
        return None
    dw = dws[0]
    chain, n = [dw], dw
    while n is not grad[1]:  # transposes down to the gradient output, each read once
        if len(n.users) != 1:
            return None
        n = next(iter(n.users))
        if n.target is not aten.t.default:
            return None
        chain.append(n)
    if len(grad[1].users) != 1 or (len(chain) - 1) % 2:  # read by the output alone; as many t's as cancel
        return None
    return dx, gout, dw, dw.args[1], chain


def _sum_tree(dxs: list[fx.Node]) -> tuple[fx.Node, list[fx.Node], list[fx.Node]] | None:
    """The smallest tree of adds, each read once, that sums every `dxs` (through reshapes):
    (its root, the other values it adds, its inner nodes); None if there is none."""
    tops, inner = {}, []
    for dx in dxs:  # each product up through its reshapes, each read once
        n = dx
        while len(n.users) == 1 and (u := next(iter(n.users))).target in RESHAPES and u.args[0] is n:
            inner.append(u)
            n = u
        tops[n] = dx
    shape = _shape(next(iter(tops)))
    if any(_shape(t) != shape for t in tops):
        return None

    def leaves(n: fx.Node, root: fx.Node) -> tuple[set, list, list]:
        """(the tops under `n`, the other values its adds add, its adds) through adds read once."""
        if n in tops:
            return {n}, [], []
        if (
            n.target is aten.add.Tensor
            and not n.kwargs
            and len(n.args) == 2
            and all(isinstance(a, fx.Node) for a in n.args)
            and (n is root or len(n.users) == 1)
            and _shape(n) == shape
        ):
            (found_a, others_a, adds_a), (found_b, others_b, adds_b) = (leaves(a, root) for a in n.args)
            return found_a | found_b, others_a + others_b, [n] + adds_a + adds_b
        return set(), [n], []

    node = next(iter(tops))
    while len(node.users) == 1:  # up from the first top, through adds, to the first that covers all
        node = next(iter(node.users))
        if node.target is not aten.add.Tensor:
            return None
        found, others, adds = leaves(node, node)
        if found == set(tops):
            return node, others, inner + adds[1:]
    return None
