"""BMTrain's small utilities: `AverageRecorder` (a bias-corrected moving average) and `see_memory`."""

from __future__ import annotations

import resource

import torch

from fbmt.integrations.bmt import distributed


class AverageRecorder:
    """An exponential moving average of recorded values, corrected for its start (as Adam's moments
    are), so `value` is a true average from the first record on.

    `record(v)`: v_t = alpha * v_{t-1} + (1 - alpha) * v; `value` = v_t / (1 - alpha**t).
    """

    def __init__(self, alpha: float = 0.9, start_value: float = 0):
        if not 0 <= alpha < 1:
            raise ValueError(f"AverageRecorder(alpha={alpha}): must be in [0, 1)")
        self.alpha, self._value, self._steps = alpha, start_value, 0

    def record(self, v: float) -> None:
        """Add one value to the running average."""
        self._value = self._value * self.alpha + v * (1 - self.alpha)
        self._steps += 1

    @property
    def value(self) -> float:
        if self._steps <= 0:
            return self._value
        return self._value / (1 - self.alpha**self._steps)


def see_memory(message: str = "", detail: bool = False) -> str:
    """Print (on rank 0) and return this rank's memory use: CUDA allocated/peak where there is a GPU,
    else the process's peak resident memory. Resets the CUDA peak counter."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = 1 << 30
        text = (
            f"{message} allocated {torch.cuda.memory_allocated() / gib:.2f} GiB, peak "
            f"{torch.cuda.max_memory_allocated() / gib:.2f} GiB, reserved {torch.cuda.memory_reserved() / gib:.2f} GiB"
        )
        if detail:
            text += "\n" + torch.cuda.memory_summary()
        torch.cuda.reset_peak_memory_stats()
    else:
        text = (
            f"{message} peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20):.2f} GiB"
        )
    distributed.print_rank(text.strip())
    return text.strip()
