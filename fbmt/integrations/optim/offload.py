"""`AdamOffloadOptimizer`: Adam whose fp32 master weights and moments live in host memory.

Each step copies the gradients to the host, runs the native fused Adam (`fbmt._C`) there and copies
the updated parameters back. On CUDA this is pipelined in chunks: all device-to-host gradient copies
are queued at once on one stream, the CPU updates chunk k as soon as it has arrived, and chunk k's
parameters go back on a second stream while chunk k+1 is computed. Host buffers are pinned.

A CPU fp32 parameter is its own master copy (updated in place), and so is a CUDA fp32 one: its chunks
travel to the host and back through two pinned staging buffers, so the host holds only the moments
(8 bytes per parameter) and the device the parameter and its gradient: together the two memories
hold a model neither holds alone (BENCHMARKS.md). Any other parameter gets an fp32 master in host
memory, so bf16/fp16 parameters are updated in fp32 and rounded once per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fbmt.integrations.optim._adam_base import AdamBase
from fbmt.integrations.optim.cpu_adam import fused_adam_, has_nonfinite


class AdamOffloadOptimizer(AdamBase):
    """Adam(W) with host-resident state, BMTrain's semantics.

    Args:
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        hold_steps: the learning rate is 0 for the first `hold_steps` steps (moments still update).
        decoupled_weight_decay: False gives torch.optim.Adam's L2 penalty instead.
        skip_nonfinite: if any gradient is inf/nan, skip the whole step (nothing changes) and set
            `last_step_skipped`; otherwise such a step is applied, as torch's AdamW would.
        chunk_numel: elements per pipeline chunk on CUDA (large enough that each chunk's copies and
            update outweigh their fixed costs, small enough to overlap them; BENCHMARKS.md times sizes).
        threads: CPU threads for the update (0: every CPU this process may run on).

    `step(closure=None, scale=1.0)`: gradients are divided by `scale` (a loss scale) inside the update.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        hold_steps: int = 0,
        *,
        decoupled_weight_decay: bool = True,
        skip_nonfinite: bool = False,
        chunk_numel: int = 1 << 24,
        threads: int = 0,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, hold_steps, decoupled_weight_decay, skip_nonfinite)
        self.chunk_numel, self.threads = chunk_numel, threads
        self._host: dict[torch.Tensor, dict[str, torch.Tensor]] = {}  # pinned transfer buffers, not state
        self._staging: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (grad, param) x 2, pinned
        self._streams: tuple[Any, Any] | None = None

    def _new_state(self, p: torch.Tensor) -> dict[str, Any]:
        pin = p.is_cuda and not _is_own_master(p)  # a CUDA fp32 parameter's moments are the host's alone
        state = {
            "exp_avg": torch.zeros(p.numel(), dtype=torch.float32, pin_memory=pin),
            "exp_avg_sq": torch.zeros(p.numel(), dtype=torch.float32, pin_memory=pin),
        }
        if not _is_own_master(p):
            state["master"] = torch.empty(p.numel(), dtype=torch.float32, pin_memory=pin)
            state["master"].copy_(p.detach().reshape(-1))
        return state

    def _update(self, p: torch.Tensor, st: dict[str, Any], hyper: dict[str, Any]) -> None:
        hyper = dict(hyper, threads=self.threads)
        if p.is_cuda and _is_own_master(p):
            self._step_cuda_staged(p, st, hyper)
        elif p.is_cuda:
            self._step_cuda(p, st, hyper)
        else:
            master = st.get("master", p.detach().view(-1))
            out = None if _is_own_master(p) else p.detach().view(-1)
            fused_adam_(master, st["exp_avg"], st["exp_avg_sq"], p.grad.detach().contiguous().view(-1), out, **hyper)

    def _any_nonfinite(self, grads: list[torch.Tensor]) -> bool:
        return any(
            not bool(torch.isfinite(g).all())
            if g.is_cuda
            else has_nonfinite(g.detach().contiguous().view(-1), self.threads)
            for g in grads
        )

    def _step_cuda(self, p: torch.Tensor, st: dict[str, Any], hyper: dict[str, Any]) -> None:
        n, grad, param = p.numel(), p.grad.detach().reshape(-1), p.detach().view(-1)
        host = self._host.get(p)
        if host is None:
            host = self._host[p] = {
                "grad": torch.empty(n, dtype=grad.dtype, pin_memory=True),
                "param": torch.empty(n, dtype=p.dtype, pin_memory=True),
            }
        if self._streams is None:
            self._streams = (torch.cuda.Stream(p.device), torch.cuda.Stream(p.device))
        down, up = self._streams
        down.wait_stream(torch.cuda.current_stream(p.device))  # the gradients are complete
        chunks = [(lo, min(n, lo + self.chunk_numel)) for lo in range(0, n, self.chunk_numel)]
        arrived = []
        with torch.cuda.stream(down):
            for lo, hi in chunks:
                host["grad"][lo:hi].copy_(grad[lo:hi], non_blocking=True)
                arrived.append(torch.cuda.Event())
                arrived[-1].record(down)
        for (lo, hi), event in zip(chunks, arrived):
            event.synchronize()
            fused_adam_(
                st["master"][lo:hi],
                st["exp_avg"][lo:hi],
                st["exp_avg_sq"][lo:hi],
                host["grad"][lo:hi],
                host["param"][lo:hi],
                **hyper,
            )
            with torch.cuda.stream(up):
                param[lo:hi].copy_(host["param"][lo:hi], non_blocking=True)
        torch.cuda.current_stream(p.device).wait_stream(up)
        up.synchronize()  # the pinned buffers are reused next step; the copies must be done by then

    def _step_cuda_staged(self, p: torch.Tensor, st: dict[str, Any], hyper: dict[str, Any]) -> None:
        """A CUDA fp32 parameter, its own master: chunk by chunk, its gradient and value go to one of two
        pinned staging buffers, the CPU updates the value there, and it goes back, while the next chunk
        travels down. A buffer is written again only once the device has copied it back (`done`)."""
        n, grad, param = p.numel(), p.grad.detach().reshape(-1), p.detach().view(-1)
        size = min(self.chunk_numel, n)
        if self._staging is None or self._staging[0][0].numel() < size:
            self._staging = [(torch.empty(size, pin_memory=True), torch.empty(size, pin_memory=True)) for _ in range(2)]
        if self._streams is None:
            self._streams = (torch.cuda.Stream(p.device), torch.cuda.Stream(p.device))
        down, up = self._streams
        down.wait_stream(torch.cuda.current_stream(p.device))  # the gradients are complete
        down.wait_stream(up)  # the last parameter's values are back: the buffers are free
        chunks = [(lo, min(n, lo + self.chunk_numel)) for lo in range(0, n, self.chunk_numel)]
        arrived: list[torch.cuda.Event] = []
        done: list[torch.cuda.Event] = []

        def fetch(k: int) -> None:
            (lo, hi), (g, v) = chunks[k], self._staging[k % 2]
            with torch.cuda.stream(down):
                if k >= 2:
                    down.wait_event(done[k - 2])  # that chunk's values have left this buffer
                g[: hi - lo].copy_(grad[lo:hi], non_blocking=True)
                v[: hi - lo].copy_(param[lo:hi], non_blocking=True)
                arrived.append(torch.cuda.Event())
                arrived[-1].record(down)

        fetch(0)
        for k, (lo, hi) in enumerate(chunks):
            if k + 1 < len(chunks):
                fetch(k + 1)
            arrived[k].synchronize()
            g, v = self._staging[k % 2]
            fused_adam_(v[: hi - lo], st["exp_avg"][lo:hi], st["exp_avg_sq"][lo:hi], g[: hi - lo], None, **hyper)
            with torch.cuda.stream(up):
                param[lo:hi].copy_(v[: hi - lo], non_blocking=True)
                done.append(torch.cuda.Event())
                done[-1].record(up)
        torch.cuda.current_stream(p.device).wait_stream(up)


def _is_own_master(p: torch.Tensor) -> bool:
    return p.dtype == torch.float32
