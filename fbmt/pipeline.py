"""The compiler, top to bottom: trace -> passes -> partition -> regions.

`build` turns one call of a module (its arguments, grad mode and trainable groups) into the Program
the passes made and the Executable that runs it. `fbmt.compile` has already planned the layout and
built the shards, since the optimizer needs `model.parameters()` before the first call; a
`CompiledModule` calls `build` for every new input signature.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn as nn

from fbmt import distributed, sim
from fbmt.layout import Layout
from fbmt.options import CompileOptions
from fbmt.passes import (
    PASS_NAMES,
    POLICIES,
    STRATEGIES,
    Pass,
    assign_blocks,
    merge_products,
    recompute_blocks,
    run_passes,
    schedule_overlap,
    shard_parameters,
    verify_program,
)
from fbmt.passes.remat import block_costs, cheapest_within
from fbmt.program import Program
from fbmt.runtime.partition import Executable, partition
from fbmt.runtime.regions import RegionCache, split_regions
from fbmt.trace import trace


def passes(
    options: CompileOptions, world_size: int, remat: tuple[dict[str, str], str] | None = None
) -> list[tuple[str, Pass]]:
    """The passes in order, each with the options it reads. `remat`: every block's recompute policy
    and what chose it, instead of the options' (remat="auto" resolved)."""
    o = options
    per_block, note = remat if remat is not None else (o.remat_per_block, "")
    narrow_wire = o.narrow_wire if o.narrow_wire is not None else distributed.ranks_per_node(world_size) >= world_size
    pipeline = [
        ("blocks", assign_blocks),  # tag forward nodes with their block
        ("remat", functools.partial(recompute_blocks, policy=o.remat, per_block=per_block, note=note)),
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
    remat = None
    if options.remat == "auto":
        remat, options = auto_remat(program, options)  # with the prefetch depth it chose
    program = run_passes(
        program,
        passes(options, layout.world_size, remat),
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


# The prefetch depths remat="auto" tries, where neither `prefetch=` nor the strategy's options set one:
# a deeper prefetch hides more communication behind compute and holds more gathered parameters.
DEPTHS = (1, 2, 3)
NEAR = 0.01  # steps within this fraction of the fastest count as equally fast


def auto_remat(traced: Program, options: CompileOptions) -> tuple[tuple[dict[str, str], str], CompileOptions]:
    """Each block's recompute policy under `options.memory_budget`, with a line saying what was
    chosen, and the options to run the passes with: the prefetch depth that makes the fastest
    simulated step within the budget, where the user left it to the strategy (NOTE: [Auto recompute])."""
    if not traced.needs_grad:
        return ({}, "auto: a forward-only program saves nothing for a backward"), options
    candidates = [options]
    if (
        isinstance(options.strategy, str)
        and _takes_depth(options.strategy)
        and "depth" not in dict(options.strategy_options)
    ):
        given = dict(options.strategy_options)
        candidates = [dataclasses.replace(options, schedule=(options.strategy, {**given, "depth": d})) for d in DEPTHS]
    fitted, refused = [], None
    for o in candidates:
        try:
            fitted.append((*_fit_budget(traced, o), o))
        except ValueError as e:  # this depth holds too much; a shallower one may fit
            refused = refused or e
    if not fitted:
        raise refused
    fastest = min(f[2] for f in fitted)
    # the shallowest within 1% of the fastest: a deeper prefetch holds more for what the model cannot tell apart
    per_block, line, step, chosen = next(f for f in fitted if f[2] <= fastest * (1 + NEAR))
    if len(candidates) > 1:
        steps = ", ".join(f"{dict(o.strategy_options)['depth']}: {step_s * 1e3:.4g} ms" for _, _, step_s, o in fitted)
        line += f"; prefetch depth {dict(chosen.strategy_options)['depth']} (simulated step by depth {steps})"
    return (per_block, line), chosen


def _takes_depth(strategy: str) -> bool:
    return "depth" in inspect.signature(STRATEGIES[strategy]).parameters


def _fit_budget(traced: Program, options: CompileOptions) -> tuple[dict[str, str], str, float]:
    """`auto_remat` for one set of options: each block's policy, the line, the simulated step."""
    world, budget = traced.layout.world_size, options.memory_budget
    machine = sim.default_machine(world)
    named = options.remat_per_block  # blocks whose policy the user set keep it
    tagged, _ = assign_blocks(traced)
    costs = {
        b: c
        for b, c in block_costs(tagged, lambda n: sim.compute_time(n, machine)).items()
        if b not in named and any(s for _, s in c.values())
    }
    fixed = {b: "none" for b in traced.layout.blocks if b not in costs and b not in named}

    def simulate(chosen: dict[str, str]) -> sim.Simulation:
        p = run_passes(traced, passes(options, world, ({**fixed, **chosen, **named}, "")), disable=options.disable)
        return sim.simulate(p, machine)

    def result(chosen: dict[str, str], at: sim.Simulation) -> tuple[dict[str, str], str, float]:
        counts = {p: sum(v == p for v in chosen.values()) for p in POLICIES}
        shown = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
        peak = sim.size(at.peak_activation_bytes)
        line = f"auto under {sim.size(budget)}: {shown or 'no block to choose'}; simulated peak {peak}"
        return {**fixed, **chosen, **named}, line, at.step_s

    fastest = {b: "none" for b in costs}
    if (at := simulate(fastest)).peak_activation_bytes <= budget:
        return result(fastest, at)
    least = {b: min(c, key=lambda p: (c[p][0], c[p][1])) for b, c in costs.items()}  # noqa: B023
    lowest = simulate(least)
    floor = lowest.peak_activation_bytes
    if floor > budget:
        raise ValueError(
            f"fbmt.compile(remat='auto', memory_budget={budget}): the step needs at least {floor} bytes "
            f"({sim.size(floor)}) as the simulator predicts it, with every block recomputing what it can; that is "
            "the smallest budget that fits. Use more ranks or a smaller batch per rank"
            + (", or zero=3" if options.zero == 2 else "")
        )
    rest = floor - sum(costs[b][p][0] for b, p in least.items())
    capacity = budget - rest
    for _ in range(6):  # the sum of saved bytes models the peak; shrink where the peak says otherwise
        chosen = cheapest_within(costs, capacity)
        if chosen is None:
            break
        if (at := simulate(chosen)).peak_activation_bytes <= budget:
            return result(chosen, at)
        capacity -= at.peak_activation_bytes - budget
    return result(least, lowest)
