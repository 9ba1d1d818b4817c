"""`AdamOptimizer`: BMTrain's Adam, on the device: fp32 master copy for bf16/fp16 parameters.

On CUDA each parameter is updated by one fused numba kernel (`fbmt.kernels.fused_adam_`: gradient
in, master, moments and the rounded low-precision parameter out, in one pass). On the CPU the same
update runs as torch ops. Both follow torch.optim.AdamW's formulas.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch


class AdamOptimizer(torch.optim.Optimizer):
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

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, hold_steps: int = 0, *,
                 decoupled_weight_decay: bool = True, skip_nonfinite: bool = False, use_kernels: bool | None = None):
        if lr < 0 or eps < 0 or weight_decay < 0 or hold_steps < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamOptimizer: invalid lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay} or hold_steps={hold_steps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.hold_steps, self.decoupled, self.skip_nonfinite = hold_steps, decoupled_weight_decay, skip_nonfinite
        self.use_kernels = use_kernels
        self.last_step_skipped = False

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            if not p.is_contiguous():
                raise ValueError("AdamOptimizer: parameters must be contiguous")
            st["step"] = 0
            st["exp_avg"] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            st["exp_avg_sq"] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if p.dtype != torch.float32:
                st["master"] = p.detach().reshape(-1).float()
        return st

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["hold_steps"] = self.hold_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores exactly: the fp32 master and moments are never cast to the parameter's dtype."""
        saved = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.hold_steps = state_dict.get("hold_steps", self.hold_steps)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in saved.items():
            p = params[int(index)]
            st = self._state(p)
            for key, value in entry.items():
                st[key] = value.detach().to(p.device, torch.float32).reshape(-1).clone() \
                    if isinstance(value, torch.Tensor) else value

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, scale: float = 1.0) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not work:
            return loss
        kernels = self.use_kernels if self.use_kernels is not None else work[0][1].is_cuda
        if self.skip_nonfinite:
            self.last_step_skipped = _any_nonfinite([p.grad for _, p in work], kernels)
            if self.last_step_skipped:
                return loss
        lr_scale = 0.0 if self.hold_steps > 0 else 1.0
        for group, p in work:
            st = self._state(p)
            st["step"] += 1
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"] * lr_scale, beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], step=st["step"], inv_scale=1.0 / scale,
                         decoupled=self.decoupled)
            master = st.get("master", p.detach().view(-1))
            out = p.detach().view(-1) if "master" in st else None
            grad = p.grad.detach().contiguous().view(-1)
            if kernels:
                from fbmt.kernels import fused_adam_

                fused_adam_(master, st["exp_avg"], st["exp_avg_sq"], grad, out, **hyper)
            else:
                _torch_adam_(master, st["exp_avg"], st["exp_avg_sq"], grad, out, **hyper)
        if self.hold_steps > 0:
            self.hold_steps -= 1
        return loss


def _any_nonfinite(grads: list[torch.Tensor], kernels: bool) -> bool:
    if kernels:
        from fbmt.kernels import multi_tensor_nonfinite

        return bool(multi_tensor_nonfinite([g.detach().contiguous() for g in grads]).item())
    return not all(bool(torch.isfinite(g).all()) for g in grads)


def _torch_adam_(master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                 out: torch.Tensor | None, *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int, inv_scale: float, decoupled: bool) -> None:
    """The same update as the kernel, as torch ops (the CPU path), following torch.optim.AdamW."""
    g = grad.float() * inv_scale if (grad.dtype != torch.float32 or inv_scale != 1.0) else grad
    if not decoupled and weight_decay:
        g = g.add(master, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if decoupled:
        master.mul_(1 - lr * weight_decay)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    master.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
    if out is not None:
        out.copy_(master)
