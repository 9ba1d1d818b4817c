"""Blocks: the units of sharding and recompute.

`plan_layout` runs once at compile time on the module (parameters must exist as shards before the
first call, so an optimizer can be built on them). Rules, in order:

1. Each child of a `ModuleList` whose children are two or more modules of one class is a block
   (the outermost such list wins; `blocks=` replaces this rule with an explicit list of paths).
2. Every other module is grouped under its highest ancestor that is not on the way to a block:
   the root's children become blocks, unless they contain blocks, in which case their children are
   looked at the same way. A module on the way to a block that owns parameters directly forms a
   block of its own (the root's own parameters: block "", shown as <root>).

Each block's parameters become one flat group per (dtype, requires_grad); a tied parameter belongs
to the block of its first name.

The `assign_blocks` pass requires traced forward nodes tagged with `fbmt_module` and ensures each
forward node has `meta["fbmt_block"]`: its block, or None for code outside every block.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.nn as nn

from fbmt.program import FWD, FlatGroup, Layout, ParamSlot, Program


def find_blocks(module: nn.Module, explicit: list[str] | None = None) -> list[str]:
    modules = dict(module.named_modules())
    if explicit is not None:
        unknown = [p for p in explicit if p not in modules]
        if unknown:
            raise ValueError(f"fbmt.compile(blocks=...): no submodule named {unknown}; "
                             f"module paths look like {list(modules)[1:4]}")
        units = list(explicit)
    else:
        units = []
        for path, m in modules.items():
            if (isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1
                    and not any(path.startswith(u + ".") for u in units)):
                units += [f"{path}.{i}" if path else str(i) for i in range(len(m))]

    blocks: list[str] = []

    def visit(path: str, mod: nn.Module) -> None:
        if path in units:
            blocks.append(path)
            return
        on_the_way = any(path == "" or u.startswith(path + ".") for u in units)
        if not on_the_way:
            blocks.append(path)
            return
        if any(True for _ in mod.parameters(recurse=False)):
            blocks.append(path)
        for name, child in mod.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", module)
    return blocks


def plan_layout(module: nn.Module, world_size: int, explicit_blocks: list[str] | None = None, *,
                split_frozen: bool = True, param_dtype: torch.dtype | None = None) -> Layout:
    """`split_frozen=False` puts frozen and trainable parameters of a block in one group (marked
    trainable), for models whose `requires_grad` flags change after compiling. `param_dtype` is the
    compute dtype of every floating-point group stored in another dtype (mixed precision)."""
    blocks = find_blocks(module, explicit_blocks)
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases[name] = canonical.setdefault(id(p), name)
    probe = Layout(tuple(blocks), (), aliases, world_size)
    per_block: dict[str, list[tuple[str, nn.Parameter]]] = {b: [] for b in blocks}
    for name, p in module.named_parameters():
        owner = name.rpartition(".")[0]
        per_block[probe.block_of_module(owner)].append((name, p))
    groups: list[FlatGroup] = []
    def key(p: nn.Parameter) -> tuple[torch.dtype, bool]:
        return p.dtype, p.requires_grad or not split_frozen

    for b in blocks:
        keys = list(dict.fromkeys(key(p) for _, p in per_block[b]))
        for dtype, rg in keys:
            slots, offset = [], 0
            for name, p in per_block[b]:
                if key(p) == (dtype, rg):
                    slots.append(ParamSlot(name, tuple(p.shape), offset))
                    offset += p.numel()
            compute = param_dtype if param_dtype is not None and dtype.is_floating_point and dtype != param_dtype \
                else None
            groups.append(FlatGroup(len(groups), b, dtype, rg, tuple(slots), world_size, compute))
    return Layout(tuple(blocks), tuple(groups), aliases, world_size)


def assign_blocks(program: Program) -> Program:
    started = time.perf_counter()
    program = program.copy()
    counts: Counter[str] = Counter()
    for n in program.graph.nodes:
        if n.meta.get("fbmt_phase") == FWD:
            block = program.layout.block_of_module(n.meta.get("fbmt_module"))
            n.meta["fbmt_block"] = block
            if block is not None:
                counts[block or "<root>"] += 1
    summary = ", ".join(f"{b}: {c}" for b, c in counts.items())
    program.record("blocks", started, f"forward nodes per block: {summary}")
    return program
