"""Remat: recompute each block's activations in the backward instead of saving them.

Requires: forward nodes tagged with `fbmt_block` (the blocks pass).
Ensures, with `policy="block"`: no forward value computed inside a block is read by the backward,
except (a) the block's outputs (values that other blocks' forward reads: the next block's inputs,
saved anyway), and (b) values that cannot be recomputed: random ops (recomputing would draw a new
dropout mask) and mutating ops. Their recomputed copies are placed together right before the first
backward node that needs any of them, tagged `fbmt_recompute="activation"`. With `policy="none"` the pass
declines and says so in the history. `per_block` sets the policy of single blocks.

NOTE: [Selective]
`policy="selective"` saves the outputs of a block's expensive ops (matrix products, attention) and
recomputes everything else (norms, activations, RoPE, casts, residual adds) from them and the block
inputs, as Inductor's min-cut partitioner does for torch.compile: most of the memory of
"none", at the price of re-running cheap, memory-bound ops that a compiled backward fuses.
"""

from __future__ import annotations

import operator
import time

import torch
import torch.fx as fx

from fbmt.program import BWD, FWD, Program
from fbmt.runtime import collectives

POLICIES = ("block", "selective", "none")
# What "selective" saves instead of recomputing: matrix products and attention (NOTE: [Selective]).
EXPENSIVE = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward"}


def expensive(n: fx.Node) -> bool:
    """A matrix product or attention (or an output of one): worth saving rather than recomputing."""
    t = n.target
    if t is operator.getitem:
        return isinstance(n.args[0], fx.Node) and expensive(n.args[0])
    return isinstance(t, torch._ops.OpOverload) and t.overloadpacket.__name__ in EXPENSIVE


def recomputable(n: fx.Node) -> bool:
    """A pure, deterministic forward aten op: running it twice gives the same value."""
    if n.op != "call_function" or n.meta.get("fbmt_phase") != FWD:
        return False
    t = n.target
    if t in collectives.EFFECTFUL:
        return False
    if isinstance(t, torch._ops.OpOverload):
        return not (t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags)
    return t.__module__ == "_operator"  # getitem on multi-output ops


def recompute_blocks(program: Program, *, policy: str = "block", per_block: dict[str, str] | None = None) -> Program:
    """`per_block` overrides `policy` for the named blocks (BMTrain's `Block(use_checkpoint=...)`)."""
    started = time.perf_counter()
    per_block = per_block or {}
    for p in (policy, *per_block.values()):
        if p not in POLICIES:
            raise ValueError(f"fbmt.compile(remat={p!r}): expected one of {POLICIES}")
    program = program.copy()
    chosen = [b for b in program.layout.blocks if per_block.get(b, policy) != "none"]
    if not chosen or not program.needs_grad:
        why = "forward-only program" if not program.needs_grad else "no block recomputes (remat='none')"
        program.record("remat", started, f"declined: {why}; activations are saved")
        return program

    g = program.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    stats = []
    for block in chosen:
        selective = per_block.get(block, policy) == "selective"
        inside = {n for n in g.nodes if n.meta.get("fbmt_block") == block and recomputable(n)
                  and not (selective and expensive(n))
                  and all(u.meta.get("fbmt_block") == block for u in n.users if u.meta.get("fbmt_phase") == FWD)}
        needed = [n for n in inside if any(u.meta.get("fbmt_phase") == BWD for u in n.users)]
        if not needed:
            continue
        closure: set[fx.Node] = set()
        todo = list(needed)
        while todo:
            n = todo.pop()
            if n in closure:
                continue
            closure.add(n)
            todo += [a for a in n.all_input_nodes if a in inside]
        first_user = min((u for n in needed for u in n.users if u.meta.get("fbmt_phase") == BWD),
                         key=order.__getitem__)
        env: dict[fx.Node, fx.Node] = {}
        with g.inserting_before(first_user):
            for n in sorted(closure, key=order.__getitem__):
                env[n] = g.node_copy(n, lambda a: env.get(a, a))
                env[n].meta.update(fbmt_phase=BWD, fbmt_recompute="activation")
        copies = set(env.values())
        for n in needed:
            for u in list(n.users):
                if u.meta.get("fbmt_phase") == BWD and u not in copies:
                    u.replace_input_with(n, env[n])
        saved = {a for n in closure for a in n.all_input_nodes if a not in closure and a.op != "placeholder"}
        stats.append(f"{block or '<root>'}: {len(closure)} recomputed, {len(saved)} saved")
    program.record("remat", started, "; ".join(stats) or "no block activations reach the backward")
    return program
