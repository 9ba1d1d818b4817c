"""BMTrain's `bmt.distributed` (`fbmt.distributed`): `init_distributed` with BMTrain's signature, the job's
`config`, and differentiable collectives over the default group (`all_reduce`, `all_gather`,
`reduce_scatter`, `broadcast`, `sum_loss`, `gather_result`, `synchronize`, `print_rank`).

The job itself (the process group, its store, ranks and devices) is `fbmt.job`, below the compiler;
this module adds BMTrain's names on top of it and re-exports the job's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fbmt import flags, job
from fbmt.job import (
    all_gather_into,
    compute_device,
    gather_flat,
    is_initialized,
    local_device,
    local_part,
    rank,
    reduce_scatter_into,
    seed_everything,
    world_size,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "compute_device",
    "config",
    "gather_flat",
    "gather_result",
    "init_distributed",
    "is_initialized",
    "local_device",
    "local_part",
    "print_rank",
    "rank",
    "reduce_scatter",
    "seed_everything",
    "sum_loss",
    "synchronize",
    "world_size",
]

# What the job looks like, as BMTrain's `bmtrain.global_var.config` has it; filled by init_distributed.
# Tensor and pipeline parallelism are not supported, so `tp_size` and `pipe_size` are 1 and every
# parameter is sharded over all ranks (`zero_size == world_size`).
config: dict[str, Any] = dict(
    rank=0,
    local_rank=0,
    world_size=1,
    local_size=1,
    zero_size=1,
    zero_rank=0,
    tp_size=1,
    tp_rank=0,
    tp_zero_size=1,
    tp_zero_rank=0,
    pipe_size=1,
    pipe_rank=0,
    device="cpu",
    initialized=False,
)


def init_distributed(
    init_method: str = "env://",
    seed: int = 0,
    pipe_size: int = -1,
    num_micro_batches: int | None = None,
    tp_size: int = 1,
    *,
    backend: str | None = None,
    timeout: float | None = None,
    collective_timeout: float | None = None,
) -> None:
    """Join the job described by torchrun's environment (or run alone as rank 0 of 1): BMTrain's
    signature over `fbmt.job.init_distributed` (see it for `init_method`, `seed`, `backend` and the
    timeouts). `fbmt.config` describes the job afterwards."""
    if tp_size != 1 or pipe_size > 1:
        raise NotImplementedError(
            f"fbmt.init_distributed(tp_size={tp_size}, pipe_size={pipe_size}): tensor and "
            "pipeline parallelism are not supported yet; fbmt shards every parameter over all "
            "ranks (ZeRO-3), so use tp_size=1 and pipe_size=-1 or 1"
        )
    job.init_distributed(init_method, seed, backend=backend, timeout=timeout, collective_timeout=collective_timeout)
    _fill_config()


def _fill_config() -> None:
    r, w = rank(), world_size()
    local = flags.LOCAL_RANK.get() or 0
    config.update(
        rank=r,
        local_rank=local,
        world_size=w,
        local_size=flags.LOCAL_WORLD_SIZE.get() or w,
        zero_size=w,
        zero_rank=r,
        tp_size=1,
        tp_rank=0,
        tp_zero_size=w,
        tp_zero_rank=r,
        pipe_size=1,
        pipe_rank=0,
        device=str(local_device()),
        initialized=True,
    )


# ---- collectives over the default group, differentiable (BMTrain's `bmt.distributed`) ----

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def _op(op: str) -> str:
    if op not in _OPS:
        raise ValueError(f"fbmt.distributed: op={op!r}; expected one of {list(_OPS)}")
    return op


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, op: str) -> torch.Tensor:
        y = x.detach().clone()
        dist.all_reduce(y, op=_OPS[op])  # gloo has no AVG: sum, then divide
        if op == "avg":
            y /= world_size()
        ctx.op = op
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y = ctx.saved_tensors
        g = grad.contiguous().clone()
        dist.all_reduce(g)  # every rank's loss depends on the reduced value
        if ctx.op == "avg":
            g /= world_size()
        elif ctx.op in ("max", "min"):
            g = g * (x == y)
        elif ctx.op == "prod":  # the product of the other ranks' values (y / x fails where x is 0)
            others = all_gather(x.detach())
            g = g * torch.cat([others[: rank()], others[rank() + 1 :]]).prod(0)
        return g, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(world_size() * x.numel(), dtype=x.dtype, device=x.device)  # collectives take flat buffers
        all_gather_into(out, x.contiguous().view(-1))
        return out.view(world_size(), *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = torch.empty(grad[0].numel(), dtype=grad.dtype, device=grad.device)
        reduce_scatter_into(g, grad.contiguous().view(-1))
        return g.view(grad.shape[1:])


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, op: str) -> torch.Tensor:
        if x.shape[0] % world_size():
            raise ValueError(
                f"fbmt.distributed.reduce_scatter: dim 0 ({x.shape[0]}) must divide by the world size ({world_size()})"
            )
        if op not in ("sum", "avg"):
            raise ValueError(f"fbmt.distributed.reduce_scatter: op={op!r}; expected 'sum' or 'avg'")
        shape = (x.shape[0] // world_size(), *x.shape[1:])
        out = torch.empty(x.numel() // world_size(), dtype=x.dtype, device=x.device)
        reduce_scatter_into(out, x.contiguous().view(-1))
        out = out.view(shape)
        if op == "avg":
            out /= world_size()
        ctx.op = op
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = torch.empty(grad.numel() * world_size(), dtype=grad.dtype, device=grad.device)
        all_gather_into(g, grad.contiguous().view(-1))
        g = g.view(grad.shape[0] * world_size(), *grad.shape[1:])
        return (g / world_size() if ctx.op == "avg" else g), None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, src: int) -> torch.Tensor:
        y = x.detach().clone().contiguous()
        dist.broadcast(y, src)
        ctx.src = src
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous().clone()
        dist.reduce(g, ctx.src)  # the source's value reached every rank: its gradient is their sum
        return (g if rank() == ctx.src else torch.zeros_like(g)), None


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `x` over ranks ("sum", "avg", "max", "min", "prod"); differentiable."""
    return _AllReduce.apply(x, _op(op))


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x`, stacked: shape (world_size, *x.shape); differentiable."""
    return _AllGather.apply(x)


def reduce_scatter(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `x` (dim 0 = world_size * k) over ranks; this rank keeps rows [rank * k, (rank + 1) * k)."""
    return _ReduceScatter.apply(x, op)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """`x` of rank `src` on every rank; differentiable (the gradient flows back to `src`)."""
    return _Broadcast.apply(x, src)


def sum_loss(loss: torch.Tensor) -> torch.Tensor:
    """The mean of `loss` over ranks (BMTrain's name; an alias of `all_reduce(loss, "avg")`)."""
    return all_reduce(loss, "avg")


def gather_result(result: torch.Tensor) -> torch.Tensor:
    """Every rank's `result` concatenated along dim 0 (for evaluation; no gradient)."""
    with torch.no_grad():
        return all_gather(result).flatten(0, 1)


def synchronize() -> None:
    """Wait until every rank gets here."""
    if dist.is_initialized():
        dist.barrier()


def print_rank(*args, rank: int = 0, **kwargs) -> None:
    """`print` on one rank only (default rank 0)."""
    if (dist.get_rank() if dist.is_initialized() else 0) == rank:
        print(*args, **kwargs)
