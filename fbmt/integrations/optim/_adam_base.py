"""What fbmt's two Adams share: BMTrain's semantics around the update.

A subclass supplies three things: `_new_state(p)` (the moments, and an fp32 master where the
parameter is not its own), `_update(p, state, hyper)` (one fused step) and `_any_nonfinite(grads)`.
This class owns everything else: argument checks, `hold_steps`, loss-scale unscaling
(`step(scale=...)`), skipping a non-finite step, and an exact `state_dict` round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamBase(torch.optim.Optimizer):
    """Subclasses define `_new_state(p) -> dict`, `_update(p, state, hyper)` and `_any_nonfinite(grads)`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        hold_steps: int,
        decoupled_weight_decay: bool,
        skip_nonfinite: bool,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or hold_steps < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"{type(self).__name__}: invalid lr={lr}, betas={betas}, eps={eps}, "
                f"weight_decay={weight_decay} or hold_steps={hold_steps}"
            )
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.hold_steps, self.decoupled, self.skip_nonfinite = hold_steps, decoupled_weight_decay, skip_nonfinite
        self.last_step_skipped = False

    # ---- shared ----
    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            if not p.is_contiguous():
                raise ValueError(f"{type(self).__name__}: parameters must be contiguous")
            st.update(step=0, **self._new_state(p))
        return st

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, scale: float = 1.0) -> Any:
        """One step; gradients are divided by `scale` (a loss scale) inside the update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.last_step_skipped = bool(work) and self.skip_nonfinite and self._any_nonfinite([p.grad for _, p in work])
        if not work or self.last_step_skipped:
            return loss
        holding = self.hold_steps > 0
        for group, p in work:
            st = self._state(p)
            st["step"] += 1
            beta1, beta2 = group["betas"]
            self._update(
                p,
                st,
                dict(
                    lr=0.0 if holding else group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=st["step"],
                    inv_scale=1.0 / scale,
                    decoupled=self.decoupled,
                ),
            )
        if holding:
            self.hold_steps -= 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["hold_steps"] = self.hold_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores exactly: the fp32 master and moments are copied as saved, never cast to the
        parameter's dtype (torch's default would round a bf16 parameter's master to bf16)."""
        saved = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.hold_steps = state_dict.get("hold_steps", self.hold_steps)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in saved.items():
            p = params[int(index)]
            st = self._state(p)
            for key, value in entry.items():
                if key == "master" and key not in st:  # saved when a CUDA fp32 parameter kept a host copy of
                    continue  # itself (fbmt before it became its own master): the same values as the parameter
                if not isinstance(value, torch.Tensor):
                    st[key] = value
                elif value.numel() != p.numel():
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: state '{key}' of parameter {index} "
                        f"has {value.numel()} elements, the parameter {p.numel()}; to resume on a "
                        "different number of ranks, save with OptimManager.state_dict(gather_opt=True)"
                    )
                else:
                    st[key].copy_(value.reshape(-1))  # into the existing (device or pinned host) buffer
