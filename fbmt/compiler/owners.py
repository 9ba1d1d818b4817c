"""What `fbmt.compile` took over from the user's objects, kept beside them and never set on them.

- A parameter the model held becomes a `Placeholder`: a `meta` parameter of fbmt's own class, so the
  module says it was compiled (`taken`), a deep copy of it too (copies keep their class).
- The parameter it replaced is remembered (`moved`), weakly: an optimizer built before compiling
  still holds it, and `moved_name` lets fbmt refuse that optimizer (integrations/torch_guards.py).
- Each flat shard knows its group (`group_of`), for code that meets a shard alone (BMTrain's
  OptimManager, the weight-decay guard).

The maps hold their keys weakly (`torch.utils.weak.WeakIdKeyDictionary`: tensors by identity), so a
module, parameter or shard the user drops is freed as usual.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from fbmt.compiler.layout import FlatGroup


class Placeholder(nn.Parameter):
    """A `meta` parameter standing where a compiled module's parameter was: its values live in the
    compiled module's flat shards."""


_MOVED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the user's parameter -> its canonical name
_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a flat shard -> its FlatGroup
_TAKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a module compile took over -> True


def moved(p: torch.Tensor, name: str) -> None:
    """`p` (named `name` in its model) was replaced by a placeholder."""
    _MOVED[p] = name


def moved_name(p: torch.Tensor) -> str | None:
    """The name of a parameter compile replaced with a placeholder; None for any other tensor."""
    return _MOVED.get(p)


def own_shards(shards: list[nn.Parameter], groups: tuple[FlatGroup, ...]) -> None:
    """Remember each shard's group."""
    for shard, group in zip(shards, groups):
        _GROUPS[shard] = group


def group_of(shard: torch.Tensor) -> FlatGroup | None:
    """The flat group of a compiled module's shard; None for any other tensor."""
    return _GROUPS.get(shard)


def take(module: nn.Module) -> None:
    """Every module of `module`'s tree now belongs to a compiled module."""
    for m in module.modules():
        _TAKEN[m] = True


def taken(module: nn.Module) -> str | None:
    """The path of the first module of the tree that a compiled module took over (a copy of one
    included: it holds placeholders), or None."""
    for path, m in module.named_modules():
        if m in _TAKEN or any(isinstance(p, Placeholder) for p in m._parameters.values()):
            return path
    return None
