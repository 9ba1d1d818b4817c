"""Look at a model's numbers (BMTrain's `inspect`): parameter summaries and recorded tensors.

- `inspect_model(model, "*.attn*")`: statistics of every matching parameter and its gradient, over
  the full (gathered) tensors. A collective: call it on every rank.
- `with inspect_tensor() as it: ... record_tensor(x, "name") ...; it.get_summary()`: statistics of
  recorded values and of their gradients, over all ranks. `record_tensor` works in eager code and
  inside compiled models (Blocks included): while a model is traced it inserts the ops
  `fbmt::record` and `fbmt::record_grad` (`fbmt/compiler/ops/record.py`) into the program, which report to
  the inspector that is active when they run. Programs traced inside and outside an inspector are
  cached separately, so outside one a compiled model carries no recording ops.
- `format_summary(rows)`: a text table of either summary.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fbmt.compiler.ops import record
from fbmt.integrations.bmt.module import full_grad, gathering
from fbmt.integrations.bmt.parameter import full_tensor


def _stats(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().float().reshape(-1)
    if not x.numel():
        return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], device=t.device)
    return torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), device=x.device), x.min(), x.max()])


def _finish(s: torch.Tensor) -> dict[str, float]:
    total, sumsq, count, lo, hi = s.tolist()
    if not count:
        return dict(mean=math.nan, std=math.nan, min=math.nan, max=math.nan)
    mean = total / count
    var = max(0.0, (sumsq - count * mean * mean) / max(1.0, count - 1))
    return dict(mean=mean, std=math.sqrt(var), min=lo, max=hi)


def _global(stats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Combine per-rank statistics over all ranks (sums add, min/max reduce)."""
    if not stats or not dist.is_initialized() or dist.get_world_size() == 1:
        return stats
    s = torch.stack(stats).cpu() if dist.get_backend() == "gloo" else torch.stack(stats)
    sums, lows, highs = s[:, :3].contiguous(), s[:, 3].contiguous(), s[:, 4].contiguous()
    dist.all_reduce(sums)
    dist.all_reduce(lows, op=dist.ReduceOp.MIN)
    dist.all_reduce(highs, op=dist.ReduceOp.MAX)
    return list(torch.cat([sums, lows[:, None], highs[:, None]], 1))


# ---- parameters ----


def inspect_model(model: nn.Module, param_name: str = "*") -> list[dict[str, Any]]:
    """Statistics of each parameter whose name matches the glob `param_name` (name, shape, mean,
    std, min, max of the full tensor; grad_mean and grad_std of its full gradient, or None)."""
    rows = []
    with gathering():
        for name, p in model.named_parameters():
            if not fnmatch.fnmatch(name, param_name):
                continue
            value, grad = full_tensor(p), full_grad(p)
            row = dict(name=name, shape=tuple(value.shape), **_finish(_stats(value)))
            g = _finish(_stats(grad)) if grad is not None else None
            row.update(grad_mean=g and g["mean"], grad_std=g and g["std"])
            rows.append(row)
    return rows


def format_summary(summary: list[dict[str, Any]]) -> str:
    """A text table of `inspect_model` or `inspect_tensor().get_summary()` rows."""
    columns = ["name", "shape", "mean", "std", "min", "max", "grad_mean", "grad_std"]

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(tuple(v)) if isinstance(v, (list, tuple)) else str(v)

    table = [columns] + [[cell(row.get(c)) for c in columns] for row in summary]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ---- recorded tensors ----


class InspectTensor:
    """Collects what `record_tensor` reports while it is the active inspector (a recorder of
    `fbmt.compiler.ops.record`: `on_value` and `on_grad` are called by the recording ops)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._pending_grads: dict[str, list[int]] = {}

    def on_value(self, name: str, x: torch.Tensor) -> None:
        """Record the value of the tensor named `name` (its summary statistics)."""
        self._pending_grads.setdefault(name, []).append(len(self.records))
        self.records.append(dict(name=name, shape=tuple(x.shape), stats=_stats(x), grad=None))

    def on_grad(self, name: str, g: torch.Tensor) -> None:
        """Record the gradient of the tensor named `name`."""
        waiting = self._pending_grads.get(name)
        if waiting:  # gradients arrive in reverse order of the values
            self.records[waiting.pop()]["grad"] = _stats(g)

    def get_summary(self) -> list[dict[str, Any]]:
        """One row per recorded value, in recording order: name, shape, mean, std, min, max over all
        ranks, and grad_mean/grad_std if its gradient was computed. A collective."""
        values = _global([r["stats"] for r in self.records])
        has_grad = [r["grad"] is not None for r in self.records]
        grads = _global([r["grad"] if r["grad"] is not None else _stats(torch.empty(0)) for r in self.records])
        rows = []
        for r, v, g, h in zip(self.records, values, grads, has_grad):
            row = dict(name=r["name"], shape=r["shape"], **_finish(v))
            gs = _finish(g) if h else None
            row.update(grad_mean=gs and gs["mean"], grad_std=gs and gs["std"])
            rows.append(row)
        return rows


@contextmanager
def inspect_tensor() -> Iterator[InspectTensor]:
    """Collect what `record_tensor` reports inside the block; read it with `get_summary()`."""
    with record.recording(InspectTensor()) as it:
        yield it


def record_tensor(x: torch.Tensor, name: str, group: Any = None) -> None:
    """Record `x` (and, once computed, its gradient) under `name` in the active inspector."""
    record.record(x, name)
