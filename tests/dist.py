"""N gloo ranks on CPU: run a function on each, return what each returned.

The ranks of a world size are kept between calls (NOTE: [Ranks kept between tests]); a call that sets
the ranks' environment, or whose group ends broken, spawns ranks of its own.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int) -> None:
    """This process joins the group as rank `rank` of `world`, meeting at `port`."""
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
    import fbmt

    fbmt.init_distributed(seed=0, backend="gloo")  # CPU tests, also on a machine with GPUs


def _worker(rank: int, world: int, port: int, folder: str, fn: Callable, args: tuple, barrier: bool = True) -> None:
    import torch.distributed as dist

    _join(rank, world, port)
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
    """Run `fn(rank, world, *args)` on `world` gloo ranks; raise if any rank raised.

    `env` is added to the ranks' environment (read by their C libraries at start-up). `barrier=False`:
    the ranks do not meet before they exit (for tests whose process group ends broken). Either spawns
    ranks for this call alone; otherwise the ranks of this world size are reused (`_Ranks`).
    """
    if env is None and barrier and os.environ.get("FBMT_TEST_FRESH_RANKS") != "1":
        return _kept(world).run(fn, args)
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


# NOTE: [Ranks kept between tests]
# Spawning ranks costs ~5 s a call on the 2-core CI machine (two interpreters importing torch and fbmt,
# then meeting), more than most multi-rank tests take to run, and the suite makes hundreds of calls. So
# the ranks of one world size stay up between calls, each taking the next function from a pipe. A call
# starts them as a fresh spawn would: seeded as `init_distributed(seed=0)` seeds, grad mode on, and
# afterwards their environment and logging are put back as they were. Ranks are started again when the
# test process's environment differs from the one they were started in (a test that sets a variable
# before spawning ranks gets ranks that read it at start-up), when another world size is asked for,
# and after any call that failed (a rank that raised may leave its peers inside a collective).
# FBMT_TEST_FRESH_RANKS=1 spawns ranks for every call, as this file did before.
_VOLATILE = {"PYTEST_CURRENT_TEST"}  # what pytest changes in the environment at every test


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE}


class _Ranks:
    """`world` rank processes in one process group, serving calls (`_serve`) until closed."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.env = world, _environment()
        self.folder = tempfile.mkdtemp(prefix="fbmt-ranks-")
        self.calls = 0
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, port, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple) -> list[Any]:
        self.calls += 1
        folder = os.path.join(self.folder, str(self.calls))
        os.makedirs(folder)
        job = os.path.join(folder, "job.pt")
        torch.save((fn, args), job)
        try:
            replies = self._replies(job)
        except BaseException:  # a test's timeout, Ctrl-C: the ranks may still be in the call
            self.close(at_once=True)
            raise
        errors = {r: reply[1] for r, reply in sorted(replies.items()) if reply[0] != "ok"}
        if errors or len(replies) < self.world:
            self.close(at_once=True)
            said = "\n".join(f"-- rank {r} raised:\n{tb}" for r, tb in errors.items())
            stuck = [r for r in range(self.world) if r not in replies]
            raise RuntimeError(f"{said}\n(ranks {stuck} did not finish; stopped)" if stuck else said)
        results = [torch.load(replies[r][1], weights_only=False) for r in range(self.world)]
        shutil.rmtree(folder, ignore_errors=True)
        return results

    def _replies(self, job: str) -> dict[int, tuple]:
        """Each rank's reply to `job`: ("ok", the file of its result) or ("error", what it raised)."""
        for conn in self.conns:
            conn.send(job)
        replies: dict[int, tuple] = {}
        failed_at = None
        while len(replies) < self.world:
            waiting = [r for r in range(self.world) if r not in replies]
            # after a rank failed, its peers have a few seconds to say what they saw, then are stopped
            limit = None if failed_at is None else max(0.0, failed_at + 5 - time.monotonic())
            ready = multiprocessing.connection.wait(
                [self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], timeout=limit
            )
            if not ready:
                break
            for r in waiting:
                if self.conns[r] in ready:
                    try:
                        replies[r] = self.conns[r].recv()
                    except EOFError:
                        replies[r] = ("error", f"rank {r} exited (code {self.procs[r].exitcode})")
                elif self.procs[r].sentinel in ready:
                    replies[r] = ("error", f"rank {r} exited (code {self.procs[r].exitcode})")
                if r in replies and replies[r][0] != "ok" and failed_at is None:
                    failed_at = time.monotonic()
        return replies

    def close(self, at_once: bool = False) -> None:
        """Stop the ranks: told to, or `at_once` (after a failure, one may wait in a collective)."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=0 if at_once else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.folder, ignore_errors=True)


_ranks: list[_Ranks] = []


def _kept(world: int) -> _Ranks:
    """The ranks of `world` kept up, started (again) where they are not fit for this call."""
    if _ranks and (_ranks[0].world != world or _ranks[0].env != _environment() or not _ranks[0].alive()):
        _ranks.pop().close()
    if not _ranks:
        _ranks.append(_Ranks(world))
    return _ranks[0]


@atexit.register
def _close_kept() -> None:
    while _ranks:
        _ranks.pop().close()


def _serve(rank: int, world: int, port: int, conn: Any) -> None:
    """A kept rank: joins the group as `_worker` does, then runs each call sent until told to stop."""
    import torch.distributed as dist

    from fbmt.job import seed_everything

    _join(rank, world, port)
    loggers = [logging.getLogger(), logging.getLogger("fbmt")]
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        env = dict(os.environ)
        kept = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
        try:
            fn, args = torch.load(job, weights_only=False)
            seed_everything(0)  # as the group's start left a fresh rank
            torch.set_grad_enabled(True)
            result = fn(rank, world, *args)
            out = os.path.join(os.path.dirname(job), f"{rank}.pt")
            torch.save(result, out)
            dist.barrier()
            reply = ("ok", out)
        except BaseException:
            reply = ("error", traceback.format_exc())
        os.environ.clear()
        os.environ.update(env)
        for lg, level, handlers, propagate in kept:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate
        conn.send(reply)
        if reply[0] != "ok" or not dist.is_initialized():
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as `_worker`: no interpreter teardown under gloo's threads


class Said(logging.Handler):
    """fbmt's warnings, kept (caplog cannot see a spawned rank's): add to logging.getLogger("fbmt")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
