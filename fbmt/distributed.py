"""Process-group setup: torchrun's environment in, gloo on CPU / NCCL on CUDA, identical seeds."""

from __future__ import annotations

import datetime
import os
import random

import torch
import torch.distributed as dist

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(seed: int = 0, backend: str | None = None, *, timeout: float | None = None) -> None:
    """Join the job described by torchrun's environment (or run alone as rank 0 of 1).

    `backend` defaults to "nccl" when CUDA is available, else "gloo". Every rank seeds torch, random
    and numpy with `seed`, so modules built after this call have the same weights everywhere.
    `timeout` (seconds; default $FBMT_INIT_TIMEOUT or 300) bounds the wait for the other ranks: a
    rank that cannot reach them fails with a message naming the address, instead of hanging.
    """
    if dist.is_initialized():
        return
    env = os.environ
    launched = "RANK" in env and "WORLD_SIZE" in env
    rank, world = (int(env["RANK"]), int(env["WORLD_SIZE"])) if launched else (0, 1)
    local_rank = int(env.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    wait = float(timeout if timeout is not None else env.get("FBMT_INIT_TIMEOUT", 300))
    try:
        if launched:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in env]
            if missing:
                raise ValueError(f"fbmt.init_distributed: RANK and WORLD_SIZE are set but {missing} are not; "
                                 "launch with torchrun, or set them")
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=wait))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    except RuntimeError as e:  # DistStoreError (a timeout) and connection errors are RuntimeErrors
        where = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
        raise RuntimeError(
            f"fbmt.init_distributed: rank {rank} of {world} could not join the job at {where} within "
            f"{wait:.0f}s ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check that all "
            f"{world} ranks were started, that MASTER_ADDR/MASTER_PORT agree and are reachable, or raise "
            "FBMT_INIT_TIMEOUT.") from e
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
