"""Communication as ordinary graph nodes.

Every collective of a compiled program is a visible node: a *start* that issues the operation
asynchronously and returns a `Pending` handle, and a `wait` that returns the result. The schedule
pass overlaps communication with compute simply by moving starts earlier and waits later.

On NCCL, `async_op=True` runs the collective on ProcessGroupNCCL's own stream, and `wait()` only
makes the current (compute) stream wait on an event: no host synchronization inside a step. On gloo
the collective runs on gloo's worker thread and `wait()` blocks the host.

`release(buffer)` marks the end of a gathered buffer's life. The generated code drops every value
after its last use, so once `release` has run nothing references the buffer and its memory returns
to the allocator. `verify` checks that no node reads a buffer after its release.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """An issued collective: its output tensor, the work handle to wait on, what to do after."""

    __slots__ = ("tensor", "work", "divisor", "out_dtype")

    def __init__(self, tensor: torch.Tensor, work: object | None, divisor: int = 1,
                 out_dtype: torch.dtype | None = None):
        self.tensor, self.work, self.divisor, self.out_dtype = tensor, work, divisor, out_dtype


def all_gather(shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> Pending:
    """Start gathering a flat shard from every rank into one flat buffer (rank-major), cast to
    `dtype` first if given (mixed precision: fewer bytes on the wire)."""
    if dtype is not None and dtype != shard.dtype:
        shard = shard.to(dtype)
    if world_size == 1:
        return Pending(shard, None)
    out = torch.empty(shard.numel() * world_size, dtype=shard.dtype, device=shard.device)
    return Pending(out, all_gather_into(out, shard, async_op=True))


def reduce_scatter(pieces: list[torch.Tensor], world_size: int, padded_numel: int, average: bool = True,
                   wire_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> Pending:
    """Start reducing a group's gradients over ranks; this rank receives the mean (or sum) of its shard.

    `pieces` (1-D, in layout order) are copied into one zero-padded flat buffer of `padded_numel`
    elements, cast to `wire_dtype` in the same copy (mixed precision: no intermediate flat in the
    compute dtype); the result is returned as `out_dtype` (both default to the pieces' dtype).
    """
    dtype = wire_dtype or pieces[0].dtype
    flat = torch.empty(padded_numel, dtype=dtype, device=pieces[0].device)
    numel = sum(p.numel() for p in pieces)
    torch.cat(pieces, out=flat[:numel])
    flat[numel:].zero_()
    if world_size == 1:
        return Pending(flat, None, out_dtype=out_dtype)
    out = torch.empty(flat.numel() // world_size, dtype=flat.dtype, device=flat.device)
    return Pending(out, reduce_scatter_into(out, flat, async_op=True), divisor=world_size if average else 1,
                   out_dtype=out_dtype)


def wait(pending: Pending) -> torch.Tensor:
    if pending.work is not None:
        pending.work.wait()
    if pending.divisor != 1:
        pending.tensor.div_(pending.divisor)
    if pending.out_dtype is not None and pending.out_dtype != pending.tensor.dtype:
        return pending.tensor.to(pending.out_dtype)
    return pending.tensor


def release(buffer: torch.Tensor) -> None:
    """End of a gathered buffer's life; see the module docstring."""
    return None


STARTS = (all_gather, reduce_scatter)
# Node targets with effects: never dropped when unused, never recomputed. Others register here too
# (fbmt.inspect's recording ops).
EFFECTFUL = {all_gather, reduce_scatter, wait, release}
