"""The pass manager: one straight, named list of pure passes `pass(program, **options) -> program`.

The pipeline (read top to bottom):

    blocks    tag forward nodes with their block (the unit of sharding and recompute)
    remat     recompute block activations in the backward instead of saving them
    merge     products that read one input, weights side by side, become one product
    shard     ZeRO-3/2: flat shards, all-gather before use, release after, reduce-scatter grads
    schedule  overlap: issue gathers ahead, wait reduce-scatters late
    verify    static invariants (also run after every pass when checks are on)

Any pass but `shard` can be disabled by name (`fbmt.compile(..., disable=("schedule",))`) to bisect
a problem; options are bound with `functools.partial`, so the runner knows no pass's arguments.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import torch

from fbmt.passes.blocks import assign_blocks
from fbmt.passes.merge import merge_products
from fbmt.passes.remat import recompute_blocks
from fbmt.passes.schedule import schedule_overlap
from fbmt.passes.shard import shard_parameters
from fbmt.passes.verify import verify
from fbmt.program import Program

Pass = Callable[[Program], Program]
REQUIRED = ("shard",)


def default_pipeline(*, zero: int, remat: str, schedule: str, prefetch: int, grad_reduce: str = "mean",
                     reduce_dtype: torch.dtype | None = None, zero_per_block: dict[str, int] | None = None,
                     remat_per_block: dict[str, str] | None = None,
                     direct_grads: bool = False) -> list[tuple[str, Pass]]:
    return [
        ("blocks", assign_blocks),
        ("remat", functools.partial(recompute_blocks, policy=remat, per_block=remat_per_block)),
        ("merge", merge_products),
        ("shard", functools.partial(shard_parameters, zero=zero, per_block=zero_per_block, grad_reduce=grad_reduce,
                                    reduce_dtype=reduce_dtype, direct_grads=direct_grads)),
        ("schedule", functools.partial(schedule_overlap, strategy=schedule, prefetch=prefetch)),
        ("verify", verify),
    ]


def run_pipeline(program: Program, pipeline: list[tuple[str, Pass]], *, disable: tuple[str, ...] = (),
                 checks: bool = False, dump_dir: str | None = None) -> Program:
    names = [name for name, _ in pipeline]
    for name in disable:
        if name not in names:
            raise ValueError(f"fbmt.compile(disable={disable!r}): no pass named {name!r}; passes are {names}")
        if name in REQUIRED:
            raise ValueError(f"fbmt.compile(disable=...): pass {name!r} cannot be disabled; the runtime needs it")
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        _dump(dump_dir, 0, "trace", program)
    for i, (name, fn) in enumerate(pipeline, 1):
        if name in disable:
            program = program.copy()
            program.record(name, time.perf_counter(), "disabled by the user")
            continue
        program = fn(program)
        if checks and name != "verify":
            verify(program, after=name)
        if dump_dir:
            _dump(dump_dir, i, name, program)
    return program


def _dump(folder: str, index: int, name: str, program: Program) -> None:
    with open(os.path.join(folder, f"{index:02d}-{name}.txt"), "w") as f:
        f.write(str(program) + "\n")
