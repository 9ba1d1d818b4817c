"""The blocks pass: every forward node tagged with its block, from the layout planned on the module."""

from __future__ import annotations

import torch

from fbmt.passes import assign_blocks
from fbmt.program import FWD
from tests.models.reference import gpt
from tests.passes.helpers import apply, assert_same_results, run, tangents_for, traced


def test_every_forward_node_is_tagged_with_the_block_of_its_module_and_nothing_else_changes():
    torch.manual_seed(0)
    model = gpt()
    idx = torch.randint(0, 64, (2, 16))
    before = traced(model, idx)
    after, summary = apply(assign_blocks, before)
    blocks = {}
    for n in after.graph.nodes:
        if n.meta.get("fbmt_phase") == FWD:
            module = n.meta.get("fbmt_module")
            assert n.meta["fbmt_block"] == after.layout.block_of_module(module), n
            blocks.setdefault(n.meta["fbmt_block"], 0)
            blocks[n.meta["fbmt_block"]] += 1
        else:
            assert "fbmt_block" not in n.meta, n
    assert {"h.0", "h.1", "wte", "lm_head"} <= set(blocks) and blocks["h.0"] == blocks["h.1"]
    assert summary.startswith("forward nodes per block: ") and "h.0: " in summary
    assert "fbmt_block" not in next(n for n in before.graph.nodes if n.op == "call_function").meta  # pure
    assert [n.target for n in before.graph.nodes] == [n.target for n in after.graph.nodes]
    tangents = tangents_for(before)
    assert_same_results(run(before, model, [idx], tangents), run(after, model, [idx], tangents), rtol=0, atol=0)
