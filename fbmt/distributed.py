"""Process-group setup (torchrun's environment in, gloo on CPU / NCCL on CUDA, identical seeds), the
job's shape (`rank`, `world_size`, `local_device`), and BMTrain's differentiable collectives over the
default group (`all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `sum_loss`,
`gather_result`, `synchronize`, `print_rank`).

This module sits below the compiler: everything in fbmt may import it, and it imports no other part
of fbmt but `flags`.
"""

from __future__ import annotations

import datetime
import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree

from fbmt import flags

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

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    """Join the job described by torchrun's environment (or run alone as rank 0 of 1).

    BMTrain's signature; `init_method` may also be a "tcp://host:port" URL (RANK/WORLD_SIZE still
    come from the environment). `backend` defaults to "nccl" when CUDA is available, else "gloo".
    Every rank seeds torch, random and numpy with `seed`, so modules built after this call have the
    same weights everywhere. `timeout` (seconds; default $FBMT_INIT_TIMEOUT or 300) bounds the wait
    for the other ranks at start-up: a rank that cannot reach them fails with a message naming the
    address, instead of hanging. `collective_timeout` (default $FBMT_TIMEOUT or 600) bounds each
    wait in a collective afterwards. `fbmt.config` describes the job afterwards.
    """
    if not isinstance(init_method, str):
        raise TypeError(
            f"fbmt.init_distributed(init_method={init_method!r}): expected a URL such as 'env://'; "
            "pass the seed by keyword: init_distributed(seed=...)"
        )
    if tp_size != 1 or pipe_size > 1:
        raise NotImplementedError(
            f"fbmt.init_distributed(tp_size={tp_size}, pipe_size={pipe_size}): tensor and "
            "pipeline parallelism are not supported yet; fbmt shards every parameter over all "
            "ranks (ZeRO-3), so use tp_size=1 and pipe_size=-1 or 1"
        )
    if dist.is_initialized():
        _fill_config()
        return
    env = os.environ
    launched = "RANK" in env and "WORLD_SIZE" in env
    rank, world = (int(env["RANK"]), int(env["WORLD_SIZE"])) if launched else (0, 1)
    local_rank = int(env.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:
            raise ValueError(
                f"fbmt.init_distributed: rank {rank} has LOCAL_RANK={local_rank}, but this machine has "
                f"{gpus} CUDA device(s) for NCCL; start at most {gpus} rank(s) per machine "
                "(torchrun --nproc_per_node), or pass backend='gloo' to run on the CPU"
            )
        torch.cuda.set_device(local_rank)
    wait = float(timeout if timeout is not None else flags.INIT_TIMEOUT.get())
    running = datetime.timedelta(seconds=float(collective_timeout or flags.TIMEOUT.get()))
    began = time.monotonic()
    try:
        if launched:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in env]
            if missing:
                raise ValueError(
                    f"fbmt.init_distributed: RANK and WORLD_SIZE are set but {missing} are not; "
                    "launch with torchrun, or set them"
                )
            limit = datetime.timedelta(seconds=wait)
            if init_method == "env://":  # the store with the start-up timeout, the group with the running one
                _agreement["store"] = store = _job_store(env, rank, world, limit)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=running)
            else:
                dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=limit)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    except RuntimeError as e:  # DistStoreError (a timeout) and connection errors are RuntimeErrors
        where = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
        raise RuntimeError(
            f"fbmt.init_distributed: rank {rank} of {world} could not join the job at {where}: it gave up "
            f"after {time.monotonic() - began:.0f}s (timeout {wait:.0f}s; the store retries a connection once) "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check that all "
            f"{world} ranks were started, that MASTER_ADDR/MASTER_PORT agree and are reachable, or raise "
            "FBMT_INIT_TIMEOUT."
        ) from e
    _fill_config()
    seed_everything(seed)


def _job_store(env: Any, rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The job's key-value store at MASTER_ADDR:MASTER_PORT; under torchrun, with this attempt's keys
    apart from earlier attempts'.

    Under `torchrun --max-restarts`, the restarted ranks meet in the same store as the attempt before;
    without a prefix a new rank can read a dead rank's gloo address before its successor overwrites
    it, and fails to connect ("Gloo connectFullMesh failed ... Connection refused")."""
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
        multi_tenant=not agent,
    )
    return dist.PrefixStore(f"fbmt/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)


# The per-call agreement check: a gloo group on the host (no GPU sync), the store, the call count.
_agreement: dict[str, Any] = {"group": None, "store": None, "calls": 0}


def agree(value: int, what: str) -> list[int]:
    """Every rank's `value` (a host collective, bounded by $FBMT_TIMEOUT; call it on every rank).

    A rank that does not arrive in time is named: each rank notes its count of calls in the job's
    store first, so the ones that waited can say who is behind and by how much."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    st = _agreement
    if st["group"] is None:
        st["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=flags.TIMEOUT.get()))
    st["calls"] += 1
    me, world, store = dist.get_rank(), dist.get_world_size(), st["store"]
    if store is not None:
        store.set(f"fbmt/calls/{me}", str(st["calls"]))
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    try:
        dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=st["group"])
    except RuntimeError as e:
        behind = ""
        if store is not None:
            counts = {
                r: int(store.get(f"fbmt/calls/{r}")) if store.check([f"fbmt/calls/{r}"]) else 0 for r in range(world)
            }
            late = [f"rank {r} (at call {c})" for r, c in counts.items() if c < st["calls"]]
            behind = f"; behind: {', '.join(late) or 'none (one went elsewhere)'}"
        raise RuntimeError(
            f"fbmt: rank {me} waited {flags.TIMEOUT.get():.0f}s at {what} (call {st['calls']}) for the other "
            f"ranks{behind}. A rank stalled, died, or is in another collective: a call made on some ranks "
            "only (state_dict(), evaluation or sampling on one rank) hangs the others. Raise FBMT_TIMEOUT "
            f"if a step can take longer ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e
    return [int(t.item()) for t in out]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), over `agree`'s host group: for the detail of a disagreement
    every rank has already seen (call it on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_agreement["group"])
    return out


def _fill_config() -> None:
    r, w = rank(), world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    config.update(
        rank=r,
        local_rank=local,
        world_size=w,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", w)),
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def rank() -> int:
    """This process's rank in the job (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks in the job (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_initialized() -> bool:
    """Has this process joined a job (`init_distributed`, or torch.distributed directly)."""
    return dist.is_initialized()


def launched_world_size() -> int:
    """The number of ranks the launcher started (torchrun's WORLD_SIZE), joined or not."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def local_device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_device(device: torch.device | str | None = None) -> torch.device:
    """The given device, else this rank's; "cuda" means the current CUDA device (cuda:N)."""
    device = torch.device(device) if device is not None else local_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def ranks_per_node(world: int | None = None) -> int:
    """How many ranks of the job share this rank's machine: torchrun's LOCAL_WORLD_SIZE, else the
    whole job (`world`, default the process group's size)."""
    world = world or world_size()
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def local_part(batch: Any, dim: int = 0) -> Any:
    """This rank's part of a global batch: every tensor in `batch` (a tensor, or tuples, lists and
    dicts of them) cut into `world_size()` equal parts along `dim`, part `rank()` kept. Every rank
    draws the same global batch (same seed) and trains on its own part, so together they train on the
    whole of it, as one process would."""
    world, me = world_size(), rank()

    def cut(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[dim]
        if n % world:
            raise ValueError(
                f"fbmt.local_part: a global batch of {n} (dim {dim} of a tensor of shape {tuple(t.shape)}) does "
                f"not split into {world} equal parts; use a global batch size that {world} divides"
            )
        return t.narrow(dim, me * (n // world), n // world)

    return torch.utils._pytree.tree_map_only(torch.Tensor, cut, batch)


def gather_flat(t: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `t` (all of one size), concatenated in rank order (a blocking collective)."""
    if world_size() == 1:
        return t
    out = torch.empty(t.numel() * world_size(), dtype=t.dtype, device=t.device)
    all_gather_into(out, t.contiguous())
    return out


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
