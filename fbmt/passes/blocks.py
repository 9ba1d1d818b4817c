"""Blocks: tag each traced forward node with its block, the unit of sharding and recompute.

Requires: forward nodes tagged with `fbmt_module` (the trace) and a layout whose blocks were
planned from the module tree (`fbmt.layout.plan_layout`).
Ensures: each forward node has `meta["fbmt_block"]`: the longest block path that prefixes its
module path, or None for code outside every block.
"""

from __future__ import annotations

from collections import Counter

from fbmt.program import FWD, Program


def assign_blocks(program: Program) -> tuple[Program, str]:
    program = program.copy()
    counts: Counter[str] = Counter()
    for n in program.graph.nodes:
        if n.meta.get("fbmt_phase") == FWD:
            block = program.layout.block_of_module(n.meta.get("fbmt_module"))
            n.meta["fbmt_block"] = block
            if block is not None:
                counts[block or "<root>"] += 1
    return program, "forward nodes per block: " + ", ".join(f"{b}: {c}" for b, c in counts.items())
