"""Gradient accumulation loops written for DDP and FSDP run on a compiled model: `no_sync()`,
`set_requires_gradient_sync(False)` and `require_backward_grad_sync = False` are accepted (said once:
fbmt still reduces each micro-batch) and the accumulated steps equal eager accumulation."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.models.gpt import GPT, GPTConfig
from tests.dist import Said, run_ranks

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
    logging.getLogger("fbmt").addHandler(said := Said())
    model = fbmt.compile(_gpt(), cache_dir=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for k in range(MICRO):
            x, y = _micro_batch(step, k)
            x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
            last = k == MICRO - 1
            if style == "no_sync" and not last:
                with model.no_sync():
                    _loss(model, x, y).backward()
                assert model.require_backward_grad_sync  # restored on leaving
                continue
            if style == "set_requires_gradient_sync":
                model.set_requires_gradient_sync(last)
            elif style == "require_backward_grad_sync":
                model.require_backward_grad_sync = last
            _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": model.full_parameters(), "said": said.messages}


@pytest.mark.parametrize("style", ["no_sync", "set_requires_gradient_sync", "require_backward_grad_sync"])
def test_accumulation_with_sync_turned_off_equals_eager_accumulation_and_is_said_once(style):
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
    warned = [m for m in got[0]["said"] if "gradient sync turned off" in m]
    assert len(warned) == 1, got[0]["said"]
