"""Blocks: tag each traced forward node with its block, the unit of sharding and recompute.

Requires: forward nodes tagged with their module (the trace) and a layout whose blocks were
planned from the module tree (`fbmt.compiler.layout.plan_layout`).
Ensures: each forward node has a block (`meta.block`): the longest block path that prefixes its
module path, or None for code outside every block.

NOTE: [Backward blocks]
A backward node has no module of its own; what it belongs to is the block whose gradients it
computes. Once the shard pass has made each group's gradient reduction, `tag_backward_blocks`
gives every backward compute node the latest block, in the layout's (forward) order, whose
reduction it feeds: gradients flow from the last block to the first, so a node of block k's
backward feeds k's reduction and those of the blocks before it, and none after. A node the remat
pass recomputed keeps its forward block; one that feeds no reduction (an input's gradient only)
stays untagged. The schedule pass tags before its strategy runs, so `first_compute(program, block,
"bwd")` finds every block's backward.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch.fx as fx

from fbmt.compiler import collectives, meta
from fbmt.compiler.program import BWD, FWD, Program, per_block


@dataclass(frozen=True)
class BlockStats:
    """What the blocks pass tagged (NOTE: [Pass stats])."""

    nodes: dict[str, int]  # forward nodes per block, in the order the forward reaches them ("" the root)

    def __str__(self) -> str:
        return "forward nodes per block: " + ", ".join(per_block([(b, str(c)) for b, c in self.nodes.items()]))


def assign_blocks(program: Program) -> tuple[Program, BlockStats]:
    program = program.copy()
    counts: Counter[str] = Counter()
    for n in program.graph.nodes:
        if meta.phase(n) == FWD:
            block = program.layout.block_of_module(meta.module(n))
            meta.tag(n, block=block)
            if block is not None:
                counts[block] += 1
    return program, BlockStats(dict(counts))


def tag_backward_blocks(program: Program) -> int:
    """Tag the backward compute nodes with their block (NOTE: [Backward blocks]), in place; how many."""
    order = {b: i for i, b in enumerate(program.layout.blocks)}
    block_of_group = {grp.index: grp.block for grp in program.layout.groups}
    latest: dict[fx.Node, int] = {}  # the latest block (its index) whose reduction a node feeds; -1: none
    for n in reversed(program.graph.nodes):
        if meta.phase(n) != BWD:
            continue
        feeds = order[block_of_group[meta.group(n)]] if collectives.is_reduction(n) else -1
        latest[n] = max([feeds, *(latest.get(u, -1) for u in n.users)])
    tagged = 0
    for n, i in latest.items():
        if i >= 0 and n.op == "call_function" and not collectives.is_collective(n.target) and not meta.recompute(n):
            meta.tag(n, block=program.layout.blocks[i])
            tagged += 1
    for n in latest:  # an output of a multi-output op is part of it: a block never begins between them
        source = n.args[0] if n.target is operator.getitem else None
        if isinstance(source, fx.Node) and meta.has_block(source) and not meta.recompute(n):
            meta.tag(n, block=meta.block(source))
    return tagged
