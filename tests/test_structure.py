"""The transformed program's structure, compiled for 8 ranks in one process (no process group)."""

from __future__ import annotations

import functools

import pytest
import torch

import fbmt
from fbmt.passes.verify import VerifyError, verify
from fbmt.program import BWD, is_view
from fbmt.runtime import collectives
from fbmt.sim import peak_memory
from tests.models.reference import batch, gpt, gpt_short


def _program(**cfg):
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=3), world_size=8, checks=True, **cfg)
    (idx,), _, tgt = batch("gpt", 0)
    return model, model.trace(idx, tgt)


def _collectives(program, fn, phase):
    return [n for n in program.graph.nodes if n.target is fn and n.meta["fbmt_phase"] == phase]


def _groups_read_in(program, phase):
    return {n.meta["fbmt_group"] for n in _collectives(program, collectives.all_gather, phase)}


@pytest.mark.parametrize("zero", [3, 2])
def test_one_gather_per_block_and_phase_and_one_reduce_scatter(zero):
    model, program = _program(zero=zero)
    layout = program.layout
    assert layout.world_size == 8 and all(g.padded_numel % 8 == 0 for g in layout.groups)
    fwd = [n.meta["fbmt_group"] for n in _collectives(program, collectives.all_gather, "fwd")]
    bwd = [n.meta["fbmt_group"] for n in _collectives(program, collectives.all_gather, "bwd")]
    rs = [n.meta["fbmt_group"] for n in _collectives(program, collectives.reduce_scatter, "bwd")]
    assert sorted(fwd) == list(range(len(layout.groups)))  # every group gathered once in forward
    assert sorted(rs) == list(range(len(layout.groups)))  # every group reduce-scattered once
    blocks = [g.index for g in layout.groups if g.block.startswith("h.")]
    if zero == 3:
        assert set(blocks) <= set(bwd) and len(bwd) == len(set(bwd))  # re-gathered once for backward
        assert bwd.index(blocks[-1]) < bwd.index(blocks[0])  # in reverse block order
    else:
        assert not set(blocks) & set(bwd)  # ZeRO-2 keeps the forward's gathered buffers
    releases = [n for n in program.graph.nodes if n.target is collectives.release]
    assert len(releases) == len(fwd) + len(bwd)


def test_the_group_read_at_the_turnaround_stays_gathered_unless_its_block_asks_for_zero3():
    # the tied embedding is read last in the forward (the logits) and first in the backward
    _, program = _program()
    groups = {g.block: g.index for g in program.layout.groups}
    bwd = _groups_read_in(program, "bwd")
    assert groups["wte"] not in bwd, "the turnaround group was gathered again for the backward"
    assert {groups["h.2"], groups["ln_f"]} <= bwd, "only the turnaround group may skip its backward gather"
    assert "kept gathered across the turnaround: wte" in program.summary("shard")
    blocks = {b: {} for b in groups}
    blocks["wte"] = {"zero": 3}
    _, forced = _program(blocks=blocks)
    assert groups["wte"] in _groups_read_in(forced, "bwd")


def test_prefetch_issues_next_gather_before_block_compute():
    _, program = _program(schedule="prefetch")
    nodes = list(program.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    groups = {g.block: g.index for g in program.layout.groups}
    start = {n.meta["fbmt_group"]: pos[n] for n in _collectives(program, collectives.all_gather, "fwd")}
    for i in range(2):
        first_compute = min(pos[n] for n in nodes if n.meta.get("fbmt_block") == f"h.{i}"
                            and n.meta["fbmt_phase"] == "fwd" and n.target not in collectives.EFFECTFUL)
        assert start[groups[f"h.{i + 1}"]] < first_compute, f"h.{i + 1} gather not issued before h.{i} computes"
    rs = _collectives(program, collectives.reduce_scatter, "bwd")
    later_compute = [n for n in nodes[pos[rs[0]] + 1:] if n.meta.get("fbmt_phase") == "bwd"
                     and n.target not in collectives.EFFECTFUL and n.op == "call_function"]
    assert later_compute, "the first reduce-scatter should overlap later backward compute"


@pytest.mark.parametrize("remat", ["none", "block"])
def test_the_first_blocks_weight_products_run_beside_the_last_reduce_scatter(remat):
    # NOTE: [Tail]: h.0's weight products feed only its reduce-scatter; "prefetch-tail" computes them
    # after the tied embedding's (the last group's) reduce-scatter has started, and waits for that one after them
    aten = torch.ops.aten
    _, program = _program(remat=remat, schedule="prefetch-tail")
    _, in_order = _program(remat=remat)
    groups = {g.block: g.index for g in program.layout.groups}

    def tail(p):
        nodes = list(p.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        rs = {n.meta["fbmt_group"]: n for n in _collectives(p, collectives.reduce_scatter, "bwd")}
        first, last = rs[groups["h.0"]], rs[groups["wte"]]
        waited = next(u for u in last.users if u.target is collectives.wait)
        return nodes, pos, first, last, waited

    nodes, pos, first, last, waited = tail(program)
    beside = [n for n in nodes[pos[last]:pos[waited]] if n.target is aten.mm.default]
    assert pos[last] < pos[waited] < pos[first], "the embedding's reduce-scatter should start before h.0's"
    assert beside, "no product runs while the embedding's reduce-scatter is in flight"
    for n in beside:  # each feeds h.0's reduce-scatter and nothing else
        todo, reached = [n], set()
        while todo:
            for u in todo.pop().users:
                assert u is first or u.meta["fbmt_phase"] == "bwd" and u.target is not collectives.wait, u
                if u is not first and u not in reached:
                    reached.add(u)
                    todo.append(u)
    summary = program.summary("schedule")
    assert "moved h.0's" in summary and "wte's reduce-scatter start" in summary
    assert peak_memory(program) <= peak_memory(in_order)  # kept only where the estimated peak does not grow

    nodes, pos, first, last, waited = tail(in_order)
    assert pos[first] < pos[last], "prefetch keeps the backward's compute as traced"
    assert not [n for n in nodes[pos[first]:] if n.target is aten.mm.default]


def test_the_tail_moves_as_many_products_as_keep_the_peak(monkeypatch):
    # NOTE: [Tail]: a stand-in peak that grows by 1 MiB for each product after the last reduce-scatter's
    # start beyond the second: the last 2 of h.0's 4 products move; with none allowed, none does
    from fbmt.passes import schedule

    def peak(allowed, program):
        nodes = list(program.graph.nodes)
        group = next(g.index for g in program.layout.groups if g.block == "wte")
        wte = next(n for n in _collectives(program, collectives.reduce_scatter, "bwd")
                   if n.meta["fbmt_group"] == group)
        moved = [n for n in nodes[nodes.index(wte):] if n.target is torch.ops.aten.mm.default]
        return max(len(moved) - allowed, 0) * 2**20

    for allowed, said in ((2, "moved h.0's last 2 of 4 weight-gradient products"),
                          (0, "the tail kept in order: moving h.0's last weight-gradient product after wte's "
                              "reduce-scatter start would raise peak memory by 1 MiB")):
        monkeypatch.setattr(schedule, "peak_memory", functools.partial(peak, allowed))
        _, program = _program(remat="none", schedule="prefetch-tail")
        assert said in program.summary("schedule"), program.summary("schedule")


class _Norm(torch.nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class _Decoder(torch.nn.Module):
    """SwiGLU blocks, a final norm and an untied output layer, as Llama ends."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_SwiGLU() for _ in range(2)])
        self.norm, self.output = _Norm(), torch.nn.Linear(32, 64, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)).sum()


def test_a_small_groups_reduce_scatter_does_not_wait_for_the_one_before():
    # NOTE: [Small groups]: the final norm's gradient is reduced right after the output layer's; were it
    # counted, the backward would wait there for the output layer's reduce-scatter to finish
    torch.manual_seed(0)
    program = fbmt.compile(_Decoder(), world_size=2, checks=True).trace(torch.randn(4, 8, 32))
    pos = {n: i for i, n in enumerate(program.graph.nodes)}
    groups = {g.block: g.index for g in program.layout.groups}
    starts = {n.meta["fbmt_group"]: n for n in _collectives(program, collectives.reduce_scatter, "bwd")}
    waits = {g: next(u for u in n.users if u.target is collectives.wait) for g, n in starts.items()}
    assert pos[starts[groups["output"]]] < pos[starts[groups["norm"]]]
    assert pos[waits[groups["output"]]] > pos[starts[groups["norm"]]]
    assert pos[waits[groups["output"]]] < pos[starts[groups["layers.1"]]]  # still one large one in flight


def test_backward_gathers_its_first_block_when_the_backward_begins():
    # ln_f's weights are too few to hide a gather behind: h.2's gather must not wait for them
    _, program = _program(schedule="prefetch")
    nodes = list(program.graph.nodes)
    groups = {g.block: g.index for g in program.layout.groups}
    first_bwd = next(i for i, n in enumerate(nodes) if n.op == "call_function" and n.meta["fbmt_phase"] == "bwd"
                     and n.target not in collectives.EFFECTFUL)
    start = {n.meta["fbmt_group"]: nodes.index(n) for n in _collectives(program, collectives.all_gather, "bwd")}
    assert start[groups["ln_f"]] < first_bwd and start[groups["h.2"]] < first_bwd
    assert start[groups["h.1"]] > first_bwd  # one block ahead, not all of them


def test_no_overlap_waits_right_after_each_start():
    _, program = _program(schedule="none")
    for n in program.collectives():
        assert n.next.target is collectives.wait and n.next.args[0] is n


def _recomputed(program):
    """The blocks whose backward recomputes a matrix product or a product's operand (the trailing
    blocks that save their activations still recompute other cheap ops, as remat="mincut" does)."""
    from fbmt.passes.remat import _operand, expensive

    return {n.meta.get("fbmt_block") for n in program.graph.nodes
            if n.meta.get("fbmt_recompute") == "activation" and (expensive(n) or _operand(n, BWD))}


@pytest.mark.parametrize("sequences, recomputed, saved", [
    (4, set(), "h.0 ... lm_head (5 blocks): saved"),
    (16, {"h.0"}, "h.1, h.2, ln_f, lm_head: saved"),
    (24, {"h.0", "h.1"}, "h.2, ln_f, lm_head: saved"),
    (32, {"h.0", "h.1", "h.2", "lm_head"}, "h.2, ln_f, lm_head: recomputed although the backward begins with them")])
def test_remat_saves_the_last_blocks_whose_activations_fit_under_the_gradients(sequences, recomputed, saved):
    # NOTE: [Trailing blocks]: the more tokens, the fewer blocks' activations fit
    torch.manual_seed(0)
    model = fbmt.compile(gpt_short(), world_size=2, checks=True, remat="block")
    (idx,), _, tgt = batch("gpt_short", 0)
    program = model.trace(idx[:sequences], tgt[:sequences])
    assert _recomputed(program) == recomputed
    assert saved in program.summary("remat")


@pytest.mark.parametrize("sequences, recomputed", [(8, set()), (32, {"h.0", "h.1", "h.2", "lm_head"})])
def test_selective_remat_saves_the_last_blocks_that_fit_too(sequences, recomputed):
    torch.manual_seed(0)
    model = fbmt.compile(gpt_short(), world_size=2, checks=True, remat="selective")
    (idx,), _, tgt = batch("gpt_short", 0)
    assert _recomputed(model.trace(idx[:sequences], tgt[:sequences])) == recomputed


def test_the_last_block_recomputes_where_saving_it_would_raise_the_peak():
    _, program = _program()  # 8 x 16 tokens on 8 ranks: the saved activations outweigh the gradient shards
    assert _recomputed(program) >= {"h.0", "h.1", "h.2"}
    assert "h.2, ln_f, lm_head: recomputed although the backward begins with them" in program.summary("remat")


def test_a_block_named_with_its_own_remat_policy_is_recomputed_even_last():
    blocks = {b: {} for b in ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]}
    blocks["h.2"] = {"remat": "block"}
    torch.manual_seed(0)
    model = fbmt.compile(gpt_short(), world_size=2, checks=True, blocks=blocks)
    (idx,), _, tgt = batch("gpt_short", 0)
    assert {"h.0", "h.1", "h.2"} <= _recomputed(model.trace(idx[:4], tgt[:4]))


def test_selective_remat_saves_matmuls_and_recomputes_the_cheap_ops():
    from fbmt.passes.remat import expensive

    _, program = _program(remat="selective")
    recomputed = [n for n in program.graph.nodes if n.meta.get("fbmt_recompute") == "activation"]
    assert {"h.0", "h.1", "h.2"} <= {n.meta.get("fbmt_block") for n in recomputed}
    assert recomputed and not any(expensive(n) for n in recomputed)
    fwd_mms = [n for n in program.graph.nodes if expensive(n) and n.meta.get("fbmt_phase") == "fwd"]
    assert any(u.meta.get("fbmt_phase") == "bwd" for n in fwd_mms for u in n.users)  # matmul outputs are saved


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
    from fbmt.passes.remat import _operand, _saved_bytes, expensive

    programs = {}
    for remat in ("none", "mincut", "selective"):
        torch.manual_seed(0)
        model = fbmt.compile(_Stack(), world_size=2, checks=True, remat=remat)
        programs[remat] = model.trace(torch.randn(64, 8, 32))
    recomputed = {remat: [n for n in p.graph.nodes
                          if n.meta.get("fbmt_recompute") == "activation" and n.meta.get("fbmt_block") == "layers.0"]
                  for remat, p in programs.items()}
    # NOTE: [Min-cut]: SwiGLU's activation and the norm's x * rsqrt come back from the saved projection,
    # input and reciprocal root; the mean square and the products do not, nor (NOTE: [Operands]) the
    # values a backward product reads: the norm's output and SwiGLU's product are saved
    assert {str(n.target) for n in recomputed["mincut"]} == {"aten.silu.default", "aten.mul.Tensor"}
    assert not any(_operand(n, BWD) for n in recomputed["mincut"])
    assert any(_operand(n, BWD) for n in recomputed["selective"])  # what "selective" recomputes instead
    assert not any(expensive(n) for n in programs["mincut"].graph.nodes if n.meta.get("fbmt_recompute"))
    saved = {remat: _saved_bytes(p.graph, []) for remat, p in programs.items()}
    assert saved["selective"] < saved["mincut"] < 0.75 * saved["none"], saved


def test_recomputed_values_come_right_before_their_first_reader_and_block_remat_recomputes_twice():
    torch.manual_seed(0)
    model = fbmt.compile(_Stack(), world_size=2, checks=True, remat="block")
    program = model.trace(torch.randn(64, 8, 32))
    nodes = list(program.graph.nodes)
    copies = [n for n in nodes if n.meta.get("fbmt_recompute") == "activation"]

    def first_read(n):  # the first backward node that is not a copy and needs `n`, directly or through copies
        return min((first_read(u) if u in copies else nodes.index(u) for u in n.users), default=len(nodes))

    # NOTE: [Late recompute]: between a copy and its first reader, nothing but other copies, collectives
    # and the views of a gathered group's parameters (the shard pass puts those before their first reader)
    def inserted(m):
        return m in copies or is_view(m) or getattr(m.target, "__module__", None) == collectives.__name__

    for n in copies:
        assert all(map(inserted, nodes[nodes.index(n) + 1:first_read(n)])), n
    # the block's forward path recomputes SwiGLU's activation for the saved product; the late copy that
    # the backward reads is recomputed again from the projection, as remat="mincut" recomputes it
    silus = [n for n in copies if n.meta.get("fbmt_block") == "layers.0" and str(n.target) == "aten.silu.default"]
    assert len(silus) == 2
    assert "recomputed (" in program.summary("remat") and " late)" in program.summary("remat")


def test_a_recomputed_multi_output_op_keeps_its_outputs_next_to_it():
    """A compiled region returns tensors: if a late copy of layer norm's mean were placed after a
    collective, the region computing the norm would have to return the op's tuple (NOTE: [Regions])."""
    import operator

    _, program = _program(remat="block")
    nodes = list(program.graph.nodes)
    outputs = [n for n in nodes if n.target is operator.getitem
               and n.meta.get("fbmt_recompute") == n.args[0].meta.get("fbmt_recompute") == "activation"]
    assert any(str(n.args[0].target) == "aten.native_layer_norm.default" for n in outputs)
    for n in outputs:
        between = nodes[nodes.index(n.args[0]) + 1:nodes.index(n)]
        assert all(m.target is operator.getitem and m.args[0] is n.args[0] for m in between), n


def test_print_shows_pass_history_and_collectives():
    _, program = _program()
    text = str(program)
    for name in ("blocks", "remat", "shard", "schedule", "verify"):
        assert f"# pass {name}" in text
    assert "all_gather(%shard" in text and "reduce_scatter(" in text and "release(" in text


def test_verify_rejects_a_missing_release_and_a_use_after_release():
    _, program = _program()
    broken = program.copy()
    release = next(n for n in broken.graph.nodes if n.target is collectives.release)
    broken.graph.erase_node(release)
    with pytest.raises(VerifyError, match="released 0 times"):
        verify(broken)
    early = program.copy()
    release = next(n for n in early.graph.nodes if n.target is collectives.release)
    buffer = release.args[0]
    buffer.append(release)  # release right after the wait, before the views are read
    with pytest.raises(VerifyError, match="after its release"):
        verify(early)


def test_dump_dir_writes_one_file_per_pass(tmp_path):
    model = fbmt.compile(gpt(), world_size=4, dump_dir=str(tmp_path))
    (idx,), _, tgt = batch("gpt", 0)
    model.trace(idx, tgt)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-trace.txt", "01-blocks.txt", "02-remat.txt", "03-merge.txt", "04-shard.txt",
                     "05-schedule.txt", "06-verify.txt"]
