"""The remat pass: what each policy recomputes, where the copies go, which trailing blocks save;
on tiny programs (one rank, the reference executor) and for 2-8 ranks in one process."""

from __future__ import annotations

import operator

import pytest
import torch

import fbmt
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta
from fbmt.compiler.ops import expensive, is_view
from fbmt.compiler.passes import recompute_blocks
from fbmt.compiler.passes.remat import operand, saved_bytes
from fbmt.compiler.program import BWD
from tests.models.reference import batch, gpt, gpt_short
from tests.passes.helpers import apply, assert_same_results, run, tangents_for, through, traced


def _program(**cfg):
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=3), world_size=8, checks=True, **cfg)
    (idx,), _, tgt = batch("gpt", 0)
    return model.trace(idx, tgt)


@pytest.mark.parametrize("policy", ["block", "selective", "mincut"])
def test_recomputing_gives_the_same_outputs_and_gradients(policy):
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(8, 4, 32)
    before = through(traced(model, x), "remat")
    after, stats = apply(recompute_blocks, before, policy=policy)
    copies = [n for n in after.graph.nodes if meta.recompute(n) == "activation"]
    assert copies and all(meta.phase(n) == BWD for n in copies), stats
    assert sum(b.recomputed for b in stats.blocks) == len(copies) and stats.blocks[0].block == "layers.0"
    assert stats.applied["layers.0"] == policy and stats.declined is None
    tangents = tangents_for(before)
    assert_same_results(run(before, model, [x], tangents), run(after, model, [x], tangents))


def test_remat_none_declines_and_says_why():
    before = through(traced(_Stack(), torch.randn(8, 4, 32)), "remat")
    after, stats = apply(recompute_blocks, before, policy="none")
    assert stats.declined == "no block recomputes (remat='none')" and not stats.blocks
    assert str(stats) == "declined: no block recomputes (remat='none'); activations are saved"
    assert [n.target for n in after.graph.nodes] == [n.target for n in before.graph.nodes]


def _recomputed(program):
    """The blocks whose backward recomputes a matrix product or a product's operand (the trailing
    blocks that save their activations still recompute other cheap ops, as remat="mincut" does)."""
    return {
        meta.block(n)
        for n in program.graph.nodes
        if meta.recompute(n) == "activation" and (expensive(n) or operand(n, BWD))
    }


@pytest.mark.parametrize(
    "sequences, recomputed, saved",
    [
        (4, set(), (("h.0", "h.1", "h.2", "ln_f", "lm_head"), True)),
        (16, {"h.0"}, (("h.1", "h.2", "ln_f", "lm_head"), True)),
        (24, {"h.0", "h.1"}, (("h.2", "ln_f", "lm_head"), True)),
        (32, {"h.0", "h.1", "h.2", "lm_head"}, (("h.2", "ln_f", "lm_head"), False)),
    ],
)
def test_remat_saves_the_last_blocks_whose_activations_fit_under_the_gradients(sequences, recomputed, saved):
    # NOTE: [Trailing blocks]: the more tokens, the fewer blocks' activations fit
    torch.manual_seed(0)
    model = fbmt.compile(gpt_short(), world_size=2, checks=True, remat="block")
    (idx,), _, tgt = batch("gpt_short", 0)
    program = model.trace(idx[:sequences], tgt[:sequences])
    assert _recomputed(program) == recomputed
    trailing = program.stats("remat").trailing  # which blocks save, and whether they fit
    assert (trailing.blocks, trailing.saved) == saved
    assert (trailing.saved_bytes <= trailing.gradient_bytes) == trailing.saved


@pytest.mark.parametrize("sequences, recomputed", [(8, set()), (32, {"h.0", "h.1", "h.2", "lm_head"})])
def test_selective_remat_saves_the_last_blocks_that_fit_too(sequences, recomputed):
    torch.manual_seed(0)
    model = fbmt.compile(gpt_short(), world_size=2, checks=True, remat="selective")
    (idx,), _, tgt = batch("gpt_short", 0)
    assert _recomputed(model.trace(idx[:sequences], tgt[:sequences])) == recomputed


def test_the_last_block_recomputes_where_saving_it_would_raise_the_peak():
    program = _program()  # 8 x 16 tokens on 8 ranks: the saved activations outweigh the gradient shards
    assert _recomputed(program) >= {"h.0", "h.1", "h.2"}
    trailing = program.stats("remat").trailing
    assert trailing.blocks == ("h.2", "ln_f", "lm_head") and not trailing.saved
    assert "h.2, ln_f, lm_head: recomputed although the backward begins with them" in program.summary("remat")


def test_a_block_named_with_its_own_remat_policy_is_recomputed_even_last():
    blocks = {b: {} for b in ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]}
    blocks["h.2"] = {"remat": "block"}
    torch.manual_seed(0)
    model = fbmt.compile(gpt_short(), world_size=2, checks=True, blocks=blocks)
    (idx,), _, tgt = batch("gpt_short", 0)
    assert {"h.0", "h.1", "h.2"} <= _recomputed(model.trace(idx[:4], tgt[:4]))


def test_selective_remat_saves_matmuls_and_recomputes_the_cheap_ops():
    program = _program(remat="selective")
    recomputed = [n for n in program.graph.nodes if meta.recompute(n) == "activation"]
    assert {"h.0", "h.1", "h.2"} <= {meta.block(n) for n in recomputed}
    assert recomputed and not any(expensive(n) for n in recomputed)
    fwd_mms = [n for n in program.graph.nodes if expensive(n) and meta.phase(n) == "fwd"]
    assert any(meta.phase(u) == "bwd" for n in fwd_mms for u in n.users)  # matmul outputs are saved


class _SwiGLU(torch.nn.Module):
    """RMSNorm and a SwiGLU MLP, written as Llama writes them."""

    def __init__(self, d: int = 32, f: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.gate, self.up = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_SwiGLU() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_mincut_remat_recomputes_cheap_ops_from_saved_values_but_no_product_operand_or_reduction():
    programs = {}
    for remat in ("none", "mincut", "selective"):
        torch.manual_seed(0)
        model = fbmt.compile(_Stack(), world_size=2, checks=True, remat=remat)
        programs[remat] = model.trace(torch.randn(64, 8, 32))
    recomputed = {
        remat: [n for n in p.graph.nodes if meta.recompute(n) == "activation" and meta.block(n) == "layers.0"]
        for remat, p in programs.items()
    }
    # NOTE: [Min-cut]: SwiGLU's activation and the norm's x * rsqrt come back from the saved projection,
    # input and reciprocal root; the mean square and the products do not, nor (NOTE: [Operands]) the
    # values a backward product reads: the norm's output and SwiGLU's product are saved
    assert {str(n.target) for n in recomputed["mincut"]} == {"aten.silu.default", "aten.mul.Tensor"}
    assert not any(operand(n, BWD) for n in recomputed["mincut"])
    assert any(operand(n, BWD) for n in recomputed["selective"])  # what "selective" recomputes instead
    assert not any(expensive(n) for n in programs["mincut"].graph.nodes if meta.recompute(n))
    saved = {remat: saved_bytes(p.graph, []) for remat, p in programs.items()}
    assert saved["selective"] < saved["mincut"] < 0.75 * saved["none"], saved


def test_recomputed_values_come_right_before_their_first_reader_and_block_remat_recomputes_twice():
    torch.manual_seed(0)
    model = fbmt.compile(_Stack(), world_size=2, checks=True, remat="block")
    program = model.trace(torch.randn(64, 8, 32))
    nodes = list(program.graph.nodes)
    copies = [n for n in nodes if meta.recompute(n) == "activation"]

    def first_read(n):  # the first backward node that is not a copy and needs `n`, directly or through copies
        return min((first_read(u) if u in copies else nodes.index(u) for u in n.users), default=len(nodes))

    # NOTE: [Late recompute]: between a copy and its first reader, nothing but other copies, collectives
    # and the views of a gathered group's parameters (the shard pass puts those before their first reader)
    def inserted(m):
        return m in copies or is_view(m) or comm.is_collective(m.target)

    for n in copies:
        assert all(map(inserted, nodes[nodes.index(n) + 1 : first_read(n)])), n
    # the block's forward path recomputes SwiGLU's activation for the saved product; the late copy that
    # the backward reads is recomputed again from the projection, as remat="mincut" recomputes it
    silus = [n for n in copies if meta.block(n) == "layers.0" and str(n.target) == "aten.silu.default"]
    assert len(silus) == 2
    assert any(b.late for b in program.stats("remat").blocks)


def test_a_recomputed_multi_output_op_keeps_its_outputs_next_to_it():
    """A compiled region returns tensors: if a late copy of layer norm's mean were placed after a
    collective, the region computing the norm would have to return the op's tuple (NOTE: [Regions])."""
    program = _program(remat="block")
    nodes = list(program.graph.nodes)
    outputs = [
        n
        for n in nodes
        if n.target is operator.getitem and meta.recompute(n) == meta.recompute(n.args[0]) == "activation"
    ]
    assert any(str(n.args[0].target) == "aten.native_layer_norm.default" for n in outputs)
    for n in outputs:
        between = nodes[nodes.index(n.args[0]) + 1 : nodes.index(n)]
        assert all(m.target is operator.getitem and m.args[0] is n.args[0] for m in between), n


def test_a_copy_is_named_after_its_bases_last_count_on_every_torch():
    # NOTE: [Names of copies]: a recomputed node asks for its own name, which is taken; fx of torch 2.11
    # and 2.12 then counted up from one (the first gap: `mm_3` here), testing each name on the way, a
    # number of tests quadratic in the layers. Named as torch 2.13 names it, the copy is `mm_10` there too.
    from fbmt.compiler.ops import copy_node

    g = torch.fx.Graph()
    x = g.placeholder("x")
    mms = [g.create_node("call_function", torch.ops.aten.mm.default, (x, x), name=f"mm_{i}") for i in (1, 2, 9)]
    assert [n.name for n in mms] == ["mm_1", "mm_2", "mm_9"]
    copy = copy_node(g, mms[0])
    assert copy.name == "mm_10" and copy.target is mms[0].target and copy.args == (x, x)
    assert copy_node(g, x).name == "x_1" and copy_node(g, copy).name == "mm_11"
