"""`fbmt.compile`: turn a plain single-device module into a ZeRO-sharded, recomputing, overlapped one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from fbmt import distributed
from fbmt.passes.blocks import plan_layout
from fbmt.passes.remat import POLICIES
from fbmt.passes.schedule import STRATEGIES
from fbmt.runtime.module import CompiledModule
from fbmt.runtime.params import build_shards


@dataclass(frozen=True)
class CompileOptions:
    zero: int = 3
    """3: gather parameters again for the backward; 2: keep them gathered from forward to backward."""
    remat: str = "block"
    """"block": save only block inputs and recompute each block in the backward; "none": save all."""
    schedule: str = "prefetch"
    """A registered strategy: "prefetch" (overlap communication with compute) or "none"."""
    prefetch: int = 1
    """How many blocks ahead "prefetch" issues parameter gathers."""
    blocks: tuple[str, ...] | None = None
    """Module paths to use as blocks instead of the children of repeated ModuleLists."""
    disable: tuple[str, ...] = ()
    """Pass names to skip (to bisect a problem); "shard" cannot be skipped."""
    checks: bool = False
    """Verify the program after every pass (always on in tests; $FBMT_CHECKS=1)."""
    dump_dir: str | None = None
    """Write the program after every pass to this folder ($FBMT_DUMP_DIR), for `diff`."""

    def __post_init__(self) -> None:
        if self.zero not in (2, 3):
            raise ValueError(f"fbmt.compile(zero={self.zero!r}): expected 3 or 2")
        if self.remat not in POLICIES:
            raise ValueError(f"fbmt.compile(remat={self.remat!r}): expected one of {POLICIES}")
        if self.schedule not in STRATEGIES:
            raise ValueError(f"fbmt.compile(schedule={self.schedule!r}): known strategies are {sorted(STRATEGIES)}")
        if self.prefetch < 1:
            raise ValueError(f"fbmt.compile(prefetch={self.prefetch}): must be at least 1")


def compile(model: nn.Module, *, zero: int = 3, remat: str = "block", schedule: str = "prefetch",
            prefetch: int = 1, blocks: list[str] | None = None, disable: tuple[str, ...] = (),
            checks: bool | None = None, dump_dir: str | None = None, world_size: int | None = None,
            device: torch.device | str | None = None,
            init_fn: Callable[[nn.Module], None] | None = None) -> CompiledModule:
    """Compile `model` for training on every rank of the job (see README and docs/ARCHITECTURE.md).

    The returned module's `parameters()` are this rank's flat shards: build any torch optimizer on
    them. Its `state_dict()` holds full tensors under the original keys. The model is taken over:
    its parameters are replaced by `meta` placeholders so only the shards hold memory. A model built
    under `torch.device("meta")` is materialized block by block with `init_fn(module)` or each
    module's `reset_parameters()`, so no rank ever holds the whole model.

    `world_size` (default: the process group's) lets one process compile for any world size, to
    inspect programs with `model.trace(*inputs)`; running such a model needs that many ranks.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fbmt.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CompiledModule):
        raise TypeError("fbmt.compile: this module is already compiled")
    options = CompileOptions(
        zero=zero, remat=remat, schedule=schedule, prefetch=prefetch,
        blocks=tuple(blocks) if blocks is not None else None, disable=tuple(disable),
        checks=bool(os.environ.get("FBMT_CHECKS")) if checks is None else checks,
        dump_dir=dump_dir or os.environ.get("FBMT_DUMP_DIR"))
    world = world_size or distributed.world_size()
    rank = distributed.rank() if world == distributed.world_size() else 0
    device = torch.device(device) if device is not None else distributed.local_device()
    if device.type == "cuda" and device.index is None:  # "cuda" means the current one: compare as cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    layout = plan_layout(model, world, list(options.blocks) if options.blocks is not None else None)
    shards = build_shards(model, layout, rank, device, init_fn)
    return CompiledModule(model, layout, shards, options=options, device=device, rank=rank)
