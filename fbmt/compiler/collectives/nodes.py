"""The communication of a program, as node targets of the IR, and their arguments by name.

Every collective a compiled program runs is a visible pair of nodes: a *start* that issues it
asynchronously and returns a handle, and a `wait` that returns its result, so the schedule pass
overlaps communication with compute by moving starts earlier and waits later. `release` marks where
a gathered buffer's life ends, for `verify` to check that nothing reads it later.

The functions here say what each node means (their signatures are the nodes' arguments); they do
not run. The table (`fbmt.compiler.collectives.table`) names each start's implementation on
`torch.distributed` and its reference, and the partitioner puts the implementation in the graphs it
builds (NOTE: [Lowering the IR] in runtime/partition.py).

A start has one of two roles, and every kind of a role takes the same arguments:
- GATHER: `(shard, world_size, dtype)`: a group's flat shard in, the whole flat buffer out;
- REDUCE: `(pieces, world_size, padded_numel, average, wire_dtype, reduce_dtype, out_dtype)`: a
  group's gradients in, this rank's shard of their mean (or sum) over ranks out.
So the passes, the simulator and the runtime read any kind's arguments with `gather_args` or
`reduction_args`, and a new kind of a role fits everywhere the role does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx as fx

GATHER, REDUCE = "gather", "reduce"  # the two roles of a collective's start


class _IROnly(RuntimeError):
    pass


def not_run(name: str) -> _IROnly:
    """The error of an IR node called directly: it says what runs it instead."""
    return _IROnly(
        f"fbmt's IR node {name} does not run by itself; run the program through "
        "fbmt.compiler.runtime.partition, which replaces it with its implementation"
    )


def all_gather(shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> Any:
    """Start gathering a flat shard from every rank into one flat buffer (rank-major), cast to
    `dtype` first if given (mixed precision: fewer bytes on the wire)."""
    raise not_run("all_gather")


def reduce_scatter(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Any:
    """Start reducing a group's gradients over ranks (a ring reduce-scatter): `pieces` (1-D, in
    layout order) are copied into one zero-padded flat buffer of `padded_numel` elements in
    `wire_dtype`, summed over ranks in that dtype (`reduce_dtype` is the same), and this rank
    receives the mean (or, with `average=False`, the sum) of its shard as `out_dtype`."""
    raise not_run("reduce_scatter")


def all_to_all_reduce(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Any:
    """`reduce_scatter` with the pieces' own (narrower) dtype on the wire (`wire_dtype` is theirs):
    each rank sends every other rank that rank's chunk of the flat buffer (an all-to-all) and sums
    the chunks it receives in `reduce_dtype` (NOTE: [Narrow wire] in passes/shard.py)."""
    raise not_run("all_to_all_reduce")


def all_gather_from_host(shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> Any:
    """`all_gather` of a shard that lives in host memory (NOTE: [Offload] in passes/shard.py): the
    shard is copied to the device first, then cast and gathered; the buffer is on the device."""
    raise not_run("all_gather_from_host")


def reduce_scatter_to_host(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Any:
    """`reduce_scatter` whose shard gradient is copied to host memory, beside its shard (NOTE:
    [Offload] in passes/shard.py)."""
    raise not_run("reduce_scatter_to_host")


def wait(handle: Any) -> torch.Tensor:
    """The result of a started collective, once it is done."""
    raise not_run("wait")


def release(buffer: torch.Tensor) -> None:
    """The end of a gathered buffer's life: nothing reads it or its views after this node."""
    raise not_run("release")


class Gather(NamedTuple):
    """The arguments of a gathering start, by name."""

    shard: fx.Node
    world_size: int
    dtype: torch.dtype | None  # the dtype on the wire and of the buffer; None: the shard's


class Reduction(NamedTuple):
    """The arguments of a reducing start, by name."""

    pieces: list[fx.Node]
    world_size: int
    padded_numel: int
    average: bool
    wire_dtype: torch.dtype  # the dtype the flat buffer crosses the wire in
    reduce_dtype: torch.dtype  # the dtype the chunks are summed in
    out_dtype: torch.dtype  # the dtype of the shard gradient the wait returns


def gather_args(node: fx.Node) -> Gather:
    """The arguments of a gathering start, by name."""
    shard, world, *dtype = node.args
    return Gather(shard, world, dtype[0] if dtype else None)


def reduction_args(node: fx.Node) -> Reduction:
    """The arguments of a reducing start, by name."""
    return Reduction(*node.args)
