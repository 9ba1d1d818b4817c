"""Shard (ZeRO-3 / ZeRO-2): parameters live as flat 1/N shards; gather on use, reduce-scatter grads.

Requires: a joint Program whose parameters are `param` placeholders (after blocks/remat).
Ensures, for each flat group of the layout:
- one `shard` placeholder replaces the group's `param` placeholders;
- forward: one `all_gather` + `wait` right before the group's first forward use, the parameters as
  views of the gathered buffer, and (ZeRO-3) a `release` right after the last forward use;
- backward: ZeRO-3 gathers again right before the first backward use; ZeRO-2 keeps the forward
  buffer (the partitioner saves it) and reads the views from it; either way a `release` follows
  the last backward use. A ZeRO-3 group that no other group's reads separate from its own backward
  reads (the output projection, read last in the forward and first in the backward) is kept
  gathered like ZeRO-2 (NOTE: [Turnaround]), unless its block asks for ZeRO-3 by name;
- gradients: right after the last of the group's parameter gradients is computed, one
  `reduce_scatter` copies them into one flat buffer and reduces it (mean over ranks, or the sum with
  `grad_reduce="sum"`); its `wait` yields the shard gradient
  (output role `shard_grad`). A group none of whose parameters gets a gradient returns None, as
  eager autograd leaves `.grad` None for unused parameters.
Forward values computed from parameters alone (transposes, casts) that the backward reads are
recomputed in the backward from the backward's own views, so no view of a released buffer is saved.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fbmt.passes.remat import recomputable
from fbmt.program import BWD, FWD, FlatGroup, Program, Role, buffer_readers
from fbmt.runtime import collectives

aten = torch.ops.aten


def shard_parameters(program: Program, *, zero: int = 3, per_block: dict[str, int] | None = None,
                     grad_reduce: str = "mean", reduce_dtype: torch.dtype | None = None,
                     direct_grads: bool = False) -> Program:
    """`per_block` overrides `zero` for the named blocks (BMTrain's `Block(zero_level=...)`).
    `direct_grads`: weight gradients that are plain matrix products are written by them straight
    into the reduce-scatter buffer (NOTE: [Direct gradients] in runtime/collectives.py).

    Mixed precision: a group whose compute dtype differs from its storage dtype is cast to the
    compute dtype *before* the gather (half the bytes on the wire), and its gradient, computed in the
    compute dtype, is reduced in `reduce_dtype` (default: the storage dtype) and returned in the
    storage dtype. The casts happen inside the collective calls, so the schedule moves them along.
    """
    started = time.perf_counter()
    per_block = per_block or {}
    for level in (zero, *per_block.values()):
        if level not in (2, 3):
            raise ValueError(f"fbmt.compile(zero={level}): expected 3 (re-gather for backward) or 2 (keep gathered)")
    if grad_reduce not in ("mean", "sum"):
        raise ValueError(f"fbmt.compile(grad_reduce={grad_reduce!r}): expected 'mean' or 'sum'")
    program = program.copy()
    g = program.graph
    roles = dict(zip(program.placeholders(), program.inputs))
    params = {role.key: n for n, role in roles.items() if role.kind == "param"}
    _recompute_param_chains(program, set(params.values()))
    grads = {r.key: v for r, v in zip(program.outputs, program.output_values()) if r.kind == "grad"}

    turnaround = {grp.index for grp in _turnaround(program, params) if grp.block not in per_block}
    first_compute = next(n for n in g.nodes if n.op != "placeholder")
    shards = []
    for group in program.layout.groups:  # all placeholders first: gathers may move anywhere after them
        with g.inserting_before(first_compute):
            shards.append(g.placeholder(f"shard{group.index}"))
        shards[-1].meta["val"] = _fake(program, (group.shard_numel,), group.dtype)
        roles[shards[-1]] = Role("shard", group.index)
    shard_grads: list[tuple[Role, Any]] = []
    dead: list[fx.Node] = []  # direct gradients: the products they replace
    gathers = 0
    for group, shard in zip(program.layout.groups, shards):
        level = 2 if group.index in turnaround else per_block.get(group.block, zero)
        members = [params[s.name] for s in group.slots]
        fwd_buffer = None
        read_by = {ph: [u for p in members for u in p.users if u.meta.get("fbmt_phase") == ph] for ph in (FWD, BWD)}
        for phase, users in read_by.items():
            if not users:
                continue
            first = min(users, key=_order(g).__getitem__)
            with g.inserting_before(first):
                if phase == FWD or level == 3 or fwd_buffer is None:
                    buffer = _gather(g, shard, group, phase)
                    gathers += 1
                else:
                    buffer = fwd_buffer  # ZeRO-2: the forward's gathered buffer lives on
                views = _views(g, buffer, group, phase)
            for p, view in zip(members, views):
                for u in [u for u in p.users if u.meta.get("fbmt_phase") == phase]:
                    u.replace_input_with(p, view)
            _join_adjacent(g, buffer, group, views, phase)
            if phase == FWD:
                fwd_buffer = buffer
            if phase == BWD or level == 3 or not read_by[BWD]:  # ZeRO-2 keeps it only for a backward reader
                _release_after_last_use(g, buffer, phase)
        if group.requires_grad and program.needs_grad:
            grad = _reduce_scatter(program, group, grads, grad_reduce == "mean", reduce_dtype, direct_grads, dead)
            shard_grads.append((Role("shard_grad", group.index), grad))
    for p in params.values():
        assert not p.users, f"parameter placeholder {p.name} still has users {list(p.users)}"
        g.erase_node(p)
        del roles[p]
    program.inputs = [roles[n] for n in program.placeholders()]
    kept = [(r, v) for r, v in zip(program.outputs, program.output_values()) if r.kind != "grad"]
    kept += shard_grads
    program.set_outputs([v for _, v in kept], [r for r, _ in kept])
    for n in dead:  # each chain from the gradient down to its product
        assert not n.users, f"{n.name} is still read by {list(n.users)}"
        g.erase_node(n)
    g.lint()
    n_rs = sum(1 for _, v in shard_grads if v is not None)
    levels = f"zero={zero}" + (f" ({len(per_block)} blocks overridden)" if per_block else "")
    if zero == 3 and turnaround:
        kept = [program.layout.groups[i].block or "<root>" for i in sorted(turnaround)]
        levels += f", kept gathered across the turnaround: {', '.join(kept)}"
    in_place = sum(1 for n in dead if n.target is aten.mm.default)
    direct = f", {in_place} gradients written in place" if direct_grads else ""
    program.record("shard", started, f"{levels}, grads {grad_reduce}: {len(program.layout.groups)} flat groups, "
                   f"{gathers} all-gathers, {n_rs} reduce-scatters{direct}")
    return program


def _turnaround(program: Program, params: dict[str, fx.Node]) -> list[FlatGroup]:
    """Groups whose last forward read and first backward read no other group's read falls between.

    NOTE: [Turnaround]
    The group read last in the forward (the output projection of a language model) is read first in
    the backward: released after the forward, it is gathered again right away, with no compute to
    hide the gather behind (nothing can be prefetched before the backward's first node). Nothing
    else is gathered in between, so keeping its buffer costs only that buffer during the loss, as
    FSDP2 keeps its root module's parameters gathered after the forward."""
    order = _order(program.graph)
    reads = sorted((order[u], group.index) for group in program.layout.groups
                   for s in group.slots for u in params[s.name].users)  # (position, group) of every read
    positions = [i for i, _ in reads]
    kept = []
    for group in program.layout.groups:
        users = [u for s in group.slots for u in params[s.name].users]
        fwd = [order[u] for u in users if u.meta.get("fbmt_phase") == FWD]
        bwd = [order[u] for u in users if u.meta.get("fbmt_phase") == BWD]
        if not fwd or not bwd:
            continue
        between = range(bisect.bisect_right(positions, max(fwd)), bisect.bisect_left(positions, min(bwd)))
        if all(reads[i][1] == group.index for i in between):
            kept.append(group)
    return kept


def _order(g: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(g.nodes)}


def _fake(program: Program, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    for n in program.placeholders():
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            with v.fake_mode:
                return torch.empty(shape, dtype=dtype, device=v.device)
    return None


def emit(g: fx.Graph, target: Any, args: tuple, phase: str, **meta: Any) -> fx.Node:
    """Create a call_function node at the current insert point, with its phase and fake value."""
    node = g.call_function(target, args)
    node.meta.update(fbmt_phase=phase, **meta)
    if isinstance(target, torch._ops.OpOverload):
        vals = fx.node.map_arg(args, lambda a: a.meta.get("val"))  # lists of nodes (a cat's) too
        fake = next((v for v in pytree.tree_leaves(vals) if hasattr(v, "fake_mode")), None)
        if fake is not None:
            with fake.fake_mode:
                node.meta["val"] = target(*vals)
    return node


def _gather(g: fx.Graph, shard: fx.Node, group: FlatGroup, phase: str) -> fx.Node:
    cast = () if group.compute == group.dtype else (group.compute,)
    start = emit(g, collectives.all_gather, (shard, group.world_size, *cast), phase, fbmt_group=group.index)
    buffer = emit(g, collectives.wait, (start,), phase, fbmt_group=group.index)
    v = shard.meta.get("val")
    if v is not None:
        with v.fake_mode:
            buffer.meta["val"] = torch.empty(group.padded_numel, dtype=group.compute, device=v.device)
    return buffer



def _views(g: fx.Graph, buffer: fx.Node, group: FlatGroup, phase: str) -> list[fx.Node]:
    views = []
    for s in group.slots:
        piece = emit(g, aten.slice.Tensor, (buffer, 0, s.offset, s.offset + s.numel), phase)
        views.append(emit(g, aten.view.default, (piece, list(s.shape)), phase))
    return views


def _join_adjacent(g: fx.Graph, buffer: fx.Node, group: FlatGroup, views: list[fx.Node], phase: str) -> None:
    """A `cat` along rows of parameters that lie back to back in the buffer (the merge pass's, NOTE:
    [Merged products]) becomes one view of the buffer: no copy."""
    index = {v: i for i, v in enumerate(views)}
    cats = list(dict.fromkeys(u for v in views for u in v.users if u.target is aten.cat.default))  # in order
    for cat in cats:
        parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
        at = [index.get(p) for p in parts]
        if dim != 0 or None in at or at != list(range(at[0], at[0] + len(at))):
            continue
        first, last = group.slots[at[0]], group.slots[at[-1]]
        if any(group.slots[i].shape[1:] != first.shape[1:] for i in at):
            continue
        with g.inserting_before(cat):
            piece = emit(g, aten.slice.Tensor, (buffer, 0, first.offset, last.offset + last.numel), phase)
            joined = emit(g, aten.view.default, (piece, [sum(group.slots[i].shape[0] for i in at), *first.shape[1:]]),
                          phase, **{k: cat.meta[k] for k in ("fbmt_block", "fbmt_module") if k in cat.meta})
        cat.replace_all_uses_with(joined)
        g.erase_node(cat)


def _release_after_last_use(g: fx.Graph, buffer: fx.Node, phase: str) -> None:
    """Insert `release(buffer)` after the last node of `phase` that reads the buffer or its views."""
    readers, returned = buffer_readers(buffer)
    if returned:
        return  # the buffer itself is returned: it must stay alive
    readers = [r for r in readers if r.meta.get("fbmt_phase") == phase]
    last = max(readers, key=_order(g).__getitem__)
    with g.inserting_before(last.next):
        emit(g, collectives.release, (buffer,), phase, fbmt_group=buffer.meta.get("fbmt_group"))


def _reduce_scatter(program: Program, group: FlatGroup, grads: dict[str, Any], average: bool,
                    reduce_dtype: torch.dtype | None, direct: bool, dead: list[fx.Node]) -> fx.Node | None:
    g = program.graph
    values = [grads.get(s.name) for s in group.slots]
    produced = [v for v in values if isinstance(v, fx.Node)]
    if not produced:
        return None
    wire = reduce_dtype if reduce_dtype is not None and group.compute != group.dtype else group.dtype
    dtypes = () if wire == group.compute == group.dtype else (wire, group.dtype)
    chains = {i: c for i, v in enumerate(values) if direct and (c := _product_chain(v)) is not None}
    buffer = None
    if chains:  # NOTE: [Direct gradients]
        first = min((c[-1] for c in chains.values()), key=_order(g).__getitem__)
        with g.inserting_before(first):
            buffer = emit(g, collectives.grad_buffer, (first.args[0], group.padded_numel, wire), BWD,
                          fbmt_group=group.index)
        buffer.meta["val"] = _fake(program, (group.padded_numel,), wire)
        for i, chain in chains.items():
            mm, slot = chain[-1], group.slots[i]
            with g.inserting_before(mm):
                values[i] = emit(g, collectives.mm_into, (mm.args[0], mm.args[1], buffer, slot.offset), BWD)
            values[i].meta["val"] = _fake(program, (slot.numel,), wire)
        dtypes = (wire, group.dtype)
    last = max((v for v in values if isinstance(v, fx.Node)), key=_order(g).__getitem__)
    with g.inserting_before(last.next):
        pieces = [v if i in chains else emit(g, aten.reshape.default, (v, [-1]), BWD) if isinstance(v, fx.Node)
                  else emit(g, aten.new_zeros.default, (produced[0], [s.numel]), BWD)
                  for i, (s, v) in enumerate(zip(group.slots, values))]
        into = [buffer] if buffer is not None else []
        start = emit(g, collectives.reduce_scatter,
                     (pieces, group.world_size, group.padded_numel, average, *dtypes, *into), BWD, fbmt_group=group.index)
        wait = emit(g, collectives.wait, (start,), BWD, fbmt_group=group.index)
    for chain in chains.values():  # the product and its views: read by nothing once the outputs are replaced
        dead.extend(chain)
    return wait


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _product_chain(v: Any) -> list[fx.Node] | None:
    """[v, ..., mm] when gradient `v` is a matrix product up to reshapes and transposes that cancel
    (so the product's memory is `v`'s, in order), and nothing else reads the product or the steps to
    `v` (NOTE: [Direct gradients]); else None."""
    chain: list[fx.Node] = []
    n = v
    while isinstance(n, fx.Node) and n.op == "call_function":
        chain.append(n)
        if n.target is aten.mm.default or not (n.target in _VIEWS or n.target is aten.t.default):
            break
        n = n.args[0]
    if not chain or chain[-1].target is not aten.mm.default:
        return None
    if any(len(c.users) != 1 for c in chain):  # v: read by the program output only; the rest by the next step
        return None
    open_t = False
    for c in reversed(chain[:-1]):  # from the product outwards: transposes must come in adjacent pairs
        if c.target is aten.t.default:
            open_t = not open_t
        elif open_t:
            return None
    return None if open_t else chain


def _recompute_param_chains(program: Program, params: set[fx.Node]) -> None:
    """Backward reads of forward values computed from parameters alone become backward recomputes."""
    g = program.graph
    derived: dict[fx.Node, bool] = {}

    def is_derived(n: fx.Node) -> bool:
        if n not in derived:
            derived[n] = n in params or (recomputable(n) and bool(n.all_input_nodes)
                                         and all(is_derived(a) for a in n.all_input_nodes))
        return derived[n]

    env: dict[fx.Node, fx.Node] = {}

    def clone(n: fx.Node, before: fx.Node) -> fx.Node:
        if n in params:
            return n
        if n not in env:
            for a in n.all_input_nodes:
                clone(a, before)
            with g.inserting_before(before):
                env[n] = g.node_copy(n, lambda a: env.get(a, a))
            env[n].meta.update(fbmt_phase=BWD, fbmt_recompute="param")
        return env[n]

    for u in list(g.nodes):
        if u.meta.get("fbmt_phase") != BWD or u in env.values():
            continue
        for a in u.all_input_nodes:
            if a.meta.get("fbmt_phase") == FWD and a not in params and is_derived(a):
                u.replace_input_with(a, clone(a, u))
