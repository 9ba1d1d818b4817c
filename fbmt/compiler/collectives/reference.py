"""What each collective kind means: its result computed synchronously, from all-gathers alone.

The reference executor (`fbmt.compiler.runtime.reference`) runs a start with its kind's `reference`
and hands the result on at the `wait`: a gather is the shards gathered (cast first where asked), a
reduction every rank's flat buffer gathered and this rank's chunk summed in the reduce dtype. The
fast implementations (`torch_impl`) must give the same values. On one rank no process group is needed.
"""

from __future__ import annotations

import torch

from fbmt import job


def all_gather(shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    x = shard.to(dtype) if dtype is not None else shard
    return job.gather_flat(x) if world_size > 1 else x.clone()


def reduction(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """This rank's chunk of the sum (or mean) over ranks of the flat, zero-padded buffer of `pieces`
    sent in `wire_dtype`, summed in `reduce_dtype`: what every reduction kind computes."""
    flat = torch.zeros(padded_numel, dtype=wire_dtype, device=pieces[0].device)
    torch.cat([p.reshape(-1).to(wire_dtype) for p in pieces], out=flat[: sum(p.numel() for p in pieces)])
    every = (job.gather_flat(flat) if world_size > 1 else flat).view(world_size, world_size, -1)
    chunk = every[:, job.rank() if world_size > 1 else 0].to(reduce_dtype).sum(0)
    return (chunk / world_size if average else chunk).to(out_dtype)
