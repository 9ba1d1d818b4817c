"""Schedule: order communication against compute. In a graph, scheduling is moving nodes.

Requires: the collectives of the shard pass (each start right before its wait).
Ensures, by strategy (registered by name in STRATEGIES; a strategy is a plain function
`(program, *, prefetch) -> summary` that reorders `program.graph` in place):
- "none": no overlap; every collective is waited right after it is issued.
- "prefetch": in each phase, the gather of the k-th group (in order of use) is issued before the
  first compute node of the (k - prefetch)-th group's block, so block i+1's parameters arrive while
  block i computes; the first `prefetch` gathers of a phase are issued when the phase begins, and
  groups too small to hide a gather behind are not counted (NOTE: [Small groups]); each gradient
  reduction is issued as soon as its gradients exist (the shard pass placed it there) and waited
  only when the next one of a large group is issued (the last at the end), so it overlaps the
  backward of the blocks before it while at most one large one is in flight.
Moves starts earlier and waits later, and moves compute only past nodes that do not read it, so data
dependencies are preserved by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from fbmt import ops
from fbmt.ops.tables import EFFECTFUL
from fbmt.program import BWD, FWD, Program

Strategy = Callable[..., str]
STRATEGIES: dict[str, Strategy] = {}


def register_strategy(name: str) -> Callable[[Strategy], Strategy]:
    """Register `fn(program, *, prefetch) -> summary` as `fbmt.compile(schedule=name)`: it reorders
    the copy of the program it is given, in place, and says in one line what it did."""

    def deco(fn: Strategy) -> Strategy:
        STRATEGIES[name] = fn
        return fn

    return deco


def schedule_overlap(program: Program, *, strategy: str = "prefetch", prefetch: int = 1) -> tuple[Program, str]:
    program = program.copy()
    summary = STRATEGIES[strategy](program, prefetch=prefetch)
    program.graph.lint()
    return program, f"{strategy}: {summary}"


def pairs(program: Program, starts: tuple[Callable, ...], phase: str) -> list[tuple[fx.Node, fx.Node]]:
    """(start, wait) of the collectives of `starts`' kinds in one phase, in graph order of the waits."""
    out = []
    for n in program.graph.nodes:
        if n.target is ops.wait and n.args[0].target in starts and n.meta.get("fbmt_phase") == phase:
            out.append((n.args[0], n))
    return out


@register_strategy("none")
def _no_overlap(program: Program, *, prefetch: int) -> str:
    for n in list(program.graph.nodes):
        if n.target is ops.wait and n.args[0].next is not n:
            n.args[0].append(n)
    return "each collective is waited right after it is issued"


@register_strategy("prefetch")
def _prefetch(program: Program, *, prefetch: int) -> str:
    g = program.graph
    blocks = {grp.index: grp.block for grp in program.layout.groups}
    sizes = {grp.index: grp.padded_numel for grp in program.layout.groups}
    moved = 0
    for phase in (FWD, BWD):
        gathers = pairs(program, ops.GATHERS, phase)
        if not gathers:
            continue
        order = ops.node_order(g)
        begin = min(
            (n for n in g.nodes if n.op == "call_function" and n.meta.get("fbmt_phase") == phase), key=order.__getitem__
        )
        anchors = []
        for _, wait in gathers:
            block = blocks[wait.meta["fbmt_group"]]
            first = min(
                (
                    n
                    for n in g.nodes
                    if n.meta.get("fbmt_block") == block
                    and n.meta.get("fbmt_phase") == phase
                    and n.target not in EFFECTFUL
                ),
                key=order.__getitem__,
                default=wait,
            )
            anchors.append(min(first, wait, key=order.__getitem__))
        # NOTE: [Small groups] a group far smaller than the largest (a final norm's weight) computes
        # too little to hide a gather behind: it does not count as one of the `prefetch` steps
        largest = max(sizes[w.meta["fbmt_group"]] for _, w in gathers)
        large = [sizes[w.meta["fbmt_group"]] * 16 >= largest for _, w in gathers]
        for k, (start, _) in enumerate(gathers):
            anchor, ahead = begin, 0  # too few groups before this one: issue it when the phase begins
            for j in range(k - 1, -1, -1):
                ahead += large[j]
                if ahead == prefetch:
                    anchor = anchors[j]
                    break
            if order[start] > order[anchor]:
                anchor.prepend(start)
                moved += 1
    _wait_reductions_late(program, sizes)
    reductions = pairs(program, ops.REDUCTIONS, BWD)
    return f"{moved} gathers issued {prefetch} block(s) ahead; {len(reductions)} reduce-scatters overlapped"


def _large(sizes: dict[int, int], scatters: list[tuple[fx.Node, fx.Node]]) -> list[fx.Node]:
    """The starts of the groups that are not far smaller than the largest (NOTE: [Small groups])."""
    largest = max((sizes[w.meta["fbmt_group"]] for _, w in scatters), default=0)
    return [s for s, w in scatters if sizes[w.meta["fbmt_group"]] * 16 >= largest]


def _wait_reductions_late(program: Program, sizes: dict[int, int]) -> None:
    """Each gradient reduction's wait goes right before the next one is issued: one flat buffer in
    flight at a time. A small group's does not count (NOTE: [Small groups]): the final norm's, issued
    right after the output layer's, would otherwise wait for that one at the start of the backward."""
    reductions = pairs(program, ops.REDUCTIONS, BWD)
    large = _large(sizes, reductions)
    output = program.output_node()
    order = ops.node_order(program.graph)
    for start, wait in reductions:
        nxt = next((s for s in large if order[s] > order[start]), output)
        nxt.prepend(wait)
