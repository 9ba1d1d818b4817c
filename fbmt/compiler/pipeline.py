"""The compiler, top to bottom: trace -> passes -> partition -> regions.

`compile_program` turns one call of a module (its arguments, grad mode and trainable groups) into
the Program the passes made (what the compile cache keeps), and `lower` turns a Program into the
Executable that runs it. `fbmt.compile` has already planned the layout, resolved the options into a
`Plan` and built the shards, since the optimizer needs `model.parameters()` before the first call; a
`CompiledModule` loads or compiles a program, then lowers it, for every new input signature.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fbmt import logs
from fbmt.compiler import stamp
from fbmt.compiler.layout import Layout
from fbmt.compiler.passes import (
    Pass,
    assign_blocks,
    chunk_losses,
    fp8_products,
    merge_products,
    recompute_blocks,
    run_passes,
    schedule_overlap,
    shard_parameters,
    verify_program,
)
from fbmt.compiler.passes.remat import RematChoice
from fbmt.compiler.program import Program
from fbmt.compiler.runtime.partition import Executable, partition
from fbmt.compiler.runtime.regions import RegionCache, split_regions
from fbmt.compiler.trace import trace

if TYPE_CHECKING:  # the plan is read, never made, here; plan.py checks `disable=` against PASS_NAMES
    from fbmt.compiler.plan import Plan

# remat="auto": a search that prices the traced program and returns each block's policy (NOTE: [Auto
# recompute]); `fbmt.compile` gives the compiler `fbmt.tools.auto_remat.choose`, which simulates.
Search = Callable[[Program, "Plan"], RematChoice]


# The passes in order, each with the options it reads from the plan (NOTE: [Plan]).
PIPELINE: tuple[tuple[str, Callable[..., Any], Callable[[Plan], dict[str, Any]]], ...] = (
    ("loss", chunk_losses, lambda plan: {}),  # a cross-entropy over a large vocabulary, in chunks of tokens
    ("blocks", assign_blocks, lambda plan: {}),  # tag forward nodes with their block
    (  # recompute block activations in the backward instead of saving them
        "remat",
        recompute_blocks,
        lambda plan: dict(policy=plan.remat, per_block=plan.remat_per_block, chosen=plan.chosen),
    ),
    ("merge", merge_products, lambda plan: {}),  # products that read one input become one
    ("fp8", fp8_products, lambda plan: dict(recipe=plan.fp8)),  # with fp8=: the blocks' products in FP8
    (  # ZeRO: flat shards, gathered before use, released after; gradients reduced into the shards
        "shard",
        shard_parameters,
        lambda plan: dict(
            zero=plan.zero,
            per_block=plan.zero_per_block,
            grad_reduce=plan.grad_reduce,
            reduce_dtype=plan.reduce_dtype,
            narrow_wire=plan.narrow_wire,
            offload=plan.offload,
        ),
    ),
    (  # overlap: where each collective is issued and waited
        "schedule",
        schedule_overlap,
        lambda plan: dict(strategy=plan.strategy, options=plan.strategy_options),
    ),
    ("verify", verify_program, lambda plan: {}),  # the invariants, once more
)
PASS_NAMES = tuple(name for name, _, _ in PIPELINE)  # what `disable=` is checked against


# NOTE: [Collections while compiling]
# Tracing and the passes make millions of short-lived objects (fx nodes, fake tensors, the programs
# each pass copies), and Python's cycle collector runs on every 700 new ones, each of its full runs
# walking the whole heap, which grows with the model: the deeper the model, the larger the share of
# a compile spent collecting (BENCHMARKS.md). While a program is compiled or lowered,
# the collector runs less often (gen-0 every 200,000 objects, a full run every 1,000 gen-1 runs);
# the garbage is still freed by the rarer runs, so memory stays bounded. The thresholds are put back
# afterwards; a collector a user turned off stays off.
@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Run Python's cycle collector less often while compiling (NOTE: [Collections while compiling])."""
    before = gc.get_threshold()
    if before[0] == 0:  # thresholds of 0: the user turned automatic collection off
        yield
        return
    gc.set_threshold(max(before[0], 200_000), max(before[1], 20), max(before[2], 1000))
    try:
        yield
    finally:
        gc.set_threshold(*before)


def passes(plan: Plan) -> list[tuple[str, Pass]]:
    """The pipeline's passes with their options bound from `plan`, for `run_passes`."""
    return [(name, functools.partial(fn, **bind(plan))) for name, fn, bind in PIPELINE]


def run(program: Program, plan: Plan, given_up: bool = False) -> Program:
    """The passes of `plan` on a traced program; `given_up`: the caller will not read it again."""
    return run_passes(
        program, passes(plan), disable=plan.disable, checks=plan.checks, dump_dir=plan.dump_dir, given_up=given_up
    )


def compile_program(
    module: nn.Module,
    layout: Layout,
    plan: Plan,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    needs_grad: bool,
    trainable: tuple[bool, ...],
    device: torch.device,
    search: Search | None = None,
    dynamic: dict[int, tuple[int, ...]] | None = None,
    numbers: tuple[tuple[int, tuple], ...] = (),
    at_most: dict[tuple[int, int], int] | None = None,
    entry: str = "",
) -> Program:
    """Trace one call and run the passes: what the compile cache keeps (NOTE: [Compile cache]).
    `dynamic`: the input dimensions to trace as symbols (NOTE: [Dynamic sizes]); `numbers`: the numbers
    argument objects hold that are inputs too (NOTE: [Numbers in an object]); `at_most`: (input, dimension) ->
    that symbol's bound, where above its own (NOTE: [Dynamic sizes]); `entry`: the path of
    the submodule called, "" for the module (NOTE: [Submodules through the program])."""
    # 1. trace one call, forward and backward, into a joint aten-level graph (on fake tensors)
    what = "forward and backward" if needs_grad else "forward"
    called = type(module).__name__ + (f".{entry}" if entry else "")
    with logs.stage(f"tracing {called}'s {what} ({len(layout.blocks)} blocks)") as said:
        program = trace(
            module,
            layout,
            dict(module.named_buffers()),
            args,
            kwargs,
            param_device=device,
            needs_grad=needs_grad,
            trainable=trainable,
            dynamic=dynamic,
            numbers=numbers,
            at_most=at_most,
            entry=entry,
        )
        said["done"] = f"{len(program.graph.nodes)} nodes"
        trace_notes = next((r.stats.notes for r in program.history if r.name == "trace"), ())
        said["done"] += "".join(f"; {n}" for n in trace_notes if stamp.STAMPED in n)  # which kinds, how many calls
    # 2. the passes: blocks, recompute, merged products, ZeRO sharding, overlap, checks
    if plan.remat == "auto":
        if search is None:
            raise ValueError(
                "fbmt.compile(remat='auto'): choosing each block's recompute needs a search over simulated "
                "programs; compile through fbmt.compile, which provides one (fbmt.tools.auto_remat.choose)"
            )
        plan = plan.with_choice(search(program, plan))  # each block's policy, and the depth it chose
    with logs.stage("passes", begin=False) as said:
        program = run(program, plan, given_up=True)  # the traced program is not kept: no copy of it
        said["done"] = ", ".join(f"{r.name} {r.seconds:.2f}s" for r in program.history)
    return program


def lower(program: Program, plan: Plan, regions: RegionCache, send: bool = True) -> Executable:
    """The Executable of a program: its forward and backward GraphModules, with Inductor's regions;
    `send`: their compiles may go to the workers (NOTE: [Compiles in the background]), not where
    torch's caches hold them already (a program whose cache entry gave Inductor's artifacts)."""
    # 3. partition into a forward and a backward GraphModule whose collectives run on torch.distributed
    with logs.stage("partitioning", begin=False):
        # NOTE: [One rank's gathers]: FP8 products read their weights in fp32 where Inductor compiles them
        exe = partition(program, casts_where_read=plan.backend == "inductor" and plan.fp8 is not None)
    # 4. with backend="inductor", compile the compute between collectives (identical blocks share it)
    if plan.backend == "inductor":
        # a call's tensors may come laid out otherwise at the next call of the program (a view: the window of
        # keys a Hugging Face cache keeps), which the key, made of shapes, does not tell
        placeholders = exe.forward.graph.find_nodes(op="placeholder")
        given = {n for n, role in zip(placeholders, exe.fwd_inputs) if role.kind == "input"}
        exe.forward = split_regions(exe.forward, regions, varying=given, send=send)
        if exe.backward is not None:
            # its tangents follow the saved values; those that may come as one expanded zero vary in layout
            tangents = [n for n in exe.backward.graph.nodes if n.op == "placeholder"][1:]
            varying = {n for n, zero in zip(tangents, exe.zero_tangents or ()) if zero}
            exe.backward = split_regions(exe.backward, regions, varying=varying, send=send)
        exe.regions = regions
        logs.log.info("Inductor compiles each kind of region on the first call that runs it")
    return exe
