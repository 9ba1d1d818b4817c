"""Gradient clipping as scripts call it, `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`
(here imported before fbmt, as scripts often do), clips by the norm over every rank's shards: the
norm and the parameters after clipped steps are eager PyTorch's; so does `torch.nn.utils.get_total_norm`
with `clip_grads_with_norm_`."""

from __future__ import annotations

import copy

import torch
from torch.nn.utils import clip_grad_norm_

import fbmt
from tests.dist import run_ranks
from tests.models.reference import batch, gpt, loss_of


def _clipped(rank: int, world: int, norm_type: float, twin: bool = False, recipe: str = "clip_grad_norm_") -> None:
    torch.manual_seed(0)
    ref = gpt()
    model = fbmt.compile(copy.deepcopy(ref))
    if twin:  # a deep copy of the compiled model (an EMA twin) clips as the original does
        model = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for step in range(3):
        (idx,), _, tgt = batch("gpt", step)
        n = idx.shape[0] // world
        loss_of("gpt", ref(idx), tgt).backward()
        loss_of("gpt", model(idx[rank * n : (rank + 1) * n]), tgt[rank * n : (rank + 1) * n]).backward()
        if recipe == "clip_grad_norm_":
            norms = [clip_grad_norm_(m.parameters(), 0.05, norm_type=norm_type) for m in (ref, model)]
        else:  # the public norm, then clipping by it (torchtitan's recipe; a loop that logs the norm)
            norms = [torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], norm_type) for m in (ref, model)]
            for m, norm in zip((ref, model), norms):
                torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.05, norm)
        torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=1e-7, msg=f"rank {rank} step {step}")
        assert norms[0] > 0.05  # the clip acts
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = model.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_clip_grad_norm_uses_the_norm_over_every_ranks_shards():
    run_ranks(2, _clipped, 2.0)


def test_clip_grad_norm_of_the_largest_gradient_too():
    run_ranks(2, _clipped, float("inf"))


def test_a_deep_copy_of_a_compiled_model_clips_by_the_norm_over_every_rank_too():
    run_ranks(2, _clipped, 2.0, True)


def test_the_public_total_norm_is_the_norm_over_every_ranks_shards():
    run_ranks(2, _clipped, 2.0, False, "get_total_norm")
