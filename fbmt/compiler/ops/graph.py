"""Graph helpers the passes share: node order, inserting a node with its fake value, who reads a buffer."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fbmt.compiler import meta
from fbmt.compiler.ops.tables import hint, is_view


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position in the graph (valid until the graph changes)."""
    return {n: i for i, n in enumerate(graph.nodes)}


# NOTE: [Names of copies]
# A node copied within its graph (a recomputed value, a cloned view) asks fx for its own name, which is
# taken; fx then counts up from its base's count (torch 2.13: `mm_12` taken gives `mm_{k+1}` after the
# last `mm_k`). torch 2.11 and 2.12 looked the count up by the whole name and so counted up from one,
# testing every `mm_i` on the way: a number of tests quadratic in the layers, the larger part of a deep
# model's recompute pass there (BENCHMARKS.md). `copy_node` asks for the name 2.13's fx gives, free
# already, so every torch names the copy alike and no count runs from one.
_NUMBERED = re.compile(r"^(.*?)(?:_(\d+))?$")


def _free_name(graph: fx.Graph, name: str) -> str:
    """`name` where the graph does not hold it yet, else the name torch 2.13's fx gives a copy of it."""
    namespace = getattr(graph, "_graph_namespace", None)
    used, counts = getattr(namespace, "_used_names", None), getattr(namespace, "_base_count", None)
    if used is None or counts is None or name not in used:  # free (or an fx without these: its own naming)
        return name
    base = _NUMBERED.match(name).group(1)
    num = counts.get(base, 0) + 1
    while f"{base}_{num}" in used:
        num += 1
    return f"{base}_{num}"


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform: Callable[[fx.Node], Any] = lambda a: a) -> fx.Node:
    """`graph.node_copy(node, arg_transform)` at the graph's insert point, named as NOTE: [Names of copies]
    says."""
    args, kwargs = fx.map_arg(node.args, arg_transform), fx.map_arg(node.kwargs, arg_transform)
    out = graph.create_node(node.op, node.target, args, kwargs, _free_name(graph, node.name), node.type)
    out.meta = copy.copy(node.meta)
    return out


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
    """`target`'s fake result on `vals` (in `mode`), memoized by the arguments' metadata.

    NOTE: [Values by their metadata]
    A fake op costs a few hundred microseconds, and the passes make the same ops for every layer: the
    shard pass two views (a slice and a view) of each parameter from its group's gathered buffer in
    each phase, the merge pass a `cat` of each run's weights, one product and its column slices, and
    the views of those slices. An op's fake result is decided by its arguments' metadata (a tensor's
    shape, strides, offset, dtype, device and requires_grad; any other argument's type and value) and
    the default dtype, which are the same for every layer, so an op that does not write met again with
    equal metadata gets the fake result made the first time. That fake is another node's value (a view
    of another's, for a view); a value's metadata is all the passes read of it (never its storage or
    identity). Arguments or results with sizes that are symbols are not memoized (two `nonzero`s have
    sizes of their own), nor fakes that carry values (a constant the fake mode propagates)."""
    key = _metadata_key(target, vals, kwargs) if not target._schema.is_mutable else None
    if key is not None:
        # kept on the mode itself: the fakes refer to their mode, so a table beside it would keep both alive
        seen = mode.__dict__.setdefault("_fbmt_values_by_metadata", {})
        if key in seen:
            return seen[key]
    with mode:
        out = target(*vals, **kwargs)
    if key is not None and _plain(out):
        seen[key] = out
    return out


_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNKEYABLE = object()


def _metadata_key(target: Any, vals: tuple, kwargs: dict[str, Any]) -> tuple | None:
    key = (target, torch.get_default_dtype(), _part(vals), _part(tuple(sorted(kwargs.items()))))
    return None if _UNKEYABLE in key else key


def _part(a: Any) -> Any:
    """An argument as a key (its metadata, for a tensor), or `_UNKEYABLE`."""
    if isinstance(a, torch.Tensor):
        sizes = (*a.shape, *a.stride(), a.storage_offset())
        # a fake that carries its values (a small constant the fake mode propagates) is more than metadata
        if not all(type(x) is int for x in sizes) or getattr(a, "constant", None) is not None:
            return _UNKEYABLE
        return ("tensor", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device, a.requires_grad)
    if isinstance(a, (list, tuple)):
        parts = tuple(_part(x) for x in a)
        return _UNKEYABLE if _UNKEYABLE in parts else (type(a).__name__, parts)
    if isinstance(a, _SCALARS) and a == a:  # typed: 1, 1.0 and True are equal keys otherwise; not a nan
        return (type(a).__name__, a)
    return _UNKEYABLE


def _plain(out: Any) -> bool:
    """A fake result whose every size is an int (not a symbol a later call would need its own of)."""
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            if not all(type(x) is int for x in (*leaf.shape, *leaf.stride(), leaf.storage_offset())):
                return False
        elif not isinstance(leaf, _SCALARS):
            return False
    return True


def fake_like(val: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake tensor of `shape` in `val`'s fake mode, device and (unless given) dtype (NOTE: [Values by
    their metadata]: one per shape, dtype and device)."""
    kwargs = {"dtype": dtype or val.dtype, "device": val.device}
    return fake_value(val.fake_mode, torch.ops.aten.empty.memory_format, (list(shape),), kwargs)


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
