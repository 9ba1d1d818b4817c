"""`AdamOptimizer`: BMTrain's Adam, on the device: fp32 master copy for bf16/fp16 parameters.

On CUDA each parameter is updated by one fused numba kernel (`fbmt.kernels.fused_adam_`: gradient
in, master, moments and the rounded low-precision parameter out, in one pass). On the CPU the same
update runs as torch ops. Both follow torch.optim.AdamW's formulas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from fbmt.integrations.optim._adam_base import AdamBase


class AdamOptimizer(AdamBase):
    """Adam(W) with an fp32 master copy for low-precision parameters (BMTrain's semantics).

    Args:
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        hold_steps: the learning rate is 0 for the first `hold_steps` steps (moments still update).
        decoupled_weight_decay: False gives torch.optim.Adam's L2 penalty instead.
        skip_nonfinite: check every gradient for inf/nan first (one multi-tensor kernel on CUDA) and
            skip the whole step if one is found; `last_step_skipped` says so. Costs one host read of
            the device flag per step.
        use_kernels: use the numba kernels (default: for CUDA parameters).

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
        use_kernels: bool | None = None,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, hold_steps, decoupled_weight_decay, skip_nonfinite)
        self.use_kernels = use_kernels

    def _kernels(self, p: torch.Tensor) -> bool:
        return self.use_kernels if self.use_kernels is not None else p.is_cuda

    def _new_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = {
            "exp_avg": torch.zeros(p.numel(), dtype=torch.float32, device=p.device),
            "exp_avg_sq": torch.zeros(p.numel(), dtype=torch.float32, device=p.device),
        }
        if p.dtype != torch.float32:
            state["master"] = p.detach().reshape(-1).float()
        return state

    def _update(self, p: torch.Tensor, st: dict[str, Any], hyper: dict[str, Any]) -> None:
        master = st.get("master", p.detach().view(-1))
        out = p.detach().view(-1) if "master" in st else None
        grad = p.grad.detach().contiguous().view(-1)
        if self._kernels(p):
            from fbmt.kernels import fused_adam_

            fused_adam_(master, st["exp_avg"], st["exp_avg_sq"], grad, out, **hyper)
        else:
            _torch_adam_(master, st["exp_avg"], st["exp_avg_sq"], grad, out, **hyper)

    def _any_nonfinite(self, grads: list[torch.Tensor]) -> bool:
        if self._kernels(grads[0]):
            from fbmt.kernels import multi_tensor_nonfinite

            return bool(multi_tensor_nonfinite([g.detach().contiguous() for g in grads]).item())
        return not all(bool(torch.isfinite(g).all()) for g in grads)


def _torch_adam_(
    master: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    inv_scale: float,
    decoupled: bool,
) -> None:
    """The same update as the kernel, as torch ops (the CPU path), following torch.optim.AdamW."""
    g = grad.float() * inv_scale if (grad.dtype != torch.float32 or inv_scale != 1.0) else grad
    if not decoupled and weight_decay:
        g = g.add(master, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if decoupled:
        master.mul_(1 - lr * weight_decay)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    master.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    if out is not None:
        out.copy_(master)
