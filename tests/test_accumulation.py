"""Gradient accumulation loops written for DDP and FSDP run on a compiled model (NOTE: [Accumulation without
sync]): under `no_sync()`, `set_requires_gradient_sync(False)` or `require_backward_grad_sync = False` the
backward keeps each group's gradient on the rank, and the next synced backward reduces the sum once: one
reduction per group per optimizer step, and the steps equal eager accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.models.gpt import GPT, GPTConfig
from tests.dist import run_ranks

STEPS, MICRO = 2, 3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=16, n_head=2))


def _micro_batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(100 * step + k))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) / MICRO


def _accumulate(rank: int, world: int, style: str) -> dict:
    buckets = {"schedule": ("bucket", {"bucket_bytes": 1 << 20})} if style == "buckets" else {}
    model = fbmt.compile(_gpt(), cache_dir=False, **buckets)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    groups = len(model.layout.groups)
    for step in range(STEPS):
        before = model.gradient_reductions
        for k in range(MICRO):
            x, y = _micro_batch(step, k)
            x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
            last = k == MICRO - 1
            if style in ("no_sync", "buckets") and not last:
                with model.no_sync():
                    _loss(model, x, y).backward()
                assert model.require_backward_grad_sync  # restored on leaving
                continue
            if style == "set_requires_gradient_sync":
                model.set_requires_gradient_sync(last)
            elif style == "require_backward_grad_sync":
                model.require_backward_grad_sync = last
            _loss(model, x, y).backward()
        expect = groups if style != "every" else MICRO * groups
        assert model.gradient_reductions - before == expect, (style, model.gradient_reductions - before, expect)
        opt.step()
        opt.zero_grad()
    return {"params": model.full_parameters()}


@pytest.mark.parametrize(
    "style", ["no_sync", "set_requires_gradient_sync", "require_backward_grad_sync", "buckets", "every"]
)
def test_accumulation_with_sync_turned_off_equals_eager_accumulation_and_reduces_once_per_step(style):
    """ "every": the same loop with sync on throughout, which reduces every micro-batch."""
    got = run_ranks(2, _accumulate, style)
    ref = _gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        for k in range(MICRO):
            _loss(ref, *_micro_batch(step, k)).backward()
        opt.step()
        opt.zero_grad()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def _misuse(rank: int, world: int) -> None:
    model = fbmt.compile(_gpt(), cache_dir=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _micro_batch(0, rank)
    with model.no_sync():
        _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="never reduced over ranks"):
        opt.step()  # no backward with sync on ran: each rank would step on its own gradients
    # zero_grad() drops what no_sync accumulated, as DDP's does: the next synced backward reduces its own alone
    opt.zero_grad()
    x2, y2 = _micro_batch(1, rank)
    _loss(model, x2, y2).backward()
    fresh = fbmt.compile(_gpt(), cache_dir=False)
    _loss(fresh, x2, y2).backward()
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    opt.step()


def test_a_step_on_unreduced_gradients_is_refused_and_zero_grad_drops_them():
    run_ranks(2, _misuse)


def _zeroed_or_changed_while_held(rank: int, world: int) -> None:
    model = fbmt.compile(_gpt(), cache_dir=False)
    x, y = _micro_batch(0, rank)
    x2, y2 = _micro_batch(1, rank)
    with model.no_sync():
        _loss(model, x, y).backward()
    for p in model.parameters():  # zero_grad(set_to_none=False), as BMTrain's OptimManager zeroes
        p.grad.zero_()
    _loss(model, x2, y2).backward()  # DDP: the zeroed micro-batch is gone
    fresh = fbmt.compile(_gpt(), cache_dir=False)
    _loss(fresh, x2, y2).backward()
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    model.zero_grad()
    with model.no_sync():
        _loss(model, x, y).backward()
        _loss(model, x2, y2).backward()
    for p in model.parameters():
        p.grad.add_(1.0)  # a change the held part cannot follow
    with pytest.raises(RuntimeError, match="changed in place"):
        _loss(model, x2, y2).backward()


def test_gradients_zeroed_in_place_while_held_drop_them_and_other_changes_are_refused():
    """zero_grad(set_to_none=False) between micro-batches drops what no_sync held, as DDP's zero_grad drops
    the accumulated gradients; any other in-place change of a held group's gradients is refused."""
    run_ranks(2, _zeroed_or_changed_while_held)
