"""Mixed precision (`param_dtype`, `reduce_dtype`): fp32 shards and optimizer, bf16 gathers and
compute, gradients reduced in fp32 (or bf16), against an eager model that computes with bf16 copies
of fp32 parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call

import fbmt
from fbmt.runtime import collectives
from tests.dist import run_ranks
from tests.models.reference import gpt

BF16 = torch.bfloat16


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def eager_bf16(steps: int) -> dict:
    """The reference: fp32 parameters, each step computed with their bf16 copies."""
    torch.manual_seed(0)
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for step in range(steps):
        x, y = _data(step)
        low = {n: p.to(BF16) for n, p in model.named_parameters()}
        loss = _loss(functional_call(model, low, (x,)), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, grads=grads, params={n: p.detach().clone() for n, p in model.named_parameters()})


def train_mixed(rank: int, world: int, steps: int, reduce_dtype: torch.dtype | None, direct: bool = False) -> dict:
    torch.manual_seed(0)
    model = fbmt.compile(gpt(), param_dtype=BF16, reduce_dtype=reduce_dtype, checks=True, direct_grads=direct)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the optimizer sees fp32 shards
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for step in range(steps):
        x, y = _data(step)
        n = x.shape[0] // world
        loss = _loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        if step == 0:
            grads = model.full_gradients()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return dict(losses=losses, grads=grads, params=model.full_parameters())


def test_one_rank_equals_eager_bf16_compute_with_fp32_master():
    ref = eager_bf16(4)
    out = train_mixed(0, 1, 4, None)
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=1e-6)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(out["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    for name, p in ref["params"].items():
        torch.testing.assert_close(out["params"][name], p, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("reduce_dtype,direct", [(None, False), (BF16, False), (None, True)])
def test_two_ranks_match_eager_to_bf16_precision(reduce_dtype, direct):
    ref = eager_bf16(3)
    for out in run_ranks(2, train_mixed, 3, reduce_dtype, direct):
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=2e-3, atol=2e-3)
        for name, g in ref["grads"].items():
            scale = g.abs().max().item() + 1e-6
            err = (out["grads"][name] - g).abs().max().item() / scale
            assert err < (2e-2 if reduce_dtype is None else 4e-2), (name, err)


def test_program_gathers_bf16_and_reduces_in_the_chosen_dtype():
    model = fbmt.compile(gpt(), world_size=4, param_dtype=BF16)
    x, _ = _data(0)
    program = model.trace(x)
    gathers = [n for n in program.graph.nodes if n.target is collectives.all_gather]
    scatters = [n for n in program.graph.nodes if n.target is collectives.reduce_scatter]
    assert gathers and all(n.args[2] == BF16 for n in gathers)  # cast before the wire
    assert scatters and all(n.args[4:] == (torch.float32, torch.float32) for n in scatters)  # fp32 reduction
    waits = [n for n in program.graph.nodes if n.target is collectives.wait and n.args[0] in gathers]
    assert all(n.meta["val"].dtype == BF16 for n in waits)
    low = fbmt.compile(gpt(), world_size=4, param_dtype=BF16, reduce_dtype=BF16).trace(x)
    assert all(n.args[4:] == (BF16, torch.float32) for n in low.graph.nodes if n.target is collectives.reduce_scatter)
    with pytest.raises(ValueError, match="param_dtype"):
        fbmt.compile(gpt(), param_dtype=torch.int8)
