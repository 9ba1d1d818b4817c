"""The reference executor: run a joint Program op by op, its forward and backward together.

It is the definition of what a program means, and slow on purpose: each aten node runs as traced,
and each collective of `fbmt.ops` runs synchronously, built from all-gathers alone (a reduction is
every rank's flat buffer gathered, and this rank's chunk summed in the reduce dtype). The fast path
(`partition`, the copy and reduce streams, Inductor regions, CUDA graphs) must compute the same
values; the pass tests run programs here before and after a pass. On one rank it needs no process
group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fbmt import distributed, ops
from fbmt.program import Program, Role


def _all_gather(shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    x = shard.to(dtype) if dtype is not None else shard
    return distributed.gather_flat(x) if world_size > 1 else x.clone()


def _reduction(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """This rank's chunk of the sum (or mean) over ranks of the flat, zero-padded buffer of `pieces`
    sent in `wire_dtype`, summed in `reduce_dtype`."""
    flat = torch.zeros(padded_numel, dtype=wire_dtype, device=pieces[0].device)
    torch.cat([p.reshape(-1).to(wire_dtype) for p in pieces], out=flat[: sum(p.numel() for p in pieces)])
    every = (distributed.gather_flat(flat) if world_size > 1 else flat).view(world_size, world_size, -1)
    chunk = every[:, distributed.rank() if world_size > 1 else 0].to(reduce_dtype).sum(0)
    return (chunk / world_size if average else chunk).to(out_dtype)


def _reduce_scatter(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool = True,
    wire_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    wire = wire_dtype or pieces[0].dtype
    return _reduction(pieces, world_size, padded_numel, average, wire, wire, out_dtype or wire)


def _all_to_all_reduce(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _reduction(pieces, world_size, padded_numel, average, pieces[0].dtype, reduce_dtype, out_dtype)


# A collective's start returns its result; `wait` hands it on.
REFERENCE: dict[Callable, Callable] = {
    ops.all_gather: _all_gather,
    ops.reduce_scatter: _reduce_scatter,
    ops.all_to_all_reduce: _all_to_all_reduce,
    ops.wait: lambda result: result,
    ops.release: lambda buffer: None,
}


class _Reference(fx.Interpreter):
    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return REFERENCE.get(target, target)(*args, **kwargs)


def run_program(program: Program, feed: Callable[[Role], Any]) -> dict[Role, Any]:
    """Run `program` with `feed(role)` as each placeholder's value; its outputs by role."""
    interpreter = _Reference(fx.GraphModule(nn.Module(), program.graph))
    results = interpreter.run(*[feed(role) for role in program.inputs])
    return dict(zip(program.outputs, results))
