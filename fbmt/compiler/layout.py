"""The layout: how a model's parameters are blocked, grouped into flat buffers and sharded.

`plan_layout` decides it once, at compile time, from the module tree (parameters must exist as
shards before the first call, so that an optimizer can be built on them). Rules, in order:

1. Each child of a `ModuleList` whose children are two or more modules of one class is a block
   (the outermost such list wins; `blocks=` replaces this rule with an explicit list of paths).
2. Every other module is grouped under its highest ancestor that is not on the way to a block:
   the root's children become blocks, unless they contain blocks, in which case their children are
   looked at the same way. A module on the way to a block that owns parameters directly forms a
   block of its own (the root's own parameters: block "", shown as <root>).

Each block's parameters become one flat group per (dtype, requires_grad); a tied parameter belongs
to the block of its first name. Rank r owns elements [r * shard_numel, (r + 1) * shard_numel) of a
group's zero-padded flat buffer; `local_range` and `copy_into_shard` compute with that geometry.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a flat group: where its elements live in the flat buffer."""

    name: str  # canonical fully-qualified name (first name of a tied parameter)
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatGroup:
    """Parameters of one block with one dtype and one requires_grad, stored as one flat buffer.

    Rank r owns elements [r * shard_numel, (r + 1) * shard_numel) of the zero-padded flat buffer.
    """

    index: int
    block: str
    dtype: torch.dtype  # how the shard is stored (and the optimizer sees it)
    requires_grad: bool
    slots: tuple[ParamSlot, ...]
    world_size: int
    compute_dtype: torch.dtype | None = None  # how it is gathered and computed with (None: as stored)

    @property
    def compute(self) -> torch.dtype:
        return self.compute_dtype or self.dtype

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def name(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.block or '<root>'}/{dt}{'' if self.requires_grad else '/frozen'}"


@dataclass(frozen=True)
class Layout:
    """How a model's parameters are blocked and sharded. Shared by every Program of one model."""

    blocks: tuple[str, ...]  # module paths, in module order; "" is the root's own parameters
    groups: tuple[FlatGroup, ...]
    aliases: dict[str, str]  # every parameter name (tied ones too) -> canonical name
    world_size: int

    def group_of(self, param_name: str) -> tuple[FlatGroup, ParamSlot]:
        found = self._slots.get(self.aliases[param_name])
        if found is None:
            raise KeyError(param_name)
        return found

    @functools.cached_property
    def _slots(self) -> dict[str, tuple[FlatGroup, ParamSlot]]:
        # looked up once per parameter by several passes: a scan of every slot made them quadratic
        slots: dict[str, tuple[FlatGroup, ParamSlot]] = {}
        for g in self.groups:
            for s in g.slots:
                slots.setdefault(s.name, (g, s))
        return slots

    @functools.cached_property
    def _block_paths(self) -> frozenset[str]:
        return frozenset(self.blocks)

    def block_of_module(self, module_path: str | None) -> str | None:
        """The block a module path belongs to: the longest block path that prefixes it (a pass asks
        this for every node, so it looks up the path's prefixes, not every block)."""
        if module_path is None:
            return None
        path = module_path
        while True:
            if path in self._block_paths:
                return path
            if not path:
                return None
            path = path.rpartition(".")[0]


def find_blocks(module: nn.Module, explicit: list[str] | None = None) -> list[str]:
    modules = dict(module.named_modules())
    if explicit is not None:
        unknown = [p for p in explicit if p not in modules]
        if unknown:
            raise ValueError(
                f"fbmt.compile(blocks=...): no submodule named {unknown}; module paths look like {list(modules)[1:4]}"
            )
        units = list(explicit)
    else:
        units = []
        for path, m in modules.items():
            if (
                isinstance(m, nn.ModuleList)
                and len(m) >= 2
                and len({type(c) for c in m}) == 1
                and not any(path.startswith(u + ".") for u in units)
            ):
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


def plan_layout(
    module: nn.Module,
    world_size: int,
    explicit_blocks: list[str] | None = None,
    *,
    split_frozen: bool = True,
    param_dtype: torch.dtype | None = None,
) -> Layout:
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
            compute = (
                param_dtype if param_dtype is not None and dtype.is_floating_point and dtype != param_dtype else None
            )
            groups.append(FlatGroup(len(groups), b, dtype, rg, tuple(slots), world_size, compute))
    return Layout(tuple(blocks), tuple(groups), aliases, world_size)


def copy_into_shard(shard: torch.Tensor, group: FlatGroup, rank: int, values: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's slice of each parameter of `group` found in `values` (by name) into `shard`."""
    lo, hi = rank * group.shard_numel, (rank + 1) * group.shard_numel
    for s in group.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b and s.name in values:
            src = values[s.name].detach().reshape(-1)[a - s.offset : b - s.offset]
            shard[a - lo : b - lo].copy_(src)


def local_range(group: FlatGroup, slot: ParamSlot, rank: int) -> tuple[int, int]:
    """The part of the flat buffer, [lo, hi), that holds `slot`'s elements on `rank` (lo >= hi: none)."""
    return max(rank * group.shard_numel, slot.offset), min((rank + 1) * group.shard_numel, slot.offset + slot.numel)
