"""BMTrain's learning-rate schedulers: warm-up, then a decay, set on every param group.

With i the iteration, w `warmup_iter` and e `end_iter`, the warm-up (i < w) is `start_lr * i / w` for
all but Noam, and after it:

    NoDecay      start_lr
    Noam         start_lr / sqrt(i)            (its warm-up: start_lr / sqrt(w) * i / w)
    Linear       max(0, start_lr * (e - i) / (e - w))
    Cosine       max(0, 0.5 * start_lr * (1 + cos(pi * (i - w) / max(1, e - w))))
    Exponential  max(0, start_lr * gamma ** (i - w))

A scheduler sets the lr when it is built (at `num_iter`) and on each `step(num_iter=None)` (the next
iteration, or the one given). `state_dict()` / `load_state_dict()` save and restore the position.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class WarmupLRScheduler:
    """Base class: subclasses define `get_lr_decay(i)` and may redefine `get_lr_warmup(i)`."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, start_lr: float, warmup_iter: int, end_iter: int, num_iter: int = 0
    ):
        if warmup_iter < 0 or num_iter < 0 or start_lr < 0:
            raise ValueError(
                f"{type(self).__name__}: start_lr={start_lr}, warmup_iter={warmup_iter} and "
                f"num_iter={num_iter} must not be negative"
            )
        self.optimizer, self.start_lr, self.warmup_iter, self.end_iter = optimizer, start_lr, warmup_iter, end_iter
        self.num_iter = num_iter
        self._current_lr = 0.0
        self.step(num_iter)

    def get_lr_warmup(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` of the warm-up."""
        return self.start_lr * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` after the warm-up."""
        raise TypeError(f"{type(self).__name__} is abstract: a scheduler defines get_lr_decay(num_iter)")

    def get_lr(self) -> float:
        """The learning rate at the current iteration."""
        i = self.num_iter
        return self.get_lr_warmup(i) if i < self.warmup_iter else self.get_lr_decay(i)

    @property
    def current_lr(self) -> float:
        return self._current_lr

    def step(self, num_iter: int | None = None) -> None:
        """Advance to the next iteration (or to `num_iter`) and set every parameter group's lr."""
        self.num_iter = self.num_iter + 1 if num_iter is None else num_iter
        self._current_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self._current_lr

    def state_dict(self) -> dict[str, Any]:
        """What `load_state_dict` needs to resume the schedule."""
        return {
            "start_lr": self.start_lr,
            "warmup_iter": self.warmup_iter,
            "end_iter": self.end_iter,
            "num_iter": self.num_iter,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the schedule `state_dict()` saved."""
        self.start_lr, self.warmup_iter = state_dict["start_lr"], state_dict["warmup_iter"]
        self.end_iter, self.num_iter = state_dict["end_iter"], state_dict["num_iter"]
        self.step(self.num_iter)


class NoDecay(WarmupLRScheduler):
    """Linear warm-up to `start_lr`, then `start_lr` constantly."""

    def get_lr_decay(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` after the warm-up."""
        return self.start_lr


class Noam(WarmupLRScheduler):
    """Noam's schedule: linear warm-up, then `start_lr / sqrt(num_iter)`."""

    def get_lr_warmup(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` of the warm-up."""
        return self.start_lr / math.sqrt(self.warmup_iter) * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` after the warm-up."""
        return self.start_lr / math.sqrt(max(num_iter, 1))  # i = 0 only without warm-up: no division by zero


class Linear(WarmupLRScheduler):
    """Linear warm-up, then a linear decay to 0 at `end_iter`."""

    def get_lr_decay(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` after the warm-up."""
        return max(0.0, self.start_lr * (self.end_iter - num_iter) / (self.end_iter - self.warmup_iter))


class Cosine(WarmupLRScheduler):
    """Linear warm-up, then a cosine decay to 0 at `end_iter`."""

    def get_lr_decay(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` after the warm-up."""
        progress = (num_iter - self.warmup_iter) / max(1, self.end_iter - self.warmup_iter)
        return max(0.0, 0.5 * self.start_lr * (1.0 + math.cos(math.pi * progress)))


class Exponential(WarmupLRScheduler):
    """Linear warm-up, then `start_lr * gamma ** (num_iter - warmup_iter)`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        start_lr: float,
        warmup_iter: int,
        end_iter: int,
        num_iter: int = 0,
        gamma: float = 0.95,
    ):
        self.gamma = gamma
        super().__init__(optimizer, start_lr, warmup_iter, end_iter, num_iter)

    def get_lr_decay(self, num_iter: int) -> float:
        """The learning rate at iteration `num_iter` after the warm-up."""
        return max(0.0, self.start_lr * self.gamma ** (num_iter - self.warmup_iter))

    def state_dict(self) -> dict[str, Any]:
        """What `load_state_dict` needs to resume the schedule."""
        return dict(super().state_dict(), gamma=self.gamma)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the schedule `state_dict()` saved."""
        self.gamma = state_dict.get("gamma", self.gamma)
        super().load_state_dict(state_dict)
