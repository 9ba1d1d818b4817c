"""The compiler, top to bottom: trace -> passes -> partition -> regions.

`build` turns one call of a module (its arguments, grad mode and trainable groups) into the Program
the passes made and the Executable that runs it. `fbmt.compile` has already planned the layout and
built the shards, since the optimizer needs `model.parameters()` before the first call; a
`CompiledModule` calls `build` for every new input signature.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from fbmt import distributed
from fbmt.layout import Layout
from fbmt.options import CompileOptions
from fbmt.passes import (
    PASS_NAMES,
    Pass,
    assign_blocks,
    merge_products,
    recompute_blocks,
    run_passes,
    schedule_overlap,
    shard_parameters,
    verify_program,
)
from fbmt.program import Program
from fbmt.runtime.partition import Executable, partition
from fbmt.runtime.regions import RegionCache, split_regions
from fbmt.trace import trace


def passes(options: CompileOptions, world_size: int) -> list[tuple[str, Pass]]:
    """The passes in order, each with the options it reads."""
    o = options
    narrow_wire = o.narrow_wire if o.narrow_wire is not None else distributed.ranks_per_node(world_size) >= world_size
    pipeline = [
        ("blocks", assign_blocks),  # tag forward nodes with their block
        ("remat", functools.partial(recompute_blocks, policy=o.remat, per_block=o.remat_per_block)),
        ("merge", merge_products),  # products that read one input become one
        (
            "shard",
            functools.partial(
                shard_parameters,
                zero=o.zero,
                per_block=o.zero_per_block,
                grad_reduce=o.grad_reduce,
                reduce_dtype=o.reduce_dtype,
                narrow_wire=narrow_wire,
            ),
        ),
        ("schedule", functools.partial(schedule_overlap, strategy=o.strategy, options=dict(o.strategy_options))),
        ("verify", verify_program),
    ]
    assert tuple(name for name, _ in pipeline) == PASS_NAMES, "fbmt.passes.PASS_NAMES lists these passes in order"
    return pipeline


def build(
    module: nn.Module,
    layout: Layout,
    options: CompileOptions,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    needs_grad: bool,
    trainable: tuple[bool, ...],
    device: torch.device,
    regions: RegionCache,
) -> tuple[Program, Executable]:
    # 1. trace one call, forward and backward, into a joint aten-level graph (on fake tensors)
    program = trace(
        module,
        layout,
        dict(module.named_buffers()),
        args,
        kwargs,
        param_device=device,
        needs_grad=needs_grad,
        trainable=trainable,
    )
    # 2. the passes: blocks, recompute, merged products, ZeRO sharding, overlap, checks
    program = run_passes(
        program,
        passes(options, layout.world_size),
        disable=options.disable,
        checks=options.checks,
        dump_dir=options.dump_dir,
    )
    # 3. partition into a forward and a backward GraphModule whose collectives run on torch.distributed
    exe = partition(program)
    # 4. with backend="inductor", compile the compute between collectives (identical blocks share it)
    if options.backend == "inductor":
        exe.forward = split_regions(exe.forward, regions)
        if exe.backward is not None:
            exe.backward = split_regions(exe.backward, regions)
    return program, exe
