"""The job this process is part of: the process group (torchrun's environment in, gloo on CPU / NCCL
on CUDA, identical seeds), its shape (`rank`, `world_size`, `local_device`), the job's store, and the
host agreement that names a stalled rank (`agree`).

This module sits below the compiler: everything in fbmt may import it, and it imports no other part
of fbmt but `flags`. BMTrain's `bmt.distributed` (its `config`, differentiable collectives,
`sum_loss`, ...) is `fbmt/integrations/bmt/distributed.py`, which `fbmt.distributed` names.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import random
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree

from fbmt import flags

log = logging.getLogger("fbmt")

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_distributed(
    init_method: str = "env://",
    seed: int = 0,
    *,
    backend: str | None = None,
    timeout: float | None = None,
    collective_timeout: float | None = None,
) -> None:
    """Join the job described by torchrun's environment (or run alone as rank 0 of 1).

    `init_method` may also be a "tcp://host:port" URL (RANK/WORLD_SIZE still
    come from the environment). `backend` defaults to "nccl" when CUDA is available, else "gloo".
    Every rank seeds torch, random and numpy with `seed`, so modules built after this call have the
    same weights everywhere. `timeout` (seconds; default $FBMT_INIT_TIMEOUT or 300) bounds the wait
    for the other ranks at start-up: a rank that cannot reach them fails with a message naming the
    address, instead of hanging. `collective_timeout` (default $FBMT_TIMEOUT or 600) bounds each
    wait in a collective afterwards. (`fbmt.init_distributed` is BMTrain's, which calls this.)
    """
    if not isinstance(init_method, str):
        raise TypeError(
            f"fbmt.init_distributed(init_method={init_method!r}): expected a URL such as 'env://'; "
            "pass the seed by keyword: init_distributed(seed=...)"
        )
    if dist.is_initialized():
        return
    launched = flags.is_set(flags.RANK) and flags.is_set(flags.WORLD_SIZE)
    rank, world = (flags.RANK.get(), flags.WORLD_SIZE.get()) if launched else (0, 1)
    local_rank = flags.LOCAL_RANK.get()
    local_rank = local_rank if local_rank is not None else rank % max(torch.cuda.device_count(), 1)
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
            missing = [f.name for f in (flags.MASTER_ADDR, flags.MASTER_PORT) if not flags.is_set(f)]
            if missing:
                raise ValueError(
                    f"fbmt.init_distributed: RANK and WORLD_SIZE are set but {missing} are not; "
                    "launch with torchrun, or set them"
                )
            limit = datetime.timedelta(seconds=wait)
            if init_method == "env://":  # the store with the start-up timeout, the group with the running one
                _agreement["store"] = store = _job_store(rank, world, limit)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=running)
            else:
                dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=limit)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    except RuntimeError as e:  # DistStoreError (a timeout) and connection errors are RuntimeErrors
        where = f"{flags.MASTER_ADDR.get()}:{flags.MASTER_PORT.get()}"
        raise RuntimeError(
            f"fbmt.init_distributed: rank {rank} of {world} could not join the job at {where}: it gave up "
            f"after {time.monotonic() - began:.0f}s (timeout {wait:.0f}s; the store retries a connection once) "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check that all "
            f"{world} ranks were started, that MASTER_ADDR/MASTER_PORT agree and are reachable, or raise "
            "FBMT_INIT_TIMEOUT."
        ) from e
    if backend == "gloo" and not _exit_handler:
        _exit_handler.append(atexit.register(_destroy_gloo_group))
    seed_everything(seed)


_exit_handler: list = []


def _destroy_gloo_group() -> None:
    """At exit, while the interpreter still runs: a gloo group left to the interpreter's teardown can
    abort the process after a finished run ("terminate called without an active exception": gloo's
    threads release tensors that need the GIL; pytorch/pytorch#190489). Python has joined the threads of
    background saves before atexit handlers run, so no collective is under way."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # exiting anyway: say it, never mask the run's own exit status
            log.warning("fbmt: destroying the process group at exit failed: %s", e)
    _agreement.update(store=None, group=None)  # the job's store too (a client with a thread of its own)


def _job_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The job's key-value store at MASTER_ADDR:MASTER_PORT; under torchrun, with this attempt's keys
    apart from earlier attempts'.

    Under `torchrun --max-restarts`, the restarted ranks meet in the same store as the attempt before;
    without a prefix a new rank can read a dead rank's gloo address before its successor overwrites
    it, and fails to connect ("Gloo connectFullMesh failed ... Connection refused")."""
    agent = flags.AGENT_STORE.get() == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(
        flags.MASTER_ADDR.get(),
        flags.MASTER_PORT.get(),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
        multi_tenant=not agent,
    )
    return dist.PrefixStore(f"fbmt/attempt_{flags.RESTART_COUNT.get()}", store)


# The per-call agreement check: a gloo group on the host (no GPU sync), the store, the call count.
_agreement: dict[str, Any] = {"group": None, "store": None, "calls": 0}


def agree(value: int, what: str) -> list[int]:
    """Every rank's `value` (a host collective, bounded by $FBMT_TIMEOUT; call it on every rank).

    A rank that does not arrive in time is named: each rank notes its count of calls in the job's
    store first, so the ones that waited can say who is behind and by how much. A rank kept waiting
    $FBMT_STALL_WARNING seconds (30) says so at once, naming who it waits for, and waits on: a rank
    may be busy on purpose (evaluating alone), and the job fails only after $FBMT_TIMEOUT (600)."""
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
    calls = st["calls"]
    warn = threading.Timer(flags.STALL_WARNING.get(), _say_who_is_late, args=(store, world, calls, what))
    warn.daemon = True
    warn.start()
    try:
        dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=st["group"])
    except RuntimeError as e:
        behind = f"; behind: {_late(store, world, calls) or 'none (one went elsewhere)'}" if store is not None else ""
        raise RuntimeError(
            f"fbmt: rank {me} waited {flags.TIMEOUT.get():.0f}s at {what} (call {st['calls']}) for the other "
            f"ranks{behind}. A rank stalled, died, or is in another collective: a call made on some ranks "
            "only (state_dict(), evaluation or sampling on one rank) hangs the others. Raise FBMT_TIMEOUT "
            f"if a step can take longer ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e
    finally:
        warn.cancel()
    return [int(t.item()) for t in out]


def _late(store: Any, world: int, calls: int) -> str:
    """The ranks whose call count in the job's store is below `calls`, with their counts."""
    counts = {r: int(store.get(f"fbmt/calls/{r}")) if store.check([f"fbmt/calls/{r}"]) else 0 for r in range(world)}
    return ", ".join(f"rank {r} (at call {c})" for r, c in counts.items() if c < calls)


def _say_who_is_late(store: Any, world: int, calls: int, what: str) -> None:
    """On a timer thread, while this rank still waits at `what`: name the ranks that have not come."""
    try:
        late = _late(store, world, calls) if store is not None else ""
    except Exception:  # the store is the job's: never let a warning break it
        late = ""
    log.warning(
        "fbmt: rank %d has waited %.0fs at %s (call %d) for %s; a rank is stalled, or in another collective "
        "(a call of the model, state_dict() or evaluation on some ranks only). Waiting on: the job fails after "
        "FBMT_TIMEOUT=%.0fs",
        dist.get_rank(),
        flags.STALL_WARNING.get(),
        what,
        calls,
        late or "the other ranks",
        flags.TIMEOUT.get(),
    )


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), over `agree`'s host group: for the detail of a disagreement
    every rank has already seen (call it on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_agreement["group"])
    return out


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
    return flags.WORLD_SIZE.get() or 1


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
    return flags.LOCAL_WORLD_SIZE.get() or world


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
