"""Schedule: order communication against compute. In a graph, scheduling is moving nodes.

Requires: the collectives of the shard pass (each start right before its wait).
Ensures, by strategy (registered by name in STRATEGIES; a strategy is a plain function
`(program, *, prefetch) -> summary` that reorders `program.graph` in place):
- "none": no overlap; every collective is waited right after it is issued.
- "prefetch": in each phase, the gather of the k-th group (in order of use) is issued before the
  first compute node of the (k - prefetch)-th group's block, so block i+1's parameters arrive while
  block i computes; the first `prefetch` gathers of a phase are issued when the phase begins, and
  groups too small to hide a gather behind are not counted (NOTE: [Small groups]); each
  reduce-scatter is issued as soon as its gradients exist (the shard pass placed it there) and
  waited only when the next one of a large group is issued, or its buffer made (the last at the
  end), so it overlaps the backward of the blocks before it while at most one large one is in flight;
- "prefetch-tail": "prefetch", and the weight gradients that only the first block's reduce-scatter
  needs are computed after the last group's reduce-scatter start, as many as keep the estimated
  peak memory (NOTE: [Tail]).
Moves starts earlier and waits later, and moves compute only past nodes that do not read it, so data
dependencies are preserved by construction.
"""

from __future__ import annotations

import functools
import operator
import time
from typing import Callable

import torch
import torch.fx as fx

from fbmt.program import BWD, FWD, Program, is_view
from fbmt.runtime import collectives
from fbmt.sim import H200, compute_time, flops, peak_memory

Strategy = Callable[..., str]
STRATEGIES: dict[str, Strategy] = {}


def register_strategy(name: str) -> Callable[[Strategy], Strategy]:
    def deco(fn: Strategy) -> Strategy:
        STRATEGIES[name] = fn
        return fn
    return deco


def schedule_overlap(program: Program, *, strategy: str = "prefetch", prefetch: int = 1) -> Program:
    started = time.perf_counter()
    if strategy not in STRATEGIES:
        raise ValueError(f"fbmt.compile(schedule={strategy!r}): known strategies are {sorted(STRATEGIES)}; "
                         "add one with fbmt.passes.schedule.register_strategy")
    if prefetch < 1:
        raise ValueError(f"fbmt.compile(prefetch={prefetch}): must be at least 1")
    program = program.copy()
    summary = STRATEGIES[strategy](program, prefetch=prefetch)
    program.graph.lint()
    program.record("schedule", started, f"{strategy}: {summary}")
    return program


def pairs(program: Program, start_fn: Callable, phase: str) -> list[tuple[fx.Node, fx.Node]]:
    """(start, wait) of one collective kind in one phase, in graph order of the waits."""
    out = []
    for n in program.graph.nodes:
        if n.target is collectives.wait and n.args[0].target is start_fn and n.meta.get("fbmt_phase") == phase:
            out.append((n.args[0], n))
    return out


@register_strategy("none")
def _no_overlap(program: Program, *, prefetch: int) -> str:
    for n in list(program.graph.nodes):
        if n.target is collectives.wait and n.args[0].next is not n:
            n.args[0].append(n)
    return "each collective is waited right after it is issued"


@register_strategy("prefetch")
def _prefetch(program: Program, *, prefetch: int, tail: bool = False) -> str:
    g = program.graph
    blocks = {grp.index: grp.block for grp in program.layout.groups}
    sizes = {grp.index: grp.padded_numel for grp in program.layout.groups}
    moved = 0
    for phase in (FWD, BWD):
        gathers = pairs(program, collectives.all_gather, phase)
        if not gathers:
            continue
        order = {n: i for i, n in enumerate(g.nodes)}
        begin = min((n for n in g.nodes if n.op == "call_function" and n.meta.get("fbmt_phase") == phase),
                    key=order.__getitem__)
        anchors = []
        for start, wait in gathers:
            block = blocks[wait.meta["fbmt_group"]]
            first = min((n for n in g.nodes if n.meta.get("fbmt_block") == block
                         and n.meta.get("fbmt_phase") == phase and n.target not in collectives.EFFECTFUL),
                        key=order.__getitem__, default=wait)
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
    if tail:  # NOTE: [Tail]
        return _summary(program, moved, prefetch) + _sink_tail(program, sizes)
    _wait_scatters_late(program, sizes)
    return _summary(program, moved, prefetch)


STRATEGIES["prefetch-tail"] = functools.partial(_prefetch, tail=True)


def _summary(program: Program, moved: int, prefetch: int) -> str:
    scatters = pairs(program, collectives.reduce_scatter, BWD)
    return f"{moved} gathers issued {prefetch} block(s) ahead; {len(scatters)} reduce-scatters overlapped"


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _large(sizes: dict[int, int], scatters: list[tuple[fx.Node, fx.Node]]) -> list[fx.Node]:
    """The starts of the groups that are not far smaller than the largest (NOTE: [Small groups])."""
    largest = max((sizes[w.meta["fbmt_group"]] for _, w in scatters), default=0)
    return [s for s, w in scatters if sizes[w.meta["fbmt_group"]] * 16 >= largest]


def _wait_scatters_late(program: Program, sizes: dict[int, int]) -> None:
    """Each wait goes right before the next reduce-scatter, or before its buffer is made when its
    gradients are written in place (NOTE: [Direct gradients]): one flat buffer in flight at a time.
    A small group's reduce-scatter does not count (NOTE: [Small groups]): the final norm's, issued
    right after the output layer's, would otherwise wait for that one at the start of the backward."""
    g = program.graph
    scatters = pairs(program, collectives.reduce_scatter, BWD)
    large = _large(sizes, scatters)
    output = program.output_node()
    order = {n: i for i, n in enumerate(g.nodes)}
    for start, wait in scatters:
        nxt = next((s for s in large if order[s] > order[start]), output)
        buffer = nxt.args[6] if nxt is not output and len(nxt.args) > 6 else None
        if buffer is not None and order[buffer] > order[start]:
            nxt = buffer
        nxt.prepend(wait)


# NOTE: [Tail]
# In trace order the backward ends with the first block's backward and then the embedding's (the
# module that read the inputs first). The first block's weight gradients (products of its saved
# inputs and its output gradients) come before the embedding's backward, so the reduce-scatters of
# both groups start after the step's last product and run exposed: on 2x H200 the 1.36B step's
# compute stream idled 1.2-1.8 ms (of 265) at the end, waiting for them (BENCHMARKS.md). Those
# weight gradients feed nothing but their group's reduce-scatter, so "prefetch-tail" moves them,
# with that reduce-scatter, after the last group's reduce-scatter start: the embedding's gradient is
# made first and its reduce-scatter runs beside the first block's weight products; only the first
# block's own is left at the end. The moved products keep their operands (saved activations,
# output gradients) alive a little longer, which at the end of a backward that recomputes its blocks
# is where the peak is: a binary search keeps the most products (the last ones) whose move does not
# raise the simulator's peak (fbmt.sim.peak_memory), and the pass summary says how many.
# Measured (session 9, BENCHMARKS.md): the 1.36B step's idle end went from 1.21 to 0.57 ms, but its
# time did not change measurably (0.998x, 1.001x with block recompute); 6.7B ran 1.003x faster with
# 5 of 7 products moved, at 0.37 GiB more peak memory than the estimate said. So it is a strategy to
# choose, not the default.
def _sink_tail(program: Program, sizes: dict[int, int]) -> str:
    """Place the reduce-scatters' waits late, after moving the weight products that only one group's
    reduce-scatter needs, and that reduce-scatter, after the last reduce-scatter start: the latest
    such group before the last, as many of its products (the last ones) as keep the estimated peak
    memory where it was (NOTE: [Tail]). Returns what it did for the pass summary ("; ...")."""
    found = _tail(program, sizes)
    if found is None:
        _wait_scatters_late(program, sizes)
        return ""
    start, wait, last_wait, own, products = found

    def moved(keep: int) -> Program:
        """A copy with the products from the `keep`-th on (and what follows them) moved."""
        trial = program.copy()
        by_name = {n.name: n for n in trial.graph.nodes}
        anchor = by_name[last_wait.name]
        for n in [*own[own.index(products[keep]):], start, wait]:
            anchor.append(by_name[n.name])
            anchor = by_name[n.name]
        _wait_scatters_late(trial, sizes)
        return trial

    base = program.copy()
    _wait_scatters_late(base, sizes)
    limit = peak_memory(base)
    # the fewest products kept in place (the first ones) whose move keeps the peak: every product
    # moved is tried first, the usual case, then the count is bisected
    best, grows = None, 0
    lo, hi = 0, len(products) - 1
    while lo <= hi:
        keep = 0 if lo == 0 and best is None else (lo + hi) // 2
        trial = moved(keep)
        extra = peak_memory(trial) - limit
        if extra <= 0:
            best, hi = (keep, trial), keep - 1
        else:
            grows, lo = extra, keep + 1
    groups = program.layout.groups
    group, last = (groups[w.meta["fbmt_group"]].block or "<root>" for w in (wait, last_wait))
    if best is None:
        program.graph = base.graph
        return (f"; the tail kept in order: moving {group}'s last weight-gradient product after {last}'s "
                f"reduce-scatter start would raise peak memory by {_size(grows)} (NOTE: [Tail])")
    keep, trial = best
    program.graph = trial.graph
    ms = sum(compute_time(n, H200) for n in own[own.index(products[keep]):]) * 1e3
    count = f"{len(products)}" if keep == 0 else f"last {len(products) - keep} of {len(products)}"
    return (f"; moved {group}'s {count} weight-gradient products after {last}'s reduce-scatter start: "
            f"{ms:.2f} ms of compute beside it on an H200 (NOTE: [Tail])")


_Tail = tuple[fx.Node, fx.Node, fx.Node, list[fx.Node], list[fx.Node]]


def _tail(program: Program, sizes: dict[int, int]) -> _Tail | None:
    """(start, wait) of the latest large group's reduce-scatter before the last one that has weight
    products of its own, the last one's wait, the nodes only that start needs and the products among
    them; None where there is none. Each wait must still be right after its start."""
    scatters = pairs(program, collectives.reduce_scatter, BWD)
    if len(scatters) < 2:
        return None
    large = set(_large(sizes, scatters))
    last_wait = scatters[-1][1]
    for start, wait in reversed(scatters[:-1]):
        own = _needed_only_by(program, start) if start in large else []
        products = [n for n in own if flops(n)]
        if products:
            break
    else:
        return None
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    if any(u.op != "output" and order[u] < order[last_wait] for u in wait.users):
        return None
    return start, wait, last_wait, own, products


def _needed_only_by(program: Program, start: fx.Node) -> list[fx.Node]:
    """The backward's pure compute nodes whose results only `start` reads (directly or through
    each other), in graph order; not those that read a gathered buffer, which is released after its
    last reader in trace order, nor an output of a multi-output op that others read too."""
    own: set[fx.Node] = set()
    n = start.prev
    while n.op != "root" and n.meta.get("fbmt_phase") == BWD:
        target = n.target
        pure = n.op == "call_function" and target not in collectives.EFFECTFUL and not (
            isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable)
        if pure and n.users and all(u is start or u in own for u in n.users) and not _reads_gathered(n):
            own.add(n)
        n = n.prev
    # an output of a multi-output op stays next to it (NOTE: [Regions]: a compiled region must not
    # return the op's tuple), so it moves only with the op
    return [n for n in program.graph.nodes if n in own and not (
        n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] not in own)]


def _reads_gathered(n: fx.Node) -> bool:
    """Whether `n` reads a gathered buffer, directly or through views of it."""
    for a in n.all_input_nodes:
        while is_view(a) and isinstance(a.args[0], fx.Node):
            a = a.args[0]
        if a.target is collectives.wait and a.args[0].target is collectives.all_gather:
            return True
    return False
