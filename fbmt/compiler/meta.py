"""What fbmt knows about a node, read and written through these functions only.

Every node of a Program carries a few facts in its `meta` dict, under keys no other library uses:

    phase      "fwd" or "bwd" (NOTE: [Phases] in program.py); every node but placeholders and the output
    module     the innermost module path that produced a forward node (the trace)
    block      the block a node belongs to: "" the root, None outside every block (the blocks pass;
               NOTE: [Backward blocks] in passes/blocks.py); absent before the blocks pass
    group      the flat group a collective node serves (the shard pass)
    bucket     the bucket a collective's start is fused into (NOTE: [Buckets] in collectives/)
    recompute  why a backward node repeats a forward one: "activation" (remat) or "param" (shard)

`tag(node, phase=..., block=...)` writes them and the named readers read them; nothing else
touches the keys, so a typo is a NameError, not a fact silently missing. `facts(n)` reads several
at once, to give them to another node. fx copies `meta` with a node (`node_copy`, `graph_copy`),
and with it these facts.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

FWD, BWD = "fwd", "bwd"  # the values of a node's phase

_KEYS = {
    "phase": "fbmt_phase",
    "module": "fbmt_module",
    "block": "fbmt_block",
    "group": "fbmt_group",
    "bucket": "fbmt_bucket",
    "recompute": "fbmt_recompute",
}
_UNSET: Any = object()


def phase(n: fx.Node) -> str | None:
    """ "fwd" or "bwd"; None for a placeholder, the output, or a node not yet stamped."""
    return n.meta.get("fbmt_phase")


def module(n: fx.Node) -> str | None:
    """The innermost module path that produced a forward node ("" the root); None if none did."""
    return n.meta.get("fbmt_module")


def block(n: fx.Node) -> str | None:
    """The node's block ("" the root); None outside every block or not tagged (see `has_block`)."""
    return n.meta.get("fbmt_block")


def has_block(n: fx.Node) -> bool:
    """Whether the node was tagged with a block at all (None included: outside every block)."""
    return "fbmt_block" in n.meta


def group(n: fx.Node) -> int | None:
    """The flat group a collective node serves."""
    return n.meta.get("fbmt_group")


def bucket(n: fx.Node) -> int | None:
    """The bucket a collective's start is fused into; None: a call of its own."""
    return n.meta.get("fbmt_bucket")


def recompute(n: fx.Node) -> str | None:
    """ "activation" or "param" for a backward copy of a forward node; None otherwise."""
    return n.meta.get("fbmt_recompute")


def tag(
    n: fx.Node,
    *,
    phase: str = _UNSET,
    module: str | None = _UNSET,
    block: str | None = _UNSET,
    group: int = _UNSET,
    bucket: int | None = _UNSET,
    recompute: str = _UNSET,
) -> fx.Node:
    """Set the given facts on `n` (`bucket=None` removes it from its bucket); returns `n`."""
    given = dict(phase=phase, module=module, block=block, group=group, bucket=bucket, recompute=recompute)
    for name, value in given.items():
        if value is _UNSET:
            continue
        if name == "bucket" and value is None:
            n.meta.pop(_KEYS[name], None)
        else:
            n.meta[_KEYS[name]] = value
    return n


def tag_missing(n: fx.Node, *, module: str) -> None:
    """Set the module of a node that has none yet (the innermost module tags first)."""
    n.meta.setdefault(_KEYS["module"], module)


def facts(n: fx.Node, *names: str) -> dict[str, Any]:
    """The named facts (all of them when none is named) that `n` has, by name: `tag(other, **facts(n))`
    gives them to another node."""
    return {name: n.meta[_KEYS[name]] for name in names or tuple(_KEYS) if _KEYS[name] in n.meta}


def clear(n: fx.Node, name: str) -> None:
    """Remove one fact from `n`."""
    n.meta.pop(_KEYS[name], None)
