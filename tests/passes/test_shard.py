"""The shard pass (ZeRO-3/2): flat shards, gathers before use, releases after, one gradient
reduction per group; on tiny programs (one rank, the reference executor) and for 8 ranks in one
process (structure only)."""

from __future__ import annotations

import pytest
import torch

import fbmt
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta
from fbmt.compiler.passes import shard_parameters
from tests.models.reference import batch, gpt
from tests.passes.helpers import (
    REDUCTIONS,
    apply,
    assert_same_results,
    nodes,
    run,
    tangents_for,
    through,
    traced,
)


def _program(**cfg):
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=3), world_size=8, checks=True, **cfg)
    (idx,), _, tgt = batch("gpt", 0)
    return model.trace(idx, tgt)


def _groups_read_in(program, phase):
    return {meta.group(n) for n in nodes(program, comm.all_gather, phase)}


@pytest.mark.parametrize("zero", [3, 2])
def test_sharding_gives_the_same_outputs_and_gradients(zero):
    torch.manual_seed(0)
    model = gpt()
    idx = torch.randint(0, 64, (2, 16))
    before = through(traced(model, idx), "shard", remat="none")
    after, stats = apply(shard_parameters, before, zero=zero)
    assert {r.kind for r in after.inputs} == {"shard", "input", "tangent"}  # no full parameter is fed
    assert {r.kind for r in after.outputs} == {"output", "shard_grad"}
    assert stats.zero == zero and stats.groups == 5 and stats.reductions == {"reduce_scatter": 5}
    assert stats.gathers == len(nodes(after, comm.all_gather)) > 5 if zero == 3 else stats.gathers == 5
    tangents = tangents_for(before)
    assert_same_results(run(before, model, [idx], tangents), run(after, model, [idx], tangents), rtol=0, atol=0)


@pytest.mark.parametrize("zero", [3, 2])
def test_one_gather_per_block_and_phase_and_one_reduce_scatter(zero):
    program = _program(zero=zero)
    layout = program.layout
    assert layout.world_size == 8 and all(g.padded_numel % 8 == 0 for g in layout.groups)
    fwd = [meta.group(n) for n in nodes(program, comm.all_gather, "fwd")]
    bwd = [meta.group(n) for n in nodes(program, comm.all_gather, "bwd")]
    rs = [meta.group(n) for n in nodes(program, REDUCTIONS, "bwd")]
    assert sorted(fwd) == list(range(len(layout.groups)))  # every group gathered once in forward
    assert sorted(rs) == list(range(len(layout.groups)))  # every group reduced once
    blocks = [g.index for g in layout.groups if g.block.startswith("h.")]
    if zero == 3:
        assert set(blocks) <= set(bwd) and len(bwd) == len(set(bwd))  # re-gathered once for backward
        assert bwd.index(blocks[-1]) < bwd.index(blocks[0])  # in reverse block order
    else:
        assert not set(blocks) & set(bwd)  # ZeRO-2 keeps the forward's gathered buffers
    assert len(nodes(program, comm.release)) == len(fwd) + len(bwd)


def test_the_group_read_at_the_turnaround_stays_gathered_unless_its_block_asks_for_zero3():
    # the tied embedding is read last in the forward (the logits) and first in the backward
    program = _program()
    groups = {g.block: g.index for g in program.layout.groups}
    bwd = _groups_read_in(program, "bwd")
    assert groups["wte"] not in bwd, "the turnaround group was gathered again for the backward"
    assert {groups["h.2"], groups["ln_f"]} <= bwd, "only the turnaround group may skip its backward gather"
    assert program.stats("shard").turnaround == ("wte",)
    blocks = {b: {} for b in groups}
    blocks["wte"] = {"zero": 3}
    assert groups["wte"] in _groups_read_in(_program(blocks=blocks), "bwd")


def test_a_block_named_with_zero2_keeps_its_gather_and_the_others_gather_again():
    blocks = {b: {} for b in ("wte", "wpe", "h.0", "h.2", "ln_f", "lm_head")}
    blocks["h.1"] = {"zero": 2}
    program = _program(blocks=blocks)
    groups = {g.block: g.index for g in program.layout.groups}
    bwd = _groups_read_in(program, "bwd")
    assert groups["h.1"] not in bwd and {groups["h.0"], groups["h.2"]} <= bwd


@pytest.mark.parametrize(
    "options, kind",
    [
        (dict(param_dtype=torch.bfloat16), comm.all_to_all_reduce),  # bf16 gradients summed in fp32, one node
        (dict(param_dtype=torch.bfloat16, narrow_wire=False), comm.reduce_scatter),  # as across nodes
        (dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), comm.reduce_scatter),  # nothing to narrow
        (dict(), comm.reduce_scatter),  # fp32 all the way
    ],
)
def test_the_shard_pass_chooses_the_wire_and_the_program_shows_it(options, kind):
    """NOTE: [Narrow wire]: every collective that runs is a node of the program."""
    program = _program(**options)
    reductions = nodes(program, REDUCTIONS)
    assert reductions and all(n.target is kind for n in reductions)
    assert kind.__name__ in str(program)
    assert program.stats("shard").reductions == {kind.__name__: len(reductions)}
    assert ("narrow wire" in program.summary("shard")) == (kind is comm.all_to_all_reduce)


def test_one_rank_never_narrows_its_wire():
    torch.manual_seed(0)
    program = fbmt.compile(gpt(), world_size=1, param_dtype=torch.bfloat16, narrow_wire=True).trace(
        torch.randint(0, 64, (2, 16))
    )
    assert not nodes(program, comm.all_to_all_reduce) and nodes(program, comm.reduce_scatter)


class _WeightNormed(torch.nn.Module):
    """Layers whose weights are divided by their norms: forward values of the weights alone that the
    backward reads, one a reduction (the norm), one full-sized (the normed weight)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            w = layer.weight / layer.weight.norm()
            x = torch.tanh(x @ w.t() + layer.bias)
        return x.square().mean()


def _weight_normed_against_eager(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    torch.manual_seed(0)
    ref = _WeightNormed()
    model = fbmt.compile(_WeightNormed(), checks=True, cache_dir=False)
    model.load_state_dict(ref.state_dict())
    for step in range(2):
        x = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(step))[4 * rank : 4 * rank + 4]
        loss, want = model(x), ref(x)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
        loss.backward(), want.backward()
        grads = model.full_gradients()
        for name, p in ref.named_parameters():
            dist.all_reduce(p.grad)
            torch.testing.assert_close(grads[name], p.grad / world, rtol=1e-5, atol=1e-7)
        model.zero_grad(), ref.zero_grad()
    return [meta.recompute(n) or "" for n in model.program.graph.nodes if "linalg_vector_norm" in str(n.target)]


def test_a_reduction_of_parameters_is_saved_for_the_backward_and_its_gradients_are_eager():
    """NOTE in fbmt/compiler/passes/shard.py: on two ZeRO-3 ranks the weights' norms are taken once, in
    the forward (the full-sized normed weights are recomputed from the backward's gather), with eager's
    gradients."""
    from tests.dist import run_ranks

    for norms in run_ranks(2, _weight_normed_against_eager):
        assert norms and "param" not in norms, norms
