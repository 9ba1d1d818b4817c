"""Functions that run on every spawned rank (module level, so spawn can pickle them)."""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist

import fbmt
from tests.models.reference import BUILDERS, batch, loss_of

CONFIGS = [dict(zero=z, remat=r, schedule=s)
           for z, r, s in itertools.product((3, 2), ("block", "none"), ("prefetch", "none"))]
STEPS = 5


def _local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def eager_reference(name: str, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = BUILDERS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], None
    for step in range(steps):
        args, kwargs, target = batch(name, step)
        loss = loss_of(name, model(*args, **kwargs), target)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, grads=grads, params={n: p.detach().clone() for n, p in model.named_parameters()},
                buffers={n: b.clone() for n, b in model.named_buffers()})


def train_compiled(name: str, rank: int, world: int, cfg: dict, steps: int = STEPS, accum: int = 1) -> dict:
    torch.manual_seed(0)
    model = fbmt.compile(BUILDERS[name](), checks=True, **cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], None
    for step in range(steps):
        args, kwargs, target = batch(name, step)
        args, target = tuple(_local(a, rank, world) for a in args), _local(target, rank, world)
        total = torch.zeros(())
        for micro in range(accum):  # gradient accumulation over micro-batches of the local batch
            a, t = tuple(_local(x, micro, accum) for x in args), _local(target, micro, accum)
            loss = loss_of(name, model(*a, **kwargs), t) / accum
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        if step == 0:
            grads = model.full_gradients()
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / world)
    return dict(losses=losses, grads=grads, params=model.full_parameters(),
                buffers={n: b.clone() for n, b in model.named_buffers()}, programs=len(model.programs))


def compare(got: dict, want: dict, what: str, buffers: bool, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: losses differ\n{m}")
    for kind in ("grads", "params") + (("buffers",) if buffers else ()):
        assert got[kind].keys() == want[kind].keys(), f"{what}: {kind} names differ"
        for n in want[kind]:
            torch.testing.assert_close(got[kind][n], want[kind][n], rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what}: {kind[:-1]} {n} differs\n{m}")


def equivalence(rank: int, world: int, name: str) -> list[str]:
    want = eager_reference(name)
    done = []
    for cfg in CONFIGS:
        what = f"{name} world={world} {cfg}"
        compare(train_compiled(name, rank, world, cfg), want, what, buffers=world == 1)
        done.append(what)
    if name == "gpt":
        cfg = dict(zero=3, remat="block", schedule="prefetch")
        what = f"{name} world={world} {cfg} accumulating 2 micro-batches"
        compare(train_compiled(name, rank, world, cfg, accum=2), want, what, buffers=False)
        done.append(what)
    return done
