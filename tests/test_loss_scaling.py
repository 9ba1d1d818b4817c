"""Mixed precision as torch documents it, with `torch.amp.GradScaler`, around a compiled model on 2 gloo
ranks: an overflow in one rank's shard skips the step on every rank and halves every rank's scale, so the
parameters after the steps and the scale are eager PyTorch's (NOTE: [Overflow found on any rank])."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fbmt
from tests.dist import run_ranks


class TwoHeads(nn.Module):
    """`big` scales the first head's gradients alone: its parameters lie in rank 0's shard, the second's
    in rank 1's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * big).square().mean() + self.b(x).square().mean()


def _scaled_steps(rank: int, world: int, recipe: str) -> None:
    torch.manual_seed(0)
    ref = TwoHeads()
    model = fbmt.compile(copy.deepcopy(ref))
    scales = []
    for m in (ref, model):
        if recipe == "fused adamw":  # the scaler hands the optimizer its scale and what it found
            opt = torch.optim.AdamW(m.parameters(), lr=0.01, fused=True)
        else:
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        g = torch.Generator().manual_seed(0)
        for step in range(4):
            x = torch.randn(4, 16, generator=g)
            big = torch.tensor(1e30 if step == 1 else 1.0)  # step 1 overflows the first head's gradients
            scaler.scale(m(x, big)).backward()
            if recipe == "unscale and clip":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scales.append(scaler.get_scale())
    assert scales == [2.0**9, 2.0**9], (rank, scales)  # the overflow was found, and found on this rank too
    full = model.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("recipe", ["step", "unscale and clip", "fused adamw"])
def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(recipe):
    run_ranks(2, _scaled_steps, recipe)
