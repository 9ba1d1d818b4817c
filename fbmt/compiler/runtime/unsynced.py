"""Gradients kept on this rank while gradient sync is off (NOTE: [Accumulation without sync]).

NOTE: [Accumulation without sync]
DDP's `no_sync()` and FSDP2's `set_requires_gradient_sync(False)` let a loop accumulate several
micro-batches' gradients locally and reduce them over ranks once, with the last backward. A compiled
program's backward reduce-scatters each flat group's gradient where the schedule put it; the program
is the same whatever the sync setting, and the choice is made where the reduction runs. Every
reducing start is lowered to a `Deferrable` of its group (`runtime/partition.py`), which reads the
model's `Unsynced` that `RunProgram.backward` makes active:
- sync off: the group's gradient pieces are added into a full-size buffer of this rank's own (in the
  reduce dtype), and the start returns zeros for the shard's gradient: nothing crosses the wire;
- sync on, with a buffer held: the pieces are added into it, and the buffer is what is reduced, in
  the same collective at the same place in the schedule: one reduction per group per optimizer step;
- sync on, nothing held: the start runs as lowered.
Reduction is linear, so the shard's gradient is the one reducing every micro-batch would give. The
memory is DDP's: a full gradient per group while accumulating. CUDA graphs replay the collectives
they captured, so with `cuda_graph=True` every micro-batch still reduces (said once, as a warning).
A held buffer follows the gradients it stands for: an optimizer step that would read a shard while its
group holds one is refused (the loop never ran a synced backward). Each leaf's gradient is noted after
autograd accumulates into it (a post-accumulate hook); at the next backward, a group whose gradients
were since set to None or zeroed in place (`zero_grad()`, either way) drops its buffer, as DDP's
`zero_grad` drops what `no_sync` accumulated, and one changed in place otherwise (scaled, clipped) is
refused: the held part cannot follow that change.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fbmt.compiler.collectives.torch_impl import Pending

_active: Unsynced | None = None  # the model whose backward runs now (RunProgram.backward sets it)
_live: weakref.WeakSet = weakref.WeakSet()


class Unsynced:
    """One compiled model's sync switch and the gradients it holds (NOTE: [Accumulation without sync]).

    `leaves(group)`: the tensors that receive the group's gradient (its shard, or its views)."""

    def __init__(self, leaves: Callable[[int], list[torch.Tensor]]):
        self.leaves = leaves
        self.deferring = False
        self.held: dict[int, torch.Tensor] = {}  # group -> this rank's sum of its unreduced gradients
        self.reductions = 0  # reductions run for groups, counted per group (a bucket counts its members)
        self.seen: dict[int, tuple[Any, int]] = {}  # id(leaf) -> its grad (weakly) and the grad's version
        self.hooked: set[int] = set()  # groups whose leaves note their gradients into `seen`
        _live.add(self)

    def __deepcopy__(self, memo: dict) -> Unsynced:
        """A copy of the model (an EMA twin) has its own switch and buffers, for its own leaves."""
        twin = Unsynced.__new__(Unsynced)
        memo[id(self)] = twin
        twin.leaves = copy.deepcopy(self.leaves, memo)  # a bound method: bound to the twin
        twin.deferring, twin.reductions = self.deferring, self.reductions
        twin.held = {g: t.clone() for g, t in self.held.items()}
        twin.seen, twin.hooked = {}, set()  # its leaves are new tensors: hooked at its first deferred backward
        _live.add(twin)
        return twin

    def start_backward(self) -> None:
        """Before a backward: drop what a group holds where its gradients were zeroed since (set to None or
        zeroed in place), refuse where they were changed otherwise."""
        for group in list(self.held):
            changed = []
            for t in self.leaves(group):
                noted = self.seen.get(id(t))
                if noted is not None and (t.grad is None or t.grad is not noted[0]() or t.grad._version != noted[1]):
                    changed.append(t)
            if not changed:
                continue
            if all(t.grad is None or not bool(t.grad.any()) for t in changed):
                del self.held[group]
                continue
            raise RuntimeError(
                f"fbmt: flat group {group}'s gradients were changed in place (scaled or clipped) while gradient sync "
                "was off and part of them was held on this rank, unreduced; that part cannot follow the change. "
                "Change gradients after the backward with sync on (outside no_sync()), as with DDP's clip_grad_norm_"
            )

    def _note(self, leaf: torch.Tensor) -> None:
        if leaf.grad is not None:
            self.seen[id(leaf)] = (weakref.ref(leaf.grad), leaf.grad._version)

    def add(self, group: int, pieces: list[torch.Tensor], padded_numel: int, dtype: torch.dtype) -> torch.Tensor:
        held = self.held.get(group)
        if held is None:
            held = self.held[group] = torch.zeros(padded_numel, dtype=dtype, device=pieces[0].device)
        if group not in self.hooked:  # autograd accumulates into the leaves after this backward: note it then
            self.hooked.add(group)
            for t in self.leaves(group):
                if t.requires_grad:
                    t.register_post_accumulate_grad_hook(self._note)
        offset = 0
        for p in pieces:
            held[offset : offset + p.numel()].add_(p.reshape(-1))
            offset += p.numel()
        return held


class active:
    """Within: the backward of the model `unsynced` belongs to runs (None: reduce as lowered)."""

    def __init__(self, unsynced: Unsynced | None):
        self.unsynced = unsynced

    def __enter__(self) -> None:
        global _active
        self.before, _active = _active, self.unsynced
        if self.unsynced is not None and self.unsynced.held:
            self.unsynced.start_backward()

    def __exit__(self, *exc: Any) -> None:
        global _active
        _active = self.before


def _zeros(padded_numel: int, world_size: int, dtype: torch.dtype, device: torch.device) -> Pending:
    return Pending(torch.zeros(padded_numel // world_size, dtype=dtype, device=device), None)


class Deferrable:
    """A reducing start of one flat group, lowered: what it does depends on the active model's sync
    switch (NOTE: [Accumulation without sync])."""

    def __init__(self, implementation: Callable[..., Any], group: int, on_host: bool = False):
        self.implementation, self.group = implementation, group
        self.on_host = on_host  # its shard's gradient lives in host memory (NOTE: [Offload] in passes/shard.py)
        self.__name__ = f"{getattr(implementation, '__name__', 'reduce')}_group{group}"
        self.__qualname__, self.__module__ = self.__name__, __name__

    def __call__(self, pieces: list[torch.Tensor], world_size: int, padded_numel: int, *rest: Any) -> Any:
        unsynced = _active
        if unsynced is None:
            return self.implementation(pieces, world_size, padded_numel, *rest)
        average, wire_dtype, reduce_dtype, out_dtype = rest
        if unsynced.deferring:
            unsynced.add(self.group, pieces, padded_numel, reduce_dtype)
            device = torch.device("cpu") if self.on_host else pieces[0].device
            return _zeros(padded_numel, world_size, out_dtype, device)
        if self.group in unsynced.held:
            pieces = [unsynced.add(self.group, pieces, padded_numel, reduce_dtype)]
            del unsynced.held[self.group]
        unsynced.reductions += 1
        return self.implementation(pieces, world_size, padded_numel, *rest)


class DeferrableBucket:
    """A bucket's reducing start (several groups in one call), lowered as `Deferrable` is."""

    def __init__(self, implementation: Callable[..., Any], groups: list[int], on_host: bool = False):
        self.implementation, self.groups, self.on_host = implementation, groups, on_host
        self.__name__ = f"{getattr(implementation, '__name__', 'reduce_bucket')}_groups{'_'.join(map(str, groups))}"
        self.__qualname__, self.__module__ = self.__name__, __name__

    def __call__(self, members: list[tuple]) -> Any:
        unsynced = _active
        if unsynced is None:
            return self.implementation(members)
        if unsynced.deferring:
            out = []
            for group, (pieces, world_size, padded_numel, _, _, reduce_dtype, out_dtype) in zip(self.groups, members):
                unsynced.add(group, pieces, padded_numel, reduce_dtype)
                device = torch.device("cpu") if self.on_host else pieces[0].device
                out.append(_zeros(padded_numel, world_size, out_dtype, device))
            return out
        members = list(members)
        for i, group in enumerate(self.groups):
            if group in unsynced.held:
                pieces, world_size, padded_numel, *rest = members[i]
                members[i] = ([unsynced.add(group, pieces, padded_numel, rest[2])], world_size, padded_numel, *rest)
                del unsynced.held[group]
        unsynced.reductions += len(self.groups)
        return self.implementation(members)


def unreduced(params: list[torch.Tensor]) -> str | None:
    """Why an optimizer step over `params` would read gradients still held unreduced, or None."""
    held = [u for u in list(_live) if u.held]
    if not held:
        return None
    ids = {id(p) for p in params}
    for unsynced in held:
        for group in unsynced.held:
            if any(id(t) in ids for t in unsynced.leaves(group)):
                return (
                    f"flat group {group} holds gradients accumulated with gradient sync off (inside no_sync() or "
                    "after set_requires_gradient_sync(False)) that no backward with sync on has reduced yet"
                )
    return None
