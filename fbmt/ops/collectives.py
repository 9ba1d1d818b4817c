"""The communication of a program, as node targets of the IR.

Every collective a compiled program runs is a visible pair of nodes: a *start* that issues it
asynchronously and returns a handle, and a `wait` that returns its result, so the schedule pass
overlaps communication with compute by moving starts earlier and waits later. `release` marks where
a gathered buffer's life ends, for `verify` to check that nothing reads it later.

The functions here say what each node means (their signatures are the nodes' arguments); they do
not run. `fbmt.runtime.collectives` implements each on `torch.distributed`, and the partitioner puts
those implementations in the graphs it builds (NOTE: [Lowering the IR] in runtime/partition.py).

NOTE: [Buckets]
Several collectives of one kind can be fused into one call on the wire (a bucket): fewer calls, so
less fixed latency per byte, for groups too small to fill a link. In the IR they stay one start and
one wait per group, so everything that reads a program (verify, the simulator, `fbmt.Schedule`, the
reference executor) keeps reading per-group collectives; their starts carry the same
`meta["fbmt_bucket"]` (an int) and stand next to each other, and `verify` checks that members agree
on what one call needs (kind, phase, ranks, dtype on the wire, averaging). The partitioner lowers
each run of members to one fused start (`fbmt.runtime.collectives.BUCKETED`) that returns a handle
per member, so each member's wait stays where the schedule put it. `all_to_all_reduce` is not
bucketed: its exchange is not one buffer per rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx as fx


class _IROnly(RuntimeError):
    pass


def _not_run(name: str) -> _IROnly:
    return _IROnly(
        f"fbmt.ops.{name} is a node of fbmt's IR and does not run by itself; run the program through "
        "fbmt.runtime.partition, which replaces it with its implementation"
    )


def all_gather(shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> Any:
    """Start gathering a flat shard from every rank into one flat buffer (rank-major), cast to
    `dtype` first if given (mixed precision: fewer bytes on the wire)."""
    raise _not_run("all_gather")


def reduce_scatter(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool = True,
    wire_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    """Start reducing a group's gradients over ranks (a ring reduce-scatter): `pieces` (1-D, in
    layout order) are copied into one zero-padded flat buffer of `padded_numel` elements in
    `wire_dtype`, and this rank receives the mean (or, with `average=False`, the sum) of its shard,
    as `out_dtype` (both dtypes default to the pieces')."""
    raise _not_run("reduce_scatter")


def all_to_all_reduce(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Any:
    """`reduce_scatter` with the pieces' own (narrower) dtype on the wire: each rank sends every
    other rank that rank's chunk of the flat buffer (an all-to-all) and sums the chunks it receives
    in `reduce_dtype` (NOTE: [Narrow wire] in passes/shard.py)."""
    raise _not_run("all_to_all_reduce")


def wait(handle: Any) -> torch.Tensor:
    """The result of a started collective, once it is done."""
    raise _not_run("wait")


def release(buffer: torch.Tensor) -> None:
    """The end of a gathered buffer's life: nothing reads it or its views after this node."""
    raise _not_run("release")


def bucket_of(start: fx.Node) -> int | None:
    """The bucket a collective's start is fused into (NOTE: [Buckets]); None: a call of its own."""
    return start.meta.get("fbmt_bucket")


def bucket_key(start: fx.Node) -> tuple:
    """What collectives fused into one call must share (NOTE: [Buckets]): kind, phase, ranks, the
    dtype on the wire, and for reductions whether they average."""
    if start.target is all_gather:
        g = gather_args(start)
        dtype = g.dtype or g.shard.meta["val"].dtype
        return (start.target.__name__, start.meta.get("fbmt_phase"), g.world_size, dtype)
    r = reduction_args(start)
    return (start.target.__name__, start.meta.get("fbmt_phase"), r.world_size, r.wire_dtype, r.average)


GATHERS = (all_gather,)
REDUCTIONS = (reduce_scatter, all_to_all_reduce)  # a group's gradients, over ranks
BUCKETABLE = (all_gather, reduce_scatter)
STARTS = GATHERS + REDUCTIONS
COLLECTIVES = frozenset((*STARTS, wait, release))


class Gather(NamedTuple):
    """The arguments of an `all_gather` node, by name."""

    shard: fx.Node
    world_size: int
    dtype: torch.dtype | None  # the dtype on the wire and of the buffer; None: the shard's


class Reduction(NamedTuple):
    """The arguments of a `reduce_scatter` or `all_to_all_reduce` node, by name."""

    pieces: list[fx.Node]
    world_size: int
    padded_numel: int
    average: bool
    wire_dtype: torch.dtype  # the dtype the flat buffer crosses the wire in
    reduce_dtype: torch.dtype  # the dtype the chunks are summed in
    out_dtype: torch.dtype  # the dtype of the shard gradient the wait returns


def gather_args(node: fx.Node) -> Gather:
    """The arguments of an `all_gather` node, by name."""
    shard, world, *dtype = node.args
    return Gather(shard, world, dtype[0] if dtype else None)


def reduction_args(node: fx.Node) -> Reduction:
    """The arguments of a `reduce_scatter` or `all_to_all_reduce` node, by name, with the
    dtypes it sends, reduces in and returns."""
    pieces, world, padded, average, *dtypes = node.args
    piece = pieces[0].meta["val"].dtype
    if node.target is all_to_all_reduce:
        reduce, out = dtypes
        return Reduction(pieces, world, padded, average, piece, reduce, out)
    wire = dtypes[0] if dtypes else piece
    out = dtypes[1] if len(dtypes) > 1 else wire
    return Reduction(pieces, world, padded, average, wire, wire, out)
