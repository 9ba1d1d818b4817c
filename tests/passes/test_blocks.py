"""The blocks pass: every forward node tagged with its block, from the layout planned on the module."""

from __future__ import annotations

import torch

from fbmt.compiler import meta
from fbmt.compiler.passes import assign_blocks
from fbmt.compiler.program import FWD
from tests.models.reference import gpt
from tests.passes.helpers import apply, assert_same_results, run, tangents_for, traced


def test_every_forward_node_is_tagged_with_the_block_of_its_module_and_nothing_else_changes():
    torch.manual_seed(0)
    model = gpt()
    idx = torch.randint(0, 64, (2, 16))
    before = traced(model, idx)
    after, stats = apply(assign_blocks, before)
    blocks = {}
    for n in after.graph.nodes:
        if meta.phase(n) == FWD:
            module = meta.module(n)
            assert meta.block(n) == after.layout.block_of_module(module), n
            blocks.setdefault(meta.block(n), 0)
            blocks[meta.block(n)] += 1
        else:
            assert not meta.has_block(n), n
    assert {"h.0", "h.1", "wte", "lm_head"} <= set(blocks) and blocks["h.0"] == blocks["h.1"]
    assert stats.nodes == {b: c for b, c in blocks.items() if b is not None}
    assert str(stats).startswith("forward nodes per block: wte: 1, wpe: 1, h.0: ")
    assert not meta.has_block(next(n for n in before.graph.nodes if n.op == "call_function"))  # pure
    assert [n.target for n in before.graph.nodes] == [n.target for n in after.graph.nodes]
    tangents = tangents_for(before)
    assert_same_results(run(before, model, [idx], tangents), run(after, model, [idx], tangents), rtol=0, atol=0)


def test_a_deep_models_pass_lines_name_a_run_of_alike_layers_once():
    """A pass's line for a model of many layers stays one readable line: the layers that read the same
    are one entry (their first and last name and how many), and a layer that differs keeps its own."""
    from fbmt.compiler.passes import BlockRecompute, RematStats

    stats = assign_blocks(traced(gpt(n_layer=4), torch.randint(0, 64, (2, 16))))[1]
    assert str(stats).startswith("forward nodes per block: wte: 1, wpe: 1, h.0 ... h.3 (4 blocks): ")
    recompute = [BlockRecompute(f"h.{i}", 39, 7, 2) for i in range(5)] + [BlockRecompute("h.5", 3, 0, 1)]
    recompute += [BlockRecompute("h.6", 3, 0, 1), BlockRecompute("ln_f", 3, 0, 1), BlockRecompute("", 1, 0, 0)]
    assert str(RematStats({}, tuple(recompute))) == (
        "h.0 ... h.4 (5 blocks): 39 recomputed (7 late), 2 saved; h.5: 3 recomputed, 1 saved; "
        "h.6: 3 recomputed, 1 saved; ln_f: 3 recomputed, 1 saved; <root>: 1 recomputed, 0 saved"
    )
