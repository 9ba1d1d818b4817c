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
- gradients: right after the last of the group's parameter gradients is computed, one reduction
  copies them into one flat buffer and reduces it over ranks (mean, or the sum with
  `grad_reduce="sum"`): a `reduce_scatter`, or an `all_to_all_reduce` on a narrow wire (NOTE:
  [Narrow wire]); its `wait` yields the shard gradient (output role `shard_grad`). A group none of
  whose parameters gets a gradient returns None, as eager autograd leaves `.grad` None for unused
  parameters; a parameter without a gradient in a group that has one gets zeros (NOTE: [Unused
  parameters]).
Forward values computed from parameters alone (transposes, casts) that the backward reads are
recomputed in the backward from the backward's own views, so no view of a released buffer is saved;
but a reduction of parameters (an FP8 weight's amax) is saved: it is a buffer of its own, a fraction
of the parameter's size, and recomputing it would read the whole parameter again.

NOTE: [Narrow wire]
With mixed precision the gradients are bf16 (fp16) values, summed in fp32. Cast to fp32 before a
reduce-scatter, as FSDP2 does, half of every byte on the wire is zeros: the cast is exact. So on a
narrow wire the pieces travel in their own dtype, through an all-to-all (rank r receives every
rank's r-th chunk), and the receiver sums the chunks in fp32: the same sum, with the same precision,
for half the bytes on the wire and in the copy-in. It pays where the all-to-all is as fast as a ring
(within one node), so `narrow_wire=None` takes it when every rank is on one node; across nodes a
ring reduce-scatter scales better.

NOTE: [Offload]
With `offload=True` (FSDP2's CPUOffloadPolicy, ZeRO-Offload) the flat shards live in pinned host
memory, and with them their gradients and the optimizer's state: a device holds only what a step
computes with, the gathered groups and the activations. The program is the one without offload but
for its collective kinds (the table's host rows, which `Need.host` selects): `all_gather_from_host`
copies the shard to the device on the copy stream and gathers it there, `reduce_scatter_to_host`
reduces as before and copies this rank's shard of the gradient back. So the copies are where the
collectives are: the schedule issues them as early and waits for them as late as it does the
collectives, the simulator prices them (`host_bandwidth`, across PCIe, before or after the
transfer), remat="auto" with it, and `print(program)` shows them. The host tensors are complete once
the device has run the copies: the Executable (runtime/partition.py) synchronizes with the device at
the end of an offloaded forward (the optimizer may write the shards next) and backward (autograd
reads the gradients). The optimizer steps on the host: `AdamOffloadOptimizer` updates an fp32 host
shard in place with the C++ Adam, and any torch optimizer works on CPU tensors. Where the host is the
device (a CPU rank) the host kinds run as the plain ones.

NOTE: [Unused parameters]
A call may not read every trainable parameter (DINOv2's mask token without `bool_masked_pos`, a
pooler a head skips). Eager autograd leaves such a parameter's `.grad` None, and torch's optimizers
skip it: no weight decay, no momentum, no step. fbmt's optimizer sees flat shards, one per group: a
group none of whose parameters is read gets None too, but one whose others are read has a gradient,
in which the unread parameter's elements are zeros, and an optimizer with weight decay (AdamW) or
momentum still changes them. No layout decided before the calls can avoid this for every call (one
call reads what another does not), so the pass names them (`ShardStats.unused`, the program's
summary) and the model warns once per set (`CompiledModule._say_unused`): freezing them before
`fbmt.compile` keeps them as they are.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fbmt.compiler import collectives, meta, ops
from fbmt.compiler.collectives import GATHER, REDUCE, Need
from fbmt.compiler.layout import FlatGroup
from fbmt.compiler.ops import emit
from fbmt.compiler.program import BWD, FWD, Program, Role

aten = torch.ops.aten


@dataclass(frozen=True)
class ShardStats:
    """What the shard pass did (NOTE: [Pass stats])."""

    zero: int  # the level of every block not named
    zero_by_block: dict[str, int]  # the blocks whose level was set by name (BMTrain's Block, blocks=)
    turnaround: tuple[str, ...]  # the blocks kept gathered across the turnaround (NOTE: [Turnaround])
    grad_reduce: str  # "mean" or "sum"
    groups: int  # flat groups
    gathers: int  # all-gather starts
    reductions: dict[str, int]  # gradient reductions, by kind
    labels: dict[str, str] = field(default_factory=dict)  # how the summary names a kind's (its table row's label)
    offload: bool = False  # the shards live in host memory (NOTE: [Offload])
    unused: tuple[
        str, ...
    ] = ()  # trainable parameters the program does not read: zero gradients (NOTE: [Unused parameters])

    def __str__(self) -> str:
        levels = f"zero={self.zero}" + (f" ({len(self.zero_by_block)} blocks overridden)" if self.zero_by_block else "")
        if self.zero == 3 and self.turnaround:
            levels += f", kept gathered across the turnaround: {', '.join(b or '<root>' for b in self.turnaround)}"
        labelled = [f" ({n} {self.labels[name]})" for name, n in self.reductions.items() if self.labels.get(name)]
        gathers = f"{self.gathers} all-gathers" + (" (from host memory)" if self.offload else "")
        unused = ""
        if self.unused:
            names = ", ".join(self.unused[:3]) + (f" and {len(self.unused) - 3} more" if len(self.unused) > 3 else "")
            n = len(self.unused)
            unused = f"; zero gradients for {n} parameter{'s' if n > 1 else ''} this call does not use: {names}"
        return (
            f"{levels}, grads {self.grad_reduce}: {self.groups} flat groups, {gathers}, "
            f"{sum(self.reductions.values())} reduce-scatters{''.join(labelled)}{unused}"
        )


def shard_parameters(
    program: Program,
    *,
    zero: int = 3,
    per_block: dict[str, int] | None = None,
    grad_reduce: str = "mean",
    reduce_dtype: torch.dtype | None = None,
    narrow_wire: bool = False,
    offload: bool = False,
) -> tuple[Program, ShardStats]:
    """`per_block` overrides `zero` for the named blocks (BMTrain's `Block(zero_level=...)`).

    Mixed precision: a group whose compute dtype differs from its storage dtype is cast to the
    compute dtype *before* the gather (half the bytes on the wire), and its gradient, computed in the
    compute dtype, is reduced in `reduce_dtype` (default: the storage dtype) and returned in the
    storage dtype. The casts happen inside the collective calls, so the schedule moves them along.
    `narrow_wire`: a gradient reduced in a wider dtype than its own travels in its own (NOTE: [Narrow
    wire]). `offload`: the shards live in host memory; their collectives copy across (NOTE: [Offload]).
    """
    per_block = per_block or {}
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
        shards[-1].meta["val"] = program.fake((group.shard_numel,), group.dtype)
        roles[shards[-1]] = Role("shard", group.index)
    shard_grads: list[tuple[Role, Any]] = []
    unused: list[str] = []  # NOTE: [Unused parameters]
    gathers = 0
    for group, shard in zip(program.layout.groups, shards):
        level = 2 if group.index in turnaround else per_block.get(group.block, zero)
        members = [params[s.name] for s in group.slots]
        fwd_buffer = None
        read_by = {ph: [u for p in members for u in p.users if meta.phase(u) == ph] for ph in (FWD, BWD)}
        for phase, users in read_by.items():
            if not users:
                continue
            first = min(users)  # nodes compare by their place in the graph
            with g.inserting_before(first):
                if phase == FWD or level == 3 or fwd_buffer is None:
                    buffer = _gather(g, shard, group, phase, offload)
                    gathers += 1
                else:
                    buffer = fwd_buffer  # ZeRO-2: the forward's gathered buffer lives on
                views = _views(g, buffer, group, phase)
            for p, view in zip(members, views):
                for u in [u for u in p.users if meta.phase(u) == phase]:
                    u.replace_input_with(p, view)
            _join_adjacent(g, buffer, group, views, phase)
            if phase == FWD:
                fwd_buffer = buffer
            if phase == BWD or level == 3 or not read_by[BWD]:  # ZeRO-2 keeps it only for a backward reader
                _release_after_last_use(g, buffer, phase)
        if group.requires_grad and program.needs_grad:
            grad = _reduce(program, group, grads, grad_reduce == "mean", reduce_dtype, narrow_wire, offload)
            shard_grads.append((Role("shard_grad", group.index), grad))
            if grad is not None:
                unused += [s.name for s in group.slots if not isinstance(grads.get(s.name), fx.Node)]
    for p in params.values():
        assert not p.users, f"parameter placeholder {p.name} still has users {list(p.users)}"
        g.erase_node(p)
        del roles[p]
    program.inputs = [roles[n] for n in program.placeholders()]
    kept = [(r, v) for r, v in zip(program.outputs, program.output_values()) if r.kind != "grad"]
    kept += shard_grads
    program.set_outputs([v for _, v in kept], [r for r, _ in kept])
    g.lint()
    reductions = Counter(v.args[0].target.__name__ for _, v in shard_grads if v is not None)
    held = tuple(program.layout.groups[i].block for i in sorted(turnaround))
    groups = len(program.layout.groups)
    labels = {name: kind.label for name in reductions if (kind := collectives.named(name)) is not None and kind.label}
    stats = ShardStats(
        zero, dict(per_block), held, grad_reduce, groups, gathers, dict(reductions), labels, offload, tuple(unused)
    )
    return program, stats


def _turnaround(program: Program, params: dict[str, fx.Node]) -> list[FlatGroup]:
    """Groups whose last forward read and first backward read no other group's read falls between.

    NOTE: [Turnaround]
    The group read last in the forward (the output projection of a language model) is read first in
    the backward: released after the forward, it is gathered again right away, with no compute to
    hide the gather behind (nothing can be prefetched before the backward's first node). Nothing
    else is gathered in between, so keeping its buffer costs only that buffer during the loss, as
    FSDP2 keeps its root module's parameters gathered after the forward."""
    order = ops.node_order(program.graph)
    reads = sorted(
        (order[u], group.index) for group in program.layout.groups for s in group.slots for u in params[s.name].users
    )  # (position, group) of every read
    positions = [i for i, _ in reads]
    kept = []
    for group in program.layout.groups:
        users = [u for s in group.slots for u in params[s.name].users]
        fwd = [order[u] for u in users if meta.phase(u) == FWD]
        bwd = [order[u] for u in users if meta.phase(u) == BWD]
        if not fwd or not bwd:
            continue
        between = range(bisect.bisect_right(positions, max(fwd)), bisect.bisect_left(positions, min(bwd)))
        if all(reads[i][1] == group.index for i in between):
            kept.append(group)
    return kept


def _gather(g: fx.Graph, shard: fx.Node, group: FlatGroup, phase: str, offload: bool) -> fx.Node:
    cast = () if group.compute == group.dtype else (group.compute,)
    need = Need(group.world_size, group.compute, None, group.compute, False, offload)
    kind = collectives.choose(GATHER, need)
    start = emit(g, kind.node, (shard, group.world_size, *cast), phase, group=group.index)
    buffer = emit(g, collectives.wait, (start,), phase, group=group.index)
    v = shard.meta.get("val")
    if v is not None:
        buffer.meta["val"] = ops.fake_like(v, (group.padded_numel,), group.compute)
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
            joined = emit(
                g,
                aten.view.default,
                (piece, [sum(group.slots[i].shape[0] for i in at), *first.shape[1:]]),
                phase,
                **meta.facts(cat, "block", "module"),
            )
        cat.replace_all_uses_with(joined)
        g.erase_node(cat)


def _release_after_last_use(g: fx.Graph, buffer: fx.Node, phase: str) -> None:
    """Insert `release(buffer)` after the last node of `phase` that reads the buffer or its views."""
    readers, returned = ops.buffer_readers(buffer)
    if returned:
        return  # the buffer itself is returned: it must stay alive
    readers = [r for r in readers if meta.phase(r) == phase]
    last = max(readers)
    with g.inserting_before(last.next):
        emit(g, collectives.release, (buffer,), phase, group=meta.group(buffer))


def _reduce(
    program: Program,
    group: FlatGroup,
    grads: dict[str, Any],
    average: bool,
    reduce_dtype: torch.dtype | None,
    narrow_wire: bool,
    offload: bool,
) -> fx.Node | None:
    """Right after the group's last gradient: one reduction of all of them over ranks, and its wait."""
    g = program.graph
    values = [grads.get(s.name) for s in group.slots]
    produced = [v for v in values if isinstance(v, fx.Node)]
    if not produced:
        return None
    wire = reduce_dtype if reduce_dtype is not None and group.compute != group.dtype else group.dtype
    last = max(produced)
    with g.inserting_before(last.next):
        pieces = [
            emit(g, aten.reshape.default, (v, [-1]), BWD)
            if isinstance(v, fx.Node)
            else emit(g, aten.new_zeros.default, (produced[0], [s.numel]), BWD)
            for s, v in zip(group.slots, values)
        ]
        dtypes = {v.meta["val"].dtype for v in produced}
        grads_dtype = dtypes.pop() if len(dtypes) == 1 else None
        need = Need(group.world_size, group.compute, grads_dtype, wire, narrow_wire and not offload, offload)
        kind = collectives.choose(REDUCE, need)
        sent = collectives.wire_dtype(kind, need)  # NOTE: [Narrow wire]: a kind may send narrower than it sums
        args = (pieces, group.world_size, group.padded_numel, average, sent, wire, group.dtype)
        start = emit(g, kind.node, args, BWD, group=group.index)
        return emit(g, collectives.wait, (start,), BWD, group=group.index)


def _recompute_param_chains(program: Program, params: set[fx.Node]) -> None:
    """Backward reads of forward values computed from parameters alone become backward recomputes."""
    g = program.graph
    # in the graph's order, each node's inputs are decided before it: a recursion from the backward's
    # reads would go as deep as the forward's chain of layers (a GPT-2 of 12 layers passed Python's limit)
    derived: dict[fx.Node, bool] = {}
    for n in g.nodes:
        derived[n] = n in params or (
            meta.phase(n) == FWD
            and ops.pure(n)
            and bool(n.all_input_nodes)
            and all(derived[a] for a in n.all_input_nodes)
        )

    env: dict[fx.Node, fx.Node] = {}

    def clone(n: fx.Node, before: fx.Node) -> fx.Node:
        if n in params or _reduced(n):
            return n
        if n not in env:
            for a in n.all_input_nodes:
                clone(a, before)
            with g.inserting_before(before):
                env[n] = ops.copy_node(g, n, lambda a: env.get(a, a))  # NOTE: [Names of copies]
            meta.tag(env[n], phase=BWD, recompute="param")
        return env[n]

    for u in list(g.nodes):
        if meta.phase(u) != BWD or u in env.values():
            continue
        for a in u.all_input_nodes:
            if meta.phase(a) == FWD and a not in params and derived[a] and not _reduced(a):
                u.replace_input_with(a, clone(a, u))


def _reduced(n: fx.Node) -> bool:
    """A reduction: a value of its own at most 1/64 the size of an input (a weight's amax, its norm)."""
    out = n.meta.get("val")
    return (
        isinstance(out, torch.Tensor)
        and not ops.is_view(n)
        and any(
            isinstance(v := a.meta.get("val"), torch.Tensor) and 64 * out.numel() <= v.numel()
            for a in n.all_input_nodes
        )
    )
