"""A collective kind, as one row of the table: everything any layer needs to know about it.

NOTE: [Collective kinds]
A kind is a `CollectiveKind`: its IR node (a function whose signature is the node's arguments, in
the layout of its role: `nodes.GATHER` or `nodes.REDUCE`), how it runs on `torch.distributed`
(`implementation`, and `bucketed` for several groups in one call), what it means (`reference`,
synchronous, built from all-gathers: the reference executor runs it), what it costs (`traffic`: the
bytes each rank moves per byte of the buffer, which the simulator divides by a link's bandwidth;
`buffers`: the whole-size buffers it holds until its wait), how `fbmt.calibrate` measures its link
(`probe`), and where the shard pass emits it (`use`). Every layer asks the table, never the kind's
name: the shard pass (`choose`), verify and the schedule helpers (`kind_of`, `bucket_key`), the
partitioner (`implementation`, `bucketed`), the reference executor, the simulator, calibration,
profiles and pictures. Adding a kind is a row and its two implementations (docs/ARCHITECTURE.md
shows one, an all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from fbmt.compiler import meta
from fbmt.compiler.collectives.nodes import GATHER, REDUCE, gather_args, reduction_args, release, wait


class Need(NamedTuple):
    """What the shard pass asks of a group's collective, for a kind's `use` to decide on."""

    world_size: int
    compute_dtype: torch.dtype  # the group's compute dtype
    grads_dtype: torch.dtype | None  # its gradients' dtype; None where they differ (or for a gather)
    wire_dtype: torch.dtype  # the dtype its reduction is asked to sum in
    narrow_wire: bool  # the compile option (NOTE: [Narrow wire] in passes/shard.py)
    host: bool = False  # the group's shard lives in host memory (NOTE: [Offload])


def _always(need: Need) -> bool:
    return True


def wire_dtype(kind: CollectiveKind, need: Need) -> torch.dtype:
    """The dtype a reduction of `kind` sends, for `need`."""
    return kind.sends(need) if kind.sends is not None else need.wire_dtype


def _ring(world: int) -> float:
    return (world - 1) / world


@dataclass(frozen=True)
class CollectiveKind:
    """One collective kind (NOTE: [Collective kinds])."""

    node: Callable
    """The IR node's target: its signature and docstring say what the node means; it does not run."""
    role: str
    """`nodes.GATHER` (a group's shard in, its whole flat buffer out) or `nodes.REDUCE` (a group's
    gradients in, this rank's shard of their reduction out); the role fixes the node's arguments."""
    implementation: Callable
    """Starts it on torch.distributed with the node's arguments; returns a handle `wait` reads."""
    reference: Callable
    """Computes its result synchronously with the node's arguments (the reference executor)."""
    probe: Callable[[int, torch.device], Callable[[bool], Any]]
    """`probe(numel, device)`: a call (asynchronous with True) of it on an fp32 buffer of `numel`
    elements in all, as the runtime issues it: what `fbmt.calibrate` times for its link."""
    traffic: Callable[[int], float] = _ring
    """Bytes each rank sends (and receives) per byte of the whole buffer, by world size: (N-1)/N for
    a ring all-gather or reduce-scatter and for an all-to-all."""
    bucketed: Callable[[list[tuple]], list[Any]] | None = None
    """Several groups' starts as one call (NOTE: [Buckets]): their argument tuples in, a handle per
    member out; None: the kind is never bucketed."""
    buffers: int = 1
    """Whole-size buffers a reduction holds from its start to its wait (the flat input; an
    all-to-all also what it receives)."""
    sends: Callable[[Need], torch.dtype] | None = None
    """A reduction's dtype on the wire, for what the shard pass asks (`Need`); None: the dtype it is
    asked to sum in (`Need.wire_dtype`)."""
    label: str = ""
    """How a pass's summary names its calls beside the role's plain kind ("on a narrow wire:
    all-to-all"); empty for the plain kinds themselves."""
    use: Callable[[Need], bool] = _always
    """Where the shard pass emits this kind for its role (the last row of the role whose `use` holds
    wins: a kind registered later takes precedence where it applies)."""
    host: bool = False
    """The shard lives in host memory (NOTE: [Offload]): a gather's start copies it to the device
    first, a reduction's copies the reduced shard back; the implementation takes the compute device
    as the keyword `device`, which the partitioner binds."""

    @property
    def name(self) -> str:
        return self.node.__name__

    @property
    def bucketable(self) -> bool:
        return self.bucketed is not None


_TABLE: list[CollectiveKind] = []
_BY_NODE: dict[Callable, CollectiveKind] = {}


def register(kind: CollectiveKind) -> CollectiveKind:
    """Add a row to the table (a kind already there by its node is replaced); returns it."""
    if kind.role not in (GATHER, REDUCE):
        raise ValueError(f"collective kind {kind.name}: role must be {GATHER!r} or {REDUCE!r}, not {kind.role!r}")
    unregister(kind.node)
    _TABLE.append(kind)
    _BY_NODE[kind.node] = kind
    return kind


def unregister(node: Callable) -> None:
    """Remove the row of the kind whose IR node is `node`, if there is one."""
    kind = _BY_NODE.pop(node, None)
    if kind is not None:
        _TABLE.remove(kind)


def kinds(role: str | None = None) -> list[CollectiveKind]:
    """The table's rows (of one role, or all), in the order they were added."""
    return [k for k in _TABLE if role is None or k.role == role]


def choose(role: str, need: Need) -> CollectiveKind:
    """The kind the shard pass emits for `role` where `need` holds: the last row whose `use` holds."""
    for k in reversed(_TABLE):
        if k.role == role and k.use(need):
            return k
    raise LookupError(f"no collective kind of role {role!r} applies to {need}")


def named(name: str) -> CollectiveKind | None:
    """The kind of that name (its node's `__name__`), if the table has one."""
    return next((k for k in _TABLE if k.name == name), None)


def kind_of(n: fx.Node | Callable) -> CollectiveKind | None:
    """The kind of a start node (or target); None for anything else."""
    target = n.target if isinstance(n, fx.Node) else n
    try:
        return _BY_NODE.get(target)
    except TypeError:  # an unhashable target is no collective
        return None


def is_start(n: fx.Node) -> bool:
    return n.op == "call_function" and kind_of(n) is not None


def is_gather(n: fx.Node) -> bool:
    k = kind_of(n) if n.op == "call_function" else None
    return k is not None and k.role == GATHER


def is_reduction(n: fx.Node) -> bool:
    k = kind_of(n) if n.op == "call_function" else None
    return k is not None and k.role == REDUCE


def is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is wait


def is_release(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is release


def is_collective(target: Any) -> bool:
    """A start, wait or release target: a node of communication, never compute."""
    return target is wait or target is release or kind_of(target) is not None


def lowered(target: Any) -> str | None:
    """What a node of a partitioned (lowered) graph does: "start" for a kind's implementation (or its
    bucketed one), "wait" for the wait's, None for anything else (what `fbmt.profile` sorts nodes by)."""
    from fbmt.compiler.collectives import torch_impl

    if target is torch_impl.wait:
        return "wait"
    # a reduction runs through its group's sync switch (NOTE: [Accumulation without sync]), which holds it
    target = getattr(target, "implementation", target)
    if any(target is k.implementation or target is k.bucketed for k in _TABLE):
        return "start"
    return None


def wire_bytes(start: fx.Node) -> int:
    """The bytes of the whole flat buffer a start gathers or reduces, as it travels."""
    if is_gather(start):
        shard, world, dtype = gather_args(start)
        value = shard.meta["val"]
        return value.numel() * world * (dtype or value.dtype).itemsize
    r = reduction_args(start)
    return r.padded_numel * r.wire_dtype.itemsize


def host_bytes(start: fx.Node) -> int:
    """The bytes a start of a host kind moves between host and device (NOTE: [Offload]): the shard a
    gather copies in, or the shard gradient a reduction copies out; 0 for any other kind."""
    k = kind_of(start)
    if k is None or not k.host:
        return 0
    if k.role == GATHER:
        value = gather_args(start).shard.meta["val"]
        return value.numel() * value.dtype.itemsize
    r = reduction_args(start)
    return r.padded_numel // r.world_size * r.out_dtype.itemsize


def held_bytes(start: fx.Node) -> int:
    """Bytes a reduction holds from its start to its wait (its `buffers` whole buffers); 0 for a gather,
    whose buffer is its result."""
    k = kind_of(start)
    return k.buffers * wire_bytes(start) if k is not None and k.role == REDUCE else 0


def bucket_key(start: fx.Node) -> tuple:
    """What collectives fused into one call must share (NOTE: [Buckets]): kind, phase, ranks, the
    dtype on the wire, and for reductions whether they average."""
    if is_gather(start):
        g = gather_args(start)
        dtype = g.dtype or g.shard.meta["val"].dtype
        return (start.target.__name__, meta.phase(start), g.world_size, dtype)
    r = reduction_args(start)
    return (start.target.__name__, meta.phase(start), r.world_size, r.wire_dtype, r.average)
