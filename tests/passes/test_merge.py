"""The merge pass (NOTE: [Merged products]): products that read one input become one product."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta
from fbmt.compiler.passes import merge_products
from fbmt.compiler.program import FWD
from fbmt.tools.sim import peak_memory
from tests.dist import run_ranks
from tests.models.reference import Llama, batch
from tests.passes.helpers import apply, run, tangents_for, through, traced
from tests.workers import compare, eager_reference, lm_step_matches, train_compiled

aten = torch.ops.aten


def _trace(model: nn.Module, *inputs: torch.Tensor, **cfg):
    torch.manual_seed(0)
    return fbmt.compile(model, world_size=8, checks=True, **cfg).trace(*inputs)


def _products(program, phase: str) -> list[tuple[int, ...]]:
    """Shapes of the weights of the matrix products of a phase that read a gathered buffer."""
    gathered = {n for n in program.graph.nodes if n.target is comm.wait and meta.group(n) is not None}
    shapes = []
    for n in program.graph.nodes:
        if n.target is aten.mm.default and meta.phase(n) == phase and n.args[1].target is aten.t.default:
            w = n.args[1].args[0]
            view = w if w.target is aten.view.default else None
            if view is not None and view.args[0].target is aten.slice.Tensor and view.args[0].args[0] in gathered:
                shapes.append(tuple(w.meta["val"].shape))
    return shapes


@pytest.mark.parametrize("remat", ["none", "mincut", "block"])
def test_merging_gives_the_same_outputs_and_gradients_up_to_the_order_of_sums(remat):
    torch.manual_seed(0)
    model = Llama()
    (idx,), _, _ = batch("llama", 0)
    before = through(traced(model, idx), "merge", remat=remat)
    after, stats = apply(merge_products, before)
    assert 2 in stats.runs, stats  # q/k (and gate/up, three with v where they match)
    tangents = tangents_for(before)
    a, b = run(before, model, [idx], tangents), run(after, model, [idx], tangents)
    # Merged products sum in another order: an element that is a sum with cancellation (a weight
    # gradient near zero) can differ by far more than 1e-5 of itself, on a machine or thread count
    # that orders the sums otherwise, while every element stays within 1e-5 of its tensor's largest
    # (fp32 sums of a few hundred terms). A wrong merge (a slice off by a row) is off by the values.
    for kind in ("outputs", "grads"):
        assert a[kind].keys() == b[kind].keys()
        for k in a[kind]:
            x, y = a[kind][k], b[kind][k]
            scale = float(y.abs().max()) if y.numel() else 0.0
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5 * scale + 1e-7, msg=lambda m: f"{kind} {k}: {m}")


@pytest.mark.parametrize("remat", ["mincut", "block"])
def test_products_that_read_one_input_become_one_without_a_copy_or_more_memory(remat):
    (idx,), _, _ = batch("llama", 0)
    # named blocks: every layer recomputes (no trailing block saves, NOTE: [Trailing blocks])
    cfg = (
        dict(remat="mincut", zero=2)
        if remat == "mincut"
        else dict(blocks={f"layers.{i}": {"remat": "block"} for i in range(2)})
    )
    program = _trace(Llama(), idx, **cfg)
    unmerged = _trace(Llama(), idx, **cfg, disable=("merge",))
    fwd = sorted(_products(program, FWD))
    d, ff = 16, 24
    per_layer = [(d, d), (d, ff), (2 * ff, d)] + ([(3 * d, d)] if remat == "block" else [(d, d), (2 * d, d)])
    # q, k (and v where nothing saves it) in one product, gate and up in one; wo, w2 and the logits alone
    assert fwd == sorted(per_layer * 2 + [(64, d)]), fwd
    assert len(_products(unmerged, FWD)) == 7 * 2 + 1
    # the weights of a merged product are one view of the gathered buffer: no parameter is copied
    cats = [
        n
        for n in program.graph.nodes
        if n.target is aten.cat.default
        and any(
            a.target is aten.view.default
            and a.args[0].target is aten.slice.Tensor
            and a.args[0].args[0].target is comm.wait
            for a in n.args[0]
        )
    ]
    assert not cats, cats
    # the merged gradients: each weight's gradient is a row slice of one product
    assert program.stats("merge").gradients == 4, program.summary("merge")
    # under mincut v is saved for attention's backward and stays its own product: merged with q and k,
    # the saved slice would keep all three outputs alive
    assert peak_memory(program) <= peak_memory(unmerged)


class _Apart(nn.Module):
    """Two products of one input whose weights another parameter separates, and two whose outputs a
    view flattens (it needs their contiguous layout): neither pair may merge."""

    def __init__(self):
        super().__init__()
        self.a, self.between, self.b = (
            nn.Linear(8, 8, bias=False),
            nn.Linear(8, 8, bias=False),
            nn.Linear(8, 8, bias=False),
        )
        self.c, self.e = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.b(x) + self.between(x.flip(0))
        return (self.c(h).view(-1) * self.e(h).view(-1)).sum()


def test_products_apart_in_memory_or_viewed_as_contiguous_stay_apart_and_match_eager():
    x = torch.randn(4, 8)
    program = _trace(_Apart(), x, remat="none")
    assert program.stats("merge").runs == (), program.summary("merge")
    torch.manual_seed(0)
    ref = _Apart()
    model = fbmt.compile(_Apart(), remat="none", checks=True)
    model.load_state_dict(ref.state_dict())
    model(x).backward()
    ref(x).backward()
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_merged_llama_matches_eager_with_inductor_regions():
    torch.manual_seed(0)
    ref = Llama()
    model = fbmt.compile(Llama(), backend="inductor", remat="mincut", checks=True)
    model.load_state_dict(ref.state_dict())
    (idx,), _, tgt = batch("llama", 0)
    lm_step_matches(model, ref, idx, tgt)
    assert model.program.stats("merge").gradients == 4  # q/k and gate/up of both layers


def _merged_llama(rank: int, world: int) -> list[str]:
    want = eager_reference("llama")
    done = []
    for cfg in (dict(zero=3, remat="block"), dict(zero=2, remat="mincut"), dict(zero=3, remat="none", schedule="none")):
        got = train_compiled("llama", rank, world, cfg)
        compare(got, want, f"llama world={world} {cfg}", buffers=False)
        done.append(str(cfg))
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_merged_llama_matches_eager_on_ranks(world):
    """Losses, gradients and parameters after 5 SGD steps, with the products merged."""
    assert all(len(d) == 3 for d in run_ranks(world, _merged_llama))
