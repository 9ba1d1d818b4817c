"""Schedule: order communication against compute. In a graph, scheduling is moving nodes.

Requires: the collectives of the shard pass (each start right before its wait).
Ensures: the program the strategy made of it, which differs from its input only in where collective
nodes (starts, waits) stand; `verify` then checks that every value is defined before it is read.

NOTE: [Strategies]
A strategy is a plain function registered by name, `fn(program, **options) -> summary`: it moves the
collective nodes of the copy of the program it is given, in place, and says in one line what it did.
`fbmt.compile(schedule=name)` or `schedule=(name, {option: value})` picks it; its keyword arguments
are its options, checked against its signature when the model is compiled, so a misspelt option is
an error then, not a silent default. The helpers below are its vocabulary:

- `collectives(program, phase, role)`: the program's collectives (of role GATHER or REDUCE) as
  `Collective` records (start, wait and release nodes, kind, role, flat group, block, phase, bytes on
  the wire), in the order of their waits, which is the order their results are used in;
- `phase_begin(program, phase)` and `first_compute(program, block, phase)` (`first_computes` for
  every block in one walk): the places to issue at;
- `issue_before(c, anchor)` and `wait_before(c, anchor)`: move a start or a wait, refusing a move that
  would read a value before it is made, with an error that names the collective;
- `fuse(cs, anchor)`: several collectives of one kind issued as one call (a bucket, NOTE: [Buckets]
  in fbmt/compiler/collectives), each still waited where it is.

Moving only starts and waits keeps every strategy a pure reordering: the program computes the same
values with any of them (tests/passes/test_schedule.py trains each on 2 ranks against eager). The
built-in strategies are in `fbmt/compiler/passes/strategies.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from fbmt.compiler import collectives as comm
from fbmt.compiler import meta
from fbmt.compiler.collectives import GATHER, REDUCE, Collective, collectives  # noqa: F401  (strategies' vocabulary)
from fbmt.compiler.decisions import Schedule, compute_digest
from fbmt.compiler.ops import record
from fbmt.compiler.passes.blocks import tag_backward_blocks
from fbmt.compiler.program import Program

Strategy = Callable[..., str]
STRATEGIES: dict[str, Strategy] = {}


def register_strategy(name: str) -> Callable[[Strategy], Strategy]:
    """Register `fn(program, **options) -> summary` as `fbmt.compile(schedule=name)` (NOTE:
    [Strategies]). Its keyword arguments, with their defaults, are the options
    `schedule=(name, {...})` may set."""

    def deco(fn: Strategy) -> Strategy:
        STRATEGIES[name] = fn
        return fn

    return deco


def strategy_options(name: str, options: Mapping[str, Any], *, prefetch: int | None = None) -> dict[str, Any]:
    """The keyword arguments strategy `name` is called with: `options`, checked against its
    signature, and the compile option `prefetch`, where set, as `depth` when the strategy takes a
    depth the options do not set (so `prefetch=2` keeps meaning what it always has); a strategy's
    own default stays where `prefetch` is not set."""
    if name not in STRATEGIES:
        raise ValueError(
            f"fbmt.compile(schedule={name!r}): known strategies are {sorted(STRATEGIES)}; "
            "add one with fbmt.register_strategy"
        )
    params = inspect.signature(STRATEGIES[name]).parameters
    takes = [p for p in list(params)[1:] if params[p].kind in (params[p].KEYWORD_ONLY, params[p].POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        listed = ", ".join(f"{p}={params[p].default!r}" for p in takes) or "none"
        raise ValueError(f"fbmt.compile(schedule={name!r}): unknown option(s) {unknown}; its options are: {listed}")
    out = dict(options)
    for knob in ("depth", "prefetch"):  # `prefetch` was the contract's one argument before options
        if knob in takes and knob not in out:
            if prefetch is not None:
                out[knob] = prefetch
            elif params[knob].default is inspect.Parameter.empty:  # a strategy written to that contract
                out[knob] = 1
    return out


@dataclass(frozen=True)
class ScheduleStats:
    """What the schedule pass did (NOTE: [Pass stats])."""

    strategy: str  # the strategy's name, or "replay" for a saved Schedule
    options: dict[str, Any]  # the options the strategy ran with
    detail: str  # what the strategy said it did, in its own words
    fallback: str | None = None  # why a saved schedule was not replayed (the default strategy ran)

    def __str__(self) -> str:
        return f"{self.strategy}: {self.detail}" + (f" ({self.fallback})" if self.fallback else "")


def schedule_overlap(
    program: Program, *, strategy: str | Schedule = "prefetch", options: Mapping[str, Any] | None = None
) -> tuple[Program, ScheduleStats]:
    """Run the strategy named `strategy` with `options` (its keyword arguments, as `strategy_options`
    checked them when the model was compiled), or replay a saved `Schedule` (then `options` are those of
    "prefetch", for a call of another kind than the one the schedule was taken from)."""
    program = program.copy()
    tag_backward_blocks(program)  # so strategies find every block's backward (NOTE: [Backward blocks])
    options = dict(options or {})
    if isinstance(strategy, Schedule) and strategy.training != program.needs_grad:
        # the same model's other kind of call (an evaluation under no_grad of a replayed training
        # schedule) has no recorded schedule: it gets the default strategy, and says so
        program, stats = schedule_overlap(program, strategy="prefetch", options=options)
        kind = "training" if strategy.training else "forward-only"
        return program, dataclasses.replace(
            stats, fallback=f"the saved schedule is of a {kind} program, this one is not"
        )
    if isinstance(strategy, Schedule):
        detail = replay(program, strategy)
        program.graph.lint()
        return program, ScheduleStats("replay", {}, detail)
    detail = STRATEGIES[strategy](program, **options)
    program.graph.lint()
    return program, ScheduleStats(strategy, options, detail)


def replay(program: Program, schedule: Schedule) -> str:
    """Put every collective node of `program` where `schedule` recorded it (NOTE: [Schedules])."""
    g = program.graph
    nodes = {n.name: n for n in g.nodes}
    where = "; the schedule was taken from another program (other model, inputs or options)"
    if schedule.world_size != program.layout.world_size:
        raise ValueError(
            f"schedule replay: the schedule is for {schedule.world_size} rank(s), the program for "
            f"{program.layout.world_size}{where}"
        )
    placed: dict[int, fx.Node] = {}
    for c in schedule.collectives:
        for name, point in ((c.start, c.issue), (c.wait, c.waited)):
            if name not in nodes:
                raise ValueError(f"schedule replay: {c.name}: the program has no node %{name}{where}")
            placed[point.position] = nodes[name]
        meta.tag(nodes[c.start], bucket=c.bucket)
        if c.release is not None:
            wait = nodes[c.wait]
            release = next((u for u in wait.users if comm.is_release(u)), None)
            if release is None:
                raise ValueError(f"schedule replay: {c.name}: the program never releases %{c.wait}{where}")
            placed[c.release.position] = release
    ours = collectives(program)
    recorded = {c.start for c in schedule.collectives}
    missing = [c for c in ours if c.start.name not in recorded]
    if missing:
        raise ValueError(
            f"schedule replay: the schedule does not place {missing[0].name} (%{missing[0].start.name}){where}"
        )
    if len(g.nodes) != schedule.nodes or compute_digest(g) != schedule.compute:
        raise ValueError(
            f"schedule replay: the program's compute differs from the one the schedule was taken from "
            f"({len(g.nodes)} nodes against {schedule.nodes}){where}"
        )
    moved = set(placed.values())
    stray = next((n for n in g.nodes if comm.is_collective(n.target) and n not in moved), None)
    if stray is not None:
        raise ValueError(f"schedule replay: the schedule does not place %{stray.name}{where}")
    rest = iter(n for n in g.nodes if n not in moved)
    final = [placed[i] if i in placed else next(rest) for i in range(len(g.nodes))]
    previous = None
    for n in final:
        if previous is not None and previous.next is not n:
            previous.append(n)
        previous = n
    return f"replayed {len(schedule.collectives)} collectives of a saved schedule ({schedule.strategy})"


# ---- what strategies read and move ------------------------------------------------------------


def _compute(n: fx.Node) -> bool:
    return n.op == "call_function" and not comm.is_collective(n.target) and n.target not in record.OPS


def phase_begin(program: Program, phase: str) -> fx.Node | None:
    """The first node of `phase` (collective or compute): what issues a collective when the phase
    begins; None for a phase the program lacks (a forward-only program's backward)."""
    return next((n for n in program.graph.nodes if n.op == "call_function" and meta.phase(n) == phase), None)


def first_compute(program: Program, block: str, phase: str) -> fx.Node | None:
    """The first compute node tagged with `block` in `phase` (every forward node carries its
    block, and a backward one the block whose gradients it computes: NOTE: [Backward blocks]);
    None for a block with no compute in that phase. For many blocks, `first_computes` once."""
    return first_computes(program, phase).get(block)


def first_computes(program: Program, phase: str) -> dict[str, fx.Node]:
    """`first_compute` of every block with compute in `phase`, in one walk of the graph (valid while
    compute nodes stay where they are: moving collectives keeps it)."""
    firsts: dict[str, fx.Node] = {}
    for n in program.graph.nodes:
        if _compute(n) and meta.phase(n) == phase and (b := meta.block(n)) is not None and b not in firsts:
            firsts[b] = n
    return firsts


class ScheduleError(RuntimeError):
    """A strategy asked for a move that would read a value before it is made."""


def issue_before(c: Collective, anchor: fx.Node) -> bool:
    """Move `c`'s start right before `anchor`, if that is earlier than where it is; whether it
    moved. A start cannot go before what it reads (a reduction's gradients) or after its wait."""
    if anchor >= c.start:  # fx keeps each node's place as a sort key: comparing nodes is O(1)
        if anchor > c.wait:
            raise ScheduleError(f"{c.name}: cannot be issued at %{anchor.name}, after its own wait %{c.wait.name}")
        return False
    late = [a for a in c.start.all_input_nodes if a >= anchor]
    if late:
        raise ScheduleError(
            f"{c.name}: cannot be issued at %{anchor.name}, before %{late[0].name} that it sends is computed"
        )
    anchor.prepend(c.start)
    return True


def wait_before(c: Collective, anchor: fx.Node) -> None:
    """Move `c`'s wait right before `anchor` (earlier or later). It stays after its start and before
    the first node that reads its result."""
    if anchor <= c.start:
        raise ScheduleError(f"{c.name}: cannot be waited at %{anchor.name}, before it is issued at %{c.start.name}")
    readers = [u for u in c.wait.users if u < anchor]
    if readers:
        first = min(readers)
        raise ScheduleError(f"{c.name}: cannot be waited at %{anchor.name}, after %{first.name} reads its result")
    if anchor is not c.wait:
        anchor.prepend(c.wait)


def fuse(cs: list[Collective], anchor: fx.Node | None = None) -> int | None:
    """Fuse `cs` into one bucket (NOTE: [Buckets] in fbmt/compiler/collectives): their starts moved next to
    each other right before `anchor` (default: right after the last of them is issued), where the
    runtime issues them as one call; each is still waited where its wait stands. They must share a
    kind, phase and dtype on the wire; a start cannot move past its wait or before what it sends.
    The bucket's number; None for fewer than two (nothing to fuse). `cs`' records keep the bucket
    they had: read `collectives()` again for the new one."""
    if len(cs) < 2:
        return None
    keys = {comm.bucket_key(c.start) for c in cs}
    if len(keys) > 1 or not comm.kind_of(cs[0].start).bucketable:
        raise ScheduleError(
            f"cannot fuse {cs[0].name} with {cs[-1].name}: a bucket is one call, of all_gathers or "
            f"reduce_scatters of one phase, ranks and dtype on the wire (they are {sorted(map(str, keys))})"
        )
    g = cs[0].start.graph
    if anchor is None:
        anchor = max(c.start for c in cs).next
    for c in cs:
        if c.wait < anchor:
            raise ScheduleError(
                f"{c.name}: cannot be issued in a bucket at %{anchor.name}, after its own wait %{c.wait.name} "
                "(move the waits after the bucket first: wait_before)"
            )
        late = [a for a in c.start.all_input_nodes if a >= anchor]
        if late:
            raise ScheduleError(
                f"{c.name}: cannot be issued in a bucket at %{anchor.name}, "
                f"before %{late[0].name} that it sends is computed"
            )
    starts = (n for k in comm.kinds() for n in g.find_nodes(op="call_function", target=k.node))  # indexed by fx
    bucket = 1 + max((b for n in starts if (b := meta.bucket(n)) is not None), default=-1)
    for c in cs:
        anchor.prepend(c.start)
        meta.tag(c.start, bucket=bucket)
    return bucket


def large_groups(program: Program, cs: list[Collective], ratio: int = 16) -> list[bool]:
    """For each collective, whether its group is not far smaller than the largest of `cs`
    (NOTE: [Small groups] in strategies.py): `ratio` times its size reaches the largest."""
    sizes = {grp.index: grp.padded_numel for grp in program.layout.groups}
    largest = max((sizes[c.group] for c in cs), default=0)
    return [sizes[c.group] * ratio >= largest for c in cs]
