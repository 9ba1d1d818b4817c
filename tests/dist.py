"""Spawn N gloo ranks on CPU, run a function on each, return what each returned."""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, folder: str, fn: Callable, args: tuple, barrier: bool = True) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        FBMT_INIT_TIMEOUT="60",
    )
    # A rank left waiting in a collective (ranks that run different programs, a stalled peer) fails the
    # test in under a minute, not after the default 10; a test that waits on purpose sets its own.
    os.environ.setdefault("FBMT_TIMEOUT", "45")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import fbmt

    fbmt.init_distributed(seed=0, backend="gloo")  # CPU tests, also on a machine with GPUs
    torch.save(fn(rank, world, *args), os.path.join(folder, f"{rank}.pt"))
    # No rank tears down while a peer may still have gloo socket I/O in flight from the last
    # collective (seen once as a SIGABRT, "terminate called without an active exception").
    if barrier:  # (a test that breaks the group on purpose cannot meet in it again)
        dist.barrier()
    dist.destroy_process_group()
    # The result is on disk and the group is gone: skip interpreter finalization. Under load, gloo's
    # worker threads can still hold work objects while Python tears down, which aborts the process
    # ("terminate called without an active exception"; pytorch/pytorch#179291), seen twice here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    world: int, fn: Callable, *args: Any, env: dict[str, str] | None = None, barrier: bool = True
) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` spawned gloo ranks; raise if any rank raised.

    `env` is added to the ranks' environment (read by their C libraries at start-up). `barrier=False`:
    the ranks do not meet before they exit (for tests whose process group ends broken).
    """
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(
                _worker,
                args=(world, _free_port(), folder, fn, args, barrier),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
            return [torch.load(os.path.join(folder, f"{r}.pt"), weights_only=False) for r in range(world)]
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Said(logging.Handler):
    """fbmt's warnings, kept (caplog cannot see a spawned rank's): add to logging.getLogger("fbmt")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
