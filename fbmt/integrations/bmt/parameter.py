"""`DistributedParameter`: a parameter that holds only this rank's part, from construction on.

NOTE: [Two partitions]
A parameter's local part has two shapes over its life:

- *Construction* (BMTrain's own partition): built from the full `data`, it keeps elements
  [r * ceil(n/N), (r + 1) * ceil(n/N)) of the flattened tensor and lets the rest go, so a model
  built from these never holds more than its construction temporaries.
- *Lowered*: when the model is lowered onto fbmt.compile's machinery (`fbmt/integrations/bmt/module.py`), its
  parameters are laid out in flat per-block groups and each parameter's `.data` becomes a view of
  the part of its group's shard that this rank owns: `[_start_partition, _end_partition)` of the
  flattened parameter, possibly empty. The object stays the same, so an optimizer built on it
  earlier keeps working.

`full_tensor(p)` returns the whole parameter in either state (a collective).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from fbmt import job
from fbmt.compiler import local_range
from fbmt.job import all_gather_into


class ParameterInitializer:
    """`init_method` for a DistributedParameter: calls `func(tensor, *args, **kwargs)` on the full tensor."""

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any):
        self.func, self.args, self.kwargs = func, args, kwargs

    def __call__(self, tensor: torch.Tensor) -> None:
        self.func(tensor, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ParameterInitializer({getattr(self.func, '__name__', self.func)})"


class DistributedParameter(nn.Parameter):
    """A Parameter of which each rank stores only its part (see NOTE: [Two partitions]).

    Args:
        data: the full initial value (only this rank's slice is kept, on this rank's device).
        requires_grad: as nn.Parameter.
        init_method: called with the full tensor by `fbmt.init_parameters`, e.g.
            `ParameterInitializer(torch.nn.init.normal_, std=0.02)`.
        group: tensor-parallel groups are not supported yet; must be None.
    """

    _original_shape: torch.Size
    _start_partition: int
    _end_partition: int
    _init_method: Callable[[torch.Tensor], None] | None

    def __new__(
        cls,
        data: torch.Tensor,
        requires_grad: bool = True,
        init_method: Callable[[torch.Tensor], None] | None = None,
        group: Any = None,
    ) -> DistributedParameter:
        if group is not None:
            raise NotImplementedError(
                "DistributedParameter(group=...): tensor-parallel groups are not supported "
                "yet; every parameter is sharded over all ranks"
            )
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"DistributedParameter expects a tensor, got {type(data).__name__}")
        world, rank = job.world_size(), job.rank()
        flat = data.detach().reshape(-1)
        per = -(-flat.numel() // world)
        lo, hi = min(flat.numel(), rank * per), min(flat.numel(), (rank + 1) * per)
        local = flat[lo:hi].to(job.local_device(), copy=True)
        p = super().__new__(cls, local, requires_grad)
        _mark(p, data.shape, lo, hi, world, init_method)
        return p

    def __deepcopy__(self, memo: dict) -> DistributedParameter:
        out = torch.Tensor._make_subclass(type(self), self.data.clone(), self.requires_grad)
        out.__dict__.update(copy.deepcopy(self.__dict__, memo))
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto: int) -> Any:
        raise TypeError(
            "a DistributedParameter holds only this rank's part; save the model with fbmt.save(model, "
            "path) or model.state_dict(), which gather the full tensors"
        )

    def gather(self) -> torch.Tensor:
        """The full parameter (a collective: every rank must call it)."""
        return full_tensor(self)


def _mark(
    p: torch.Tensor, shape: torch.Size, lo: int, hi: int, world: int, init_method: Callable[[torch.Tensor], None] | None
) -> None:
    p._original_shape, p._start_partition, p._end_partition = torch.Size(shape), lo, hi
    p._world_size, p._init_method = world, init_method


# Where each lowered parameter lives in its model's flat layout (module._View), by the parameter, kept
# beside it (NOTE: [Lowering] in module.py).
_VIEWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def view_of(p: torch.Tensor) -> Any:
    """The place of a lowered parameter in its model's layout (its group and slot); None if not lowered."""
    return _VIEWS.get(p)


def set_view(p: torch.Tensor, view: Any) -> None:
    _VIEWS[p] = view


def is_distributed(p: torch.Tensor) -> bool:
    """Does `p` hold only a part (a DistributedParameter, or any parameter of a lowered model)."""
    return hasattr(p, "_original_shape")


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly partial) parameter; a collective for partial ones."""
    if not is_distributed(p):
        return p.detach()
    view = view_of(p)
    if view is not None:
        return view.full(p)
    return _gather_construction(p.detach(), p)


def _gather_construction(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    n = p._original_shape.numel()
    world = p._world_size
    if world != job.world_size():
        raise RuntimeError(
            f"a DistributedParameter of shape {tuple(p._original_shape)} was built for {world} "
            f"rank(s) but the job has {job.world_size()}; build the model after "
            "fbmt.init_distributed()"
        )
    if world == 1:
        return local.reshape(p._original_shape)
    per = -(-n // world)
    padded = torch.zeros(per, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    out = torch.empty(per * world, dtype=local.dtype, device=local.device)
    all_gather_into(out, padded)
    return out[:n].view(p._original_shape)


def part_ranges(p: torch.Tensor) -> list[tuple[int, int]]:
    """[lo, hi) of the flattened parameter that each rank holds, for every rank (either partition)."""
    view = view_of(p)
    if view is not None:
        g, s = view.group, view.slot
        return [
            (lo - s.offset, max(lo, hi) - s.offset) for lo, hi in (local_range(g, s, r) for r in range(g.world_size))
        ]
    n, world = p._original_shape.numel(), p._world_size
    per = -(-n // world)
    return [(min(n, r * per), min(n, (r + 1) * per)) for r in range(world)]


def gather_parts(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole flattened tensor of which every rank holds the part of `p` (a collective): used
    for per-element state that follows a parameter's partition, such as optimizer moments."""
    ranges = part_ranges(p)
    if len(ranges) == 1:
        return local.reshape(-1)
    width = max(hi - lo for lo, hi in ranges)
    padded = torch.zeros(width, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local.reshape(-1)
    rows = torch.empty(width * len(ranges), dtype=local.dtype, device=local.device)
    all_gather_into(rows, padded)
    rows = rows.view(len(ranges), width)
    return torch.cat([rows[r, : hi - lo] for r, (lo, hi) in enumerate(ranges)])


def write_full(p: torch.Tensor, value: torch.Tensor) -> None:
    """Store this rank's part of the full `value` into a (possibly partial) parameter."""
    if tuple(value.shape) != tuple(getattr(p, "_original_shape", p.shape)):
        raise ValueError(
            f"expected a tensor of shape {tuple(getattr(p, '_original_shape', p.shape))}, got {tuple(value.shape)}"
        )
    with torch.no_grad():
        if is_distributed(p):
            p.data.copy_(value.reshape(-1)[p._start_partition : p._end_partition])
        else:
            p.data.copy_(value)


__all__ = [
    "DistributedParameter",
    "ParameterInitializer",
    "full_tensor",
    "write_full",
    "is_distributed",
    "part_ranges",
    "gather_parts",
]
