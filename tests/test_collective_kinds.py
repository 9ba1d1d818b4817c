"""A collective kind added through the table alone (NOTE: [Collective kinds]): a row and its two
implementations, and every layer takes it up: the shard pass emits it, verify and the schedule
strategies accept it, the partitioner lowers it, the reference executor runs it, the simulator prices
it, `fbmt.calibrate` could probe it, and a model trains with it on 2 gloo ranks as in eager PyTorch.

The kind is the worked example of docs/ARCHITECTURE.md: a gradient reduction by an all-reduce of the
whole flat buffer, each rank keeping its own chunk (what a tensor-parallel all-reduce would be)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import fbmt
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta
from tests.dist import run_ranks
from tests.models.reference import gpt


def all_reduce_shard(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Any:
    """Start reducing a group's gradients with an all-reduce of the whole flat buffer; this rank keeps
    its shard (an IR node: it does not run)."""
    raise comm.not_run("all_reduce_shard")


def _start(pieces, world_size, padded_numel, average, wire_dtype, reduce_dtype, out_dtype) -> comm.Pending:
    """The implementation: the pieces copied into one zero-padded buffer, all-reduced asynchronously."""
    flat = torch.zeros(padded_numel, dtype=wire_dtype, device=pieces[0].device)
    torch.cat([p.reshape(-1).to(wire_dtype) for p in pieces], out=flat[: sum(p.numel() for p in pieces)])
    work = dist.all_reduce(flat, async_op=True) if world_size > 1 else None
    chunk, rank = padded_numel // world_size, dist.get_rank() if world_size > 1 else 0
    mine = lambda: flat[rank * chunk : (rank + 1) * chunk].clone()  # noqa: E731
    return comm.Pending(flat, work, divisor=world_size if average else 1, out_dtype=out_dtype, then=mine)


def _probe(numel: int, device: torch.device):
    flat = torch.ones(numel, device=device)
    return lambda async_op=False: dist.all_reduce(flat, async_op=async_op)


KIND = comm.CollectiveKind(
    node=all_reduce_shard,
    role=comm.REDUCE,
    implementation=_start,
    reference=comm.kind_of(comm.reduce_scatter).reference,  # the same mean or sum of this rank's chunk
    probe=_probe,
    traffic=lambda world: 2 * (world - 1) / world,  # a ring all-reduce moves twice a reduce-scatter's bytes
    label="by all-reduce",
)


def _trains_with_the_new_kind(rank: int, world: int) -> dict:
    from tests.workers import compare, eager_reference, train_compiled

    comm.register(KIND)  # every rank's table has the row: the shard pass now chooses it for every group
    try:
        got = train_compiled("gpt", rank, world, {})  # with checks: verify after every pass
        compare(got, eager_reference("gpt"), f"gpt on {world} ranks, reduced by all_reduce_shard", buffers=False)
        return got["shard"]
    finally:
        comm.unregister(all_reduce_shard)


def test_a_kind_added_to_the_table_trains_as_eager_on_two_ranks():
    for shard in run_ranks(2, _trains_with_the_new_kind):
        assert list(shard.reductions) == ["all_reduce_shard"], shard  # every group's, and nothing else
        assert f"({shard.reductions['all_reduce_shard']} by all-reduce)" in str(shard)


def test_every_layer_reads_the_new_kind_from_the_table():
    comm.register(KIND)
    try:
        torch.manual_seed(0)
        model = fbmt.compile(gpt(n_layer=2), world_size=4, checks=True, schedule="bucket")
        idx = torch.randint(0, 64, (4, 16))
        program = model.trace(idx, idx)
        starts = [n for n in program.graph.nodes if comm.is_reduction(n)]
        assert starts and all(n.target is all_reduce_shard for n in starts)  # the shard pass emitted it
        assert all(meta.bucket(n) is None for n in starts)  # no bucketed implementation: never fused
        sim = fbmt.simulate(program, fbmt.sim.H200)  # priced by its traffic: twice a reduce-scatter's
        ours = [c for c in sim.collectives if c.kind == "all_reduce_shard"]
        assert len(ours) == len(starts)
        latency, bandwidth = fbmt.sim.H200.link("all_reduce_shard")
        c = ours[0]
        assert c.ended - c.began >= latency + 2 * 3 / 4 * c.bytes / bandwidth * 0.999
    finally:
        comm.unregister(all_reduce_shard)
    assert comm.kind_of(all_reduce_shard) is None and comm.named("all_reduce_shard") is None
