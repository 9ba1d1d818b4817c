"""Graph helpers the passes share: node order, inserting a node with its fake value, who reads a buffer."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fbmt.compiler import meta
from fbmt.compiler.ops.tables import hint, is_view, is_view_op


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position in the graph (valid until the graph changes)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def emit(
    graph: fx.Graph, target: Any, args: tuple, phase: str, *, kwargs: dict[str, Any] | None = None, **tags: Any
) -> fx.Node:
    """A call_function node at the graph's insert point, with its phase and `tags` (`fbmt.compiler.meta.tag`'s
    names: block=, group=, ...), and (for an aten op) its value computed on the fake tensors of its arguments."""
    node = graph.call_function(target, args, kwargs)
    meta.tag(node, phase=phase, **tags)
    if isinstance(target, torch._ops.OpOverload):
        vals = fx.node.map_arg(args, lambda a: a.meta.get("val"))  # lists of nodes (a cat's) too
        fake = next((v for v in pytree.tree_leaves(vals) if hasattr(v, "fake_mode")), None)
        if fake is not None:
            node.meta["val"] = fake_value(fake.fake_mode, target, vals, kwargs or {})
    return node


def fake_value(mode: Any, target: torch._ops.OpOverload, vals: tuple, kwargs: dict[str, Any]) -> Any:
    """`target`'s fake result on `vals` (in `mode`), a view's memoized by metadata.

    NOTE: [Views by their metadata]
    A fake op costs a few hundred microseconds, and the shard pass makes two views (a slice and a view)
    of each parameter from its group's gathered buffer, in each phase: thousands at a hundred layers,
    most of that pass's time. A view's result is decided by its input's metadata (shape, strides,
    offset, dtype, device, requires_grad) and its arguments, which are the same for every layer's
    group, so a view op met again with equal metadata gets the fake result made the first time. That
    fake is a view of another node's value; a value's metadata is all the passes read of it (never
    its storage). Sizes that are symbols are not memoized. `_unsafe_view` counts as a view here (its
    schema claims a new tensor, but its result is a reshape of its input, decided the same way): the
    merge pass re-derives the views of every layer's merged products, a third of them those."""
    memoized = is_view_op(target) or target is torch.ops.aten._unsafe_view.default
    key = _view_key(target, vals, kwargs) if memoized else None
    if key is not None:
        # kept on the mode itself: the fakes refer to their mode, so a table beside it would keep both alive
        seen = mode.__dict__.setdefault("_fbmt_views_by_metadata", {})
        if key in seen:
            return seen[key]
    with mode:
        out = target(*vals, **kwargs)
    if key is not None:
        seen[key] = out
    return out


def _view_key(target: Any, vals: tuple, kwargs: dict[str, Any]) -> tuple | None:
    parts: list[Any] = [target]
    for a in [*vals, *kwargs.items()]:
        if isinstance(a, torch.Tensor):
            sizes = (*a.shape, *a.stride(), a.storage_offset())
            if not all(isinstance(x, int) for x in sizes):
                return None
            parts.append((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device, a.requires_grad))
        elif isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
            parts.append(tuple(a))
        elif isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str):  # a keyword argument
            if not isinstance(a[1], (int, bool, type(None))):
                return None
            parts.append(a)
        elif isinstance(a, (int, bool, type(None))):
            parts.append(a)
        else:
            return None
    return tuple(parts)


def fake_like(val: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake tensor of `shape` in `val`'s fake mode, device and (unless given) dtype."""
    with val.fake_mode:
        return torch.empty(shape, dtype=dtype or val.dtype, device=val.device)


def nbytes(value: Any) -> int:
    """Bytes of a node's value (`meta["val"]`): a tensor, or a list/tuple of them; else 0."""
    if isinstance(value, torch.Tensor):
        return hint(value.numel()) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(x) for x in value)
    return 0


def size(n: float) -> str:
    """Bytes in the unit that reads best: 512 B, 12.3 KiB, 4.1 MiB, 2.00 GiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def buffer_readers(buffer: fx.Node) -> tuple[list[fx.Node], bool]:
    """Nodes that read `buffer` directly or through views of it; and whether the output returns it."""
    readers, todo, returned = [], [buffer], False
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                returned = True
                continue
            readers.append(u)
            if is_view(u) and u.args[0] is n:
                todo.append(u)
    return readers, returned
