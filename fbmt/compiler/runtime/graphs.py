"""CUDA graphs: a training program's forward and backward, each replayed as one CUDA graph.

NOTE: [CUDA graphs]
With `compile(cuda_graph=True)` on CUDA, the first `WARMUP` calls of a training program run as
usual (the first compiles: Inductor's kernels, NCCL's communicators, the copy kernels), on the
stream the capture will use, so cuBLAS has its workspace there. The next call captures the forward
and the backward, collectives and the copy and reduce streams included, as two CUDA graphs that
share one memory pool, and from then on every call replays them: two launches a step instead of
well over a thousand, so the GPU no longer waits for launches between kernels. That pays where a
step is many short kernels, and not where its kernels are long (BENCHMARKS.md).

Programs traced under an active inspector (`fbmt.inspect`) run without graphs: their recording ops
report from the host, which a replay does not run. So do programs that call a function on the host at
every call (SpecAugment's draws: NOTE: [Host calls] in fbmt/compiler/host_calls.py).

A graph replays into the memory it was captured with, so:
- the call's inputs are copied into the captured ones (parameters and buffers are the captured
  tensors themselves: nothing to copy); the user's outputs are cloned out of the pool, so a loss
  kept from an earlier step is not overwritten;
- the saved values live in the pool from the forward's replay to the backward's: a second forward
  before the first one's backward would overwrite them, so it raises;
- the shard gradients are handed to autograd as views of the pool, which makes them `.grad` without
  a copy (as the eager program's reduce-scatter outputs are). The next replay writes the same memory,
  so a forward that finds such a `.grad` still set (gradients accumulated over several backward
  calls, or zeroed in place by `zero_grad(set_to_none=False)`) first copies it out of the pool, and
  autograd then adds the next gradients to the copy, as it would eagerly. That copy costs time and
  memory that `zero_grad(set_to_none=True)` (torch's default) between steps avoids.
The pool keeps a step's peak memory reserved between steps, and one pool exists at a time: a new
input signature drops the previous graphs and warms up again, so graphs pay off with static shapes.

During capture the allocator cannot honour `record_stream`, and would keep every recorded block
until the capture ends; the gradient pieces a reduce-scatter copies on the side stream are instead
held by its `Pending` until the compute stream waits for it (`_guard` in collectives/torch_impl.py): one
block's compute-dtype gradients are held longer than eagerly, which raises the peak a little.

NCCL's communicators wait for every graph that captured their collectives before they are destroyed,
so `dist.destroy_process_group()` hangs while graphs are alive: `CompiledModule.release_graphs()`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fbmt.compiler.runtime.partition import Executable

log = logging.getLogger("fbmt")

WARMUP = 2


class _Replayed:
    """A replayed forward's claim on the saved values in the pool, until its backward replays."""

    __slots__ = ("__weakref__",)


class Graphed:
    """Runs an Executable like `Executable.run_forward`/`run_backward`, by CUDA graphs after warm-up.

    `params`: each parameter whose `.grad` the backward sets."""

    def __init__(self, exe: Executable, device: torch.device, params: list[torch.Tensor]):
        self.exe, self.device, self.params = exe, device, params
        self.calls = 0
        self.capture_seconds = 0.0
        self.stream = torch.cuda.Stream(device)
        self.fwd: torch.cuda.CUDAGraph | None = None
        self.bwd: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.tangents: list[torch.Tensor] = []
        self.grads: list[torch.Tensor | None] = []
        self._grad_storage: set[int] = set()
        self._pending: weakref.ref[_Replayed] | None = None

    # ---- the Executable protocol ----
    def run_forward(self, *args: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        if self.fwd is None:
            self.calls += 1
            if self.calls <= WARMUP:
                with self._on_stream():
                    return self.exe.run_forward(*args)
            self._capture(args)
        self._check_free()
        self._evacuate_grads()
        for static, x in zip(self.inputs, args):
            if x is not static and x.data_ptr() != static.data_ptr():
                static.copy_(x)
        assert self.fwd is not None
        self.fwd.replay()
        claim = _Replayed()
        self._pending = weakref.ref(claim)
        return [o.clone() for o in self.outputs], claim

    def run_backward(self, saved: Any, *tangents: torch.Tensor) -> list[torch.Tensor | None]:
        if not isinstance(saved, _Replayed):  # a warm-up call's
            with self._on_stream():
                return self.exe.run_backward(saved, *tangents)
        if self._pending is None or self._pending() is not saved:
            raise RuntimeError(
                "fbmt: compile(cuda_graph=True): this backward's saved values were overwritten by "
                "a later forward; call backward before the next forward"
            )
        if self.bwd is None:
            raise RuntimeError(
                "fbmt: compile(cuda_graph=True): the graphs were released (release_graphs) between "
                "this forward and its backward; run the forward again"
            )
        for static, t in zip(self.tangents, tangents):
            static.copy_(t)
        self.bwd.replay()
        self._pending = None
        # shard gradients as fresh views of the pool, which autograd makes .grad without a copy
        return [
            None if g is None else g.detach() if role.kind == "shard_grad" else g.clone()
            for g, role in zip(self.grads, self.exe.grad_roles)
        ]

    # ---- capture ----
    def _capture(self, args: tuple[torch.Tensor, ...]) -> None:
        started = time.perf_counter()
        exe = self.exe
        self.inputs = [
            x if role.kind in ("shard", "buffer", "constant") else _captured_copy(x, role.key)
            for role, x in zip(exe.fwd_inputs, args)
        ]
        pool = torch.cuda.graph_pool_handle()
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, pool=pool, stream=self.stream, capture_error_mode="thread_local"):
            outputs, saved = exe.run_forward(*self.inputs)
        self.tangents = [torch.empty_like(outputs[i]) for i in exe.diff_outputs]
        with torch.cuda.graph(bwd, pool=pool, stream=self.stream, capture_error_mode="thread_local"):
            grads = exe.run_backward(saved, *self.tangents)  # takes the saved values out of `saved`
        del saved
        self.fwd, self.bwd, self.outputs, self.grads = fwd, bwd, list(outputs), list(grads)
        self._grad_storage = {
            g.untyped_storage().data_ptr()
            for g, role in zip(self.grads, exe.grad_roles)
            if g is not None and role.kind == "shard_grad"
        }
        self.capture_seconds = time.perf_counter() - started
        log.info(
            "fbmt: captured the forward and backward as CUDA graphs in %.2fs (%.2f GiB reserved)",
            self.capture_seconds,
            torch.cuda.memory_reserved(self.device) / 2**30,
        )

    def _check_free(self) -> None:
        """The saved values the next replay overwrites are no longer needed (see NOTE: [CUDA graphs])."""
        if self._pending is not None and self._pending() is not None:
            raise RuntimeError(
                "fbmt: compile(cuda_graph=True): a forward ran before the previous forward's "
                "backward; the graphs hold one forward's saved values at a time. Call backward "
                "(or drop the previous outputs) first, or compile with cuda_graph=False"
            )

    def _evacuate_grads(self) -> None:
        """A `.grad` still in the pool is copied out before the replay overwrites it (NOTE: [CUDA graphs])."""
        for p in self.params:
            g = p.grad
            if g is not None and g.untyped_storage().data_ptr() in self._grad_storage:
                p.grad = g.clone()

    def release(self) -> None:
        """Drop the graphs and their pool. NCCL's communicators wait for every graph that captured
        their collectives, so `dist.destroy_process_group()` hangs while one is alive."""
        self.fwd = self.bwd = None
        self.inputs, self.outputs, self.tangents, self.grads, self._grad_storage = [], [], [], [], set()

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Run on the capture stream, ordered after and before the caller's stream."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)


def _captured_copy(x: torch.Tensor, index: int) -> torch.Tensor:
    """A copy of input `index` with its sizes and strides (a compiled region checks its inputs' strides)."""
    if 0 in x.stride() and x.numel() > 1:
        raise ValueError(
            f"fbmt: compile(cuda_graph=True): tensor input #{index} (shape {tuple(x.shape)}, strides "
            f"{x.stride()}) is a broadcast view, which the graphs cannot copy the next inputs into; "
            "pass x.contiguous()"
        )
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device).copy_(x)
