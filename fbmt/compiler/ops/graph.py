"""Graph helpers the passes share: node order, inserting a node with its fake value, who reads a buffer."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fbmt.compiler import meta
from fbmt.compiler.ops.tables import hint, is_view


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
            with fake.fake_mode:
                node.meta["val"] = target(*vals, **(kwargs or {}))
    return node


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
