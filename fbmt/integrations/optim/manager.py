"""`OptimManager`: BMTrain's training-step driver (loss scaling, clipping, stepping optimizers and
lr schedulers together), with its exact rules (../shared/BMTRAIN_API.md, "Optimization").

Loss scaling: `backward(loss)` differentiates `loss * loss_scale / world_size` (a BMTrain model sums
gradients over ranks, so this yields the mean gradient). `step()` first checks every low-precision
(fp16/bf16) parameter's gradient on every rank for inf/nan; on overflow it skips the step, zeroes
the gradients and divides the scale by `loss_scale_factor` (not below `min_loss_scale`). Otherwise
every optimizer steps on unscaled gradients, every lr scheduler steps, and after `loss_scale_steps`
clean steps in a row the scale is multiplied by the factor (not above `max_loss_scale`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fbmt.compiler import group_of
from fbmt.integrations.bmt import distributed
from fbmt.integrations.bmt.parameter import gather_parts, is_distributed, view_of
from fbmt.integrations.optim._adam_base import AdamBase
from fbmt.integrations.torch_guards import unmarked


class OptimManager:
    """BMTrain's training-step driver: loss scaling, gradient clipping over all ranks, and stepping
    its optimizers and lr schedulers together (the rules are in this module's docstring)."""

    def __init__(
        self,
        loss_scale: float | None = None,
        loss_scale_factor: float = 2,
        loss_scale_steps: int = 1024,
        min_loss_scale: float = 1,
        max_loss_scale: float = float("inf"),
        grad_scale: int | None = None,
    ):
        if loss_scale is not None and loss_scale <= 0:
            raise ValueError(f"OptimManager(loss_scale={loss_scale}): must be positive (or None to disable)")
        if loss_scale_factor <= 1 or loss_scale_steps < 1 or not 0 < min_loss_scale <= max_loss_scale:
            raise ValueError(
                f"OptimManager: invalid loss_scale_factor={loss_scale_factor}, loss_scale_steps="
                f"{loss_scale_steps} or bounds [{min_loss_scale}, {max_loss_scale}]"
            )
        self.loss_scale_enabled = loss_scale is not None
        self.loss_scale = float(loss_scale) if loss_scale is not None else 1.0
        self.loss_scale_factor, self.loss_scale_steps = loss_scale_factor, loss_scale_steps
        self.min_loss_scale, self.max_loss_scale = min_loss_scale, max_loss_scale
        self.grad_scale = grad_scale if grad_scale is not None else distributed.world_size()
        self.steps_since_last_scale = 0
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[Any] = []

    def add_optimizer(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> None:
        """Step `optimizer` (and `lr_scheduler`, after it) in every `step()`."""
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale, divided by `grad_scale` (the world size): what `backward` differentiates."""
        return loss * (self.loss_scale / self.grad_scale)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate the scaled loss (`scale_loss`)."""
        self.scale_loss(loss).backward()

    def zero_grad(self) -> None:
        """Zero every optimizer's gradients in place (BMTrain keeps the buffers)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=False)

    def _params(self, param_groups: list[dict] | None = None) -> list[torch.Tensor]:
        groups = param_groups if param_groups is not None else [g for o in self.optimizers for g in o.param_groups]
        return [p for g in groups for p in g["params"] if p.grad is not None]

    def overflow(self) -> bool:
        """Is any gradient inf/nan on any rank (a collective).

        BMTrain looks at fp16/bf16 gradients only; an fp32 gradient that is inf/nan would then be
        stepped with, and every parameter it reaches would become NaN without a word. So every
        floating gradient is checked: a step under loss scaling never takes a non-finite gradient."""
        grads = [p.grad for p in self._params() if p.grad.is_floating_point() and p.grad.numel()]
        device = grads[0].device if grads else distributed.local_device()
        if grads and device.type == "cuda":
            from fbmt.kernels import multi_tensor_nonfinite

            flag = multi_tensor_nonfinite([g.detach().contiguous().to(_checked(g.dtype)) for g in grads])
            flag = flag.float().reshape(1)
        else:
            flag = torch.tensor([float(any(not bool(torch.isfinite(g).all()) for g in grads))], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def step(self) -> bool:
        """One step of every optimizer and lr scheduler; returns False if an overflow skipped it."""
        if self.loss_scale_enabled and self.overflow():
            new = max(self.loss_scale / self.loss_scale_factor, self.min_loss_scale)
            distributed.print_rank(f"Gradient overflow, change scale from {self.loss_scale:g} to {new:g}")
            self._justify_scale(new)
            self.zero_grad()
            return False
        for opt, scheduler in zip(self.optimizers, self.lr_schedulers):
            if isinstance(opt, AdamBase):
                opt.step(scale=self.loss_scale)  # unscales inside its fused update
            else:
                if self.loss_scale != 1:
                    with torch.no_grad():
                        for p in self._params(opt.param_groups):
                            p.grad.div_(self.loss_scale)
                opt.step()
            if scheduler is not None:
                scheduler.step()
        if self.loss_scale_enabled:
            self.steps_since_last_scale += 1
            if self.steps_since_last_scale >= self.loss_scale_steps and self.loss_scale < self.max_loss_scale:
                self._justify_scale(min(self.loss_scale * self.loss_scale_factor, self.max_loss_scale))
        return True

    def _justify_scale(self, scale: float) -> None:
        for opt in self.optimizers:
            hook = getattr(opt, "_on_justify_scale", None)
            if hook is not None:
                hook(self.loss_scale, scale)
        self.loss_scale = scale
        self.steps_since_last_scale = 0

    def clip_grad_norm(
        self, param_groups: list[dict], max_norm: float, norm_type: float = 2, eps: float = 1e-6
    ) -> torch.Tensor:
        """Clip the (loss-scaled) gradients to `max_norm * loss_scale` over the norm of all ranks'
        gradients together; returns the unscaled norm before clipping."""
        grads = [p.grad.detach() for p in self._params(param_groups) if p.requires_grad]
        device = grads[0].device if grads else distributed.local_device()
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            total = torch.zeros(1, dtype=torch.float32, device=device)
            for g in grads:
                if g.numel():
                    total = torch.maximum(total, g.abs().max().float())
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = torch.zeros(1, dtype=torch.float32, device=device)
            for g in grads:
                total += g.float().abs().pow(norm_type).sum()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(total)
            total = total.pow(1.0 / norm_type)
        total = total[0]
        coef = float(max_norm * self.loss_scale) / (total + eps)
        if coef < 1:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef.to(g.dtype))
        return total / self.loss_scale

    def state_dict(self, gather_opt: bool = False) -> dict[str, Any]:
        """Optimizers, lr schedulers and the loss-scale state. Each rank's optimizer state covers only
        its parts of the parameters; with `gather_opt=True` (a collective) every per-element state of
        a sharded parameter is gathered whole onto the CPU, so `load_state_dict` can resume it on any
        number of ranks (save it from rank 0)."""
        optimizers = [o.state_dict() for o in self.optimizers]
        if gather_opt:  # every rank's: without the key that says whose (NOTE: [Another rank's optimizer state])
            optimizers = [unmarked(_map_sharded_state(o, sd, _gather)) for o, sd in zip(self.optimizers, optimizers)]
        return {
            "optimizers": optimizers,
            "lr_schedulers": [s.state_dict() if s is not None else None for s in self.lr_schedulers],
            "loss_scale": self.loss_scale,
            "loss_scale_enabled": self.loss_scale_enabled,
            "steps_since_last_scale": self.steps_since_last_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s result; whole (gathered) per-element states are cut to this rank's
        parts, so a state saved on one number of ranks resumes on another."""
        if len(state["optimizers"]) != len(self.optimizers):
            raise ValueError(
                f"OptimManager.load_state_dict: the state has {len(state['optimizers'])} optimizers, "
                f"this manager {len(self.optimizers)}; add the same optimizers first"
            )
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(_map_sharded_state(opt, s, _localize))
        for sched, s in zip(self.lr_schedulers, state["lr_schedulers"]):
            if sched is not None and s is not None:
                sched.load_state_dict(s)
        self.loss_scale = state["loss_scale"]
        self.loss_scale_enabled = state["loss_scale_enabled"]
        self.steps_since_last_scale = state.get("steps_since_last_scale", 0)


def _per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _map_sharded_state(opt: torch.optim.Optimizer, sd: dict[str, Any], fn: Any) -> dict[str, Any]:
    """`sd` with `fn(value, param)` applied to every state tensor of every sharded parameter (a
    BMTrain parameter, or a flat shard of `fbmt.compile`, whose group `fbmt.compiler.group_of` knows)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for index, entry in sd["state"].items():
        p = params[int(index)]
        sharded = is_distributed(p) or group_of(p) is not None
        state[index] = {k: fn(v, p) for k, v in entry.items()} if sharded else entry
    return {**sd, "state": state}


def _gather(value: Any, p: torch.Tensor) -> Any:
    if not _per_element(value, p.numel()):
        return value
    group = group_of(p)
    if group is not None:  # a flat shard: the whole group's buffer, without the padding
        return distributed.gather_flat(value.detach().reshape(-1))[: group.numel].cpu()
    return gather_parts(value.detach(), p).cpu()


def _localize(value: Any, p: torch.Tensor) -> Any:
    group = group_of(p)
    if group is not None:
        if not _per_element(value, group.numel) or value.numel() == p.numel():
            return value
        lo = distributed.rank() * group.shard_numel
        part = torch.zeros(group.shard_numel, dtype=value.dtype)
        piece = value.reshape(-1)[lo : lo + group.shard_numel]
        part[: piece.numel()] = piece
        return part
    full = p._original_shape.numel()
    if not _per_element(value, full) or full == p.numel():
        return value
    if view_of(p) is None and p._world_size != distributed.world_size():
        raise ValueError("OptimManager.load_state_dict: lower the model first (fbmt.init_parameters or fbmt.load)")
    return value.reshape(-1)[p._start_partition : p._end_partition].reshape(p.shape).clone()


def _checked(dtype: torch.dtype) -> torch.dtype:
    """The dtype the inf/nan kernel reads a gradient of `dtype` in (it reads fp32, bf16 and fp16; a
    wider float is cast, which keeps inf and nan)."""
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
