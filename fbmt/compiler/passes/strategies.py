"""The built-in schedule strategies, each named for what it models (NOTE: [Strategies] in schedule.py).

    "none"      no overlap: every collective is waited right after it is issued
    "prefetch"  fbmt's: gathers `depth` blocks ahead, small groups not counted; one large gradient
                reduction in flight, overlapping the backward of the blocks before it (the default)
    "fsdp2"     PyTorch FSDP2's defaults: implicit forward prefetch and explicit backward prefetch of
                one module, every module counted; each reduce-scatter waited when the next is issued
    "bmtrain"   BMTrain's TransformerBlockList: the next block of the list gathered while one
                computes; what is outside the list gathered where it is used
    "greedy"    each gather issued as early as a bound on gathered-parameter memory allows
                (DeepCompile-like proactive prefetch)
    "bucket"    consecutive collectives fused into calls of at most `bucket_bytes` (NOTE: [Buckets]),
                each bucket of gathers issued `depth` buckets ahead (DDP's and Megatron's buckets)

A strategy's keyword arguments are its knobs: `fbmt.compile(schedule=("prefetch", {"depth": 2}))`.

NOTE: [Small groups]
A group far smaller than the largest (a final norm's weight) computes too little to hide a gather
behind. "prefetch" does not count it as one of its `depth` steps, and does not wait for the reduction
before it at its own: the final norm's gradient, reduced right after the output layer's, would
otherwise wait for that one at the start of the backward. FSDP2 and BMTrain count every module.
"""

from __future__ import annotations

import torch.fx as fx

from fbmt.compiler import ops
from fbmt.compiler.collectives import kind_of
from fbmt.compiler.ops.graph import size
from fbmt.compiler.passes.schedule import (
    GATHER,
    REDUCE,
    Collective,
    collectives,
    first_computes,
    fuse,
    issue_before,
    large_groups,
    phase_begin,
    register_strategy,
    wait_before,
)
from fbmt.compiler.program import BWD, FWD, Program


@register_strategy("none")
def no_overlap(program: Program) -> str:
    for c in collectives(program):
        if c.start.next is not c.wait:
            c.start.append(c.wait)
    return "each collective is waited right after it is issued"


@register_strategy("prefetch")
def prefetch(program: Program, *, depth: int = 1, small: int = 16) -> str:
    """Each gather issued `depth` blocks ahead of its use; a group `small` times smaller than the
    largest does not count as a block (NOTE: [Small groups])."""
    _positive(depth=depth, small=small)
    moved = 0
    for phase in (FWD, BWD):
        gathers = collectives(program, phase, GATHER)
        moved += gather_ahead(program, gathers, phase, depth, counts=large_groups(program, gathers, small))
    reductions = collectives(program, BWD, REDUCE)
    wait_at_next(program, reductions, counts=large_groups(program, reductions, small))
    return f"{moved} gathers issued {depth} block(s) ahead; {len(reductions)} reduce-scatters overlapped"


@register_strategy("fsdp2")
def fsdp2(program: Program, *, forward_prefetch: int = 1, backward_prefetch: int = 1) -> str:
    """FSDP2 with its defaults, each block a `fully_shard`ed module: the forward all-gather of the
    next module issued as this one starts (the host runs ahead: implicit prefetch), the backward's
    one module ahead (explicit backward prefetch); each reduce-scatter waited when the next one is
    issued, which is when FSDP2 frees the previous one's buffer."""
    _positive(forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch)
    moved = 0
    for phase, depth in ((FWD, forward_prefetch), (BWD, backward_prefetch)):
        gathers = collectives(program, phase, GATHER)
        moved += gather_ahead(program, gathers, phase, depth, counts=[True] * len(gathers))
    reductions = collectives(program, BWD, REDUCE)
    wait_at_next(program, reductions, counts=[True] * len(reductions))
    return f"{moved} gathers issued one module ahead; {len(reductions)} reduce-scatters each waited at the next"


@register_strategy("bmtrain")
def bmtrain(program: Program) -> str:
    """BMTrain's TransformerBlockList: while block i of the list computes, block i+1's parameters
    are gathered (in the forward and in the backward) and block i+1's gradients reduced; what is
    outside the list (embeddings, final norm, head) is gathered where it is used."""
    listed = _block_list(program)
    moved = 0
    for phase in (FWD, BWD):
        gathers = [c for c in collectives(program, phase, GATHER) if c.block in listed]
        moved += gather_ahead(program, gathers, phase, 1, counts=[True] * len(gathers), from_begin=False)
    reductions = collectives(program, BWD, REDUCE)
    wait_at_next(program, reductions, counts=[True] * len(reductions))
    return f"{moved} gathers of the {len(listed)}-block list issued one block ahead"


@register_strategy("greedy")
def greedy(program: Program, *, memory_bound: int | None = None) -> str:
    """Each gather issued as early in its phase as it can be (at the start of an earlier block) while
    the gathered buffers alive at once stay within `memory_bound` bytes (default: three times the
    largest buffer: one in use and two arriving). Gradient reductions as "prefetch" overlaps them."""
    gathers = collectives(program, FWD, GATHER) + collectives(program, BWD, GATHER)
    largest = max((c.bytes for c in gathers), default=0)
    bound = 3 * largest if memory_bound is None else memory_bound
    if bound < 0:
        raise ValueError(f"schedule 'greedy': memory_bound={memory_bound!r} must be at least 0 bytes")
    order = ops.node_order(program.graph)
    end = len(order)
    # each gathered buffer's life in positions of the unmoved order: issued .. released (or the end)
    life = {c.start: [order[c.start], order[c.release] if c.release is not None else end, c.bytes] for c in gathers}

    def peak(lo: float, hi: float, without: object) -> int:
        """The most bytes alive at once over positions [lo, hi], but for `without`'s buffer."""
        events = sorted(
            (x, d) for k, (s, e, b) in life.items() if k is not without for x, d in ((s, b), (e, -b))
        )  # at one position a buffer released comes before one issued
        alive = best = i = 0
        while i < len(events) and events[i][0] <= lo:
            alive += events[i][1]
            i += 1
        best = alive
        while i < len(events) and events[i][0] <= hi:
            alive += events[i][1]
            best = max(best, alive)
            i += 1
        return best

    moved = 0
    for phase in (FWD, BWD):
        cs = [c for c in gathers if c.phase == phase]
        begin = phase_begin(program, phase)
        firsts = first_computes(program, phase)
        anchors = [_anchor(c, firsts) for c in cs]
        for k, c in enumerate(cs):
            issued = life[c.start][0]
            # the places to issue at, earliest first; the later the place, the less is alive over its wait
            places = sorted({order[a] - 0.5: a for a in [begin, *anchors[:k]] if order[a] - 0.5 < issued}.items())
            lo, hi = 0, len(places)  # the first place that fits (hi: none does)
            while lo < hi:
                mid = (lo + hi) // 2
                if peak(places[mid][0], issued, c.start) + c.bytes <= bound:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < len(places) and issue_before(c, places[lo][1]):
                life[c.start][0] = places[lo][0]
                moved += 1
    reductions = collectives(program, BWD, REDUCE)
    wait_at_next(program, reductions, counts=large_groups(program, reductions))
    return f"{moved} gathers issued early within {bound / 2**20:.1f} MiB of gathered parameters"


@register_strategy("bucket")
def bucket(program: Program, *, bucket_bytes: int = 25 * 2**20, depth: int = 1) -> str:
    """Consecutive collectives fused into one call each (NOTE: [Buckets]) while their bytes on the
    wire stay within `bucket_bytes`; one larger than that is a call of its own. Each bucket of gathers
    is issued where the bucket `depth` before it starts being used (the first `depth` when the phase
    begins); the gradient reductions are fused in the order the backward makes them, each bucket
    issued when its last gradient is ready and waited when the next is issued."""
    _positive(bucket_bytes=bucket_bytes, depth=depth)
    calls = members = 0
    for phase in (FWD, BWD):
        buckets = _pack(collectives(program, phase, GATHER), bucket_bytes)
        firsts = first_computes(program, phase)
        anchors = [_anchor(b[0], firsts) for b in buckets]
        begin = phase_begin(program, phase)
        for k, b in enumerate(buckets):
            at = anchors[k - depth] if k >= depth else begin
            if len(b) > 1:
                fuse(b, at)
            else:
                issue_before(b[0], at)
        calls, members = calls + len(buckets), members + sum(map(len, buckets))
    reductions = sorted(collectives(program, BWD, REDUCE), key=lambda c: c.start)
    output = program.output_node()
    for c in reductions:  # out of the way while the buckets form; waited at the next bucket below
        wait_before(c, output)
    runs, run = [], []
    for c in reductions:  # a kind that is never bucketed (all_to_all_reduce) ends a run
        if kind_of(c.start).bucketable:
            run.append(c)
        else:
            runs += [*_pack(run, bucket_bytes), [c]]
            run = []
    runs += _pack(run, bucket_bytes)
    for b in runs:
        fuse(b)
    for b, nxt in zip(runs, [*runs[1:], None]):
        for c in b:
            wait_before(c, nxt[0].start if nxt else output)
    calls, members = calls + len(runs), members + len(reductions)
    return f"{members} collectives in {calls} calls of at most {size(bucket_bytes)}, gathers {depth} bucket(s) ahead"


def _pack(cs: list[Collective], limit: int) -> list[list[Collective]]:
    """`cs` cut into runs of consecutive collectives of at most `limit` bytes in all (one larger is alone)."""
    out: list[list[Collective]] = []
    total = 0
    for c in cs:
        if out and total + c.bytes <= limit:
            out[-1].append(c)
            total += c.bytes
        else:
            out.append([c])
            total = c.bytes
    return out


# ---- the moves they share -------------------------------------------------------------------


def _anchor(c: Collective, firsts: dict[str, fx.Node]) -> fx.Node:
    """Where the block that `c` gathers for starts computing: its first compute node in `firsts`
    (`first_computes` of the phase), or the gather's wait where that comes first."""
    first = firsts.get(c.block)
    return c.wait if first is None or c.wait < first else first


def gather_ahead(
    program: Program, gathers: list[Collective], phase: str, depth: int, *, counts: list[bool], from_begin: bool = True
) -> int:
    """Issue the k-th gather of `gathers` (in order of use) where the block of the gather `depth`
    counted ones before it starts computing; the number moved. With fewer than `depth` counted
    gathers before it, a gather is issued when the phase begins (`from_begin`), or stays put."""
    if not gathers:
        return 0
    firsts = first_computes(program, phase)
    anchors = [_anchor(c, firsts) for c in gathers]
    begin = phase_begin(program, phase)
    moved = 0
    for k, c in enumerate(gathers):
        anchor, ahead = (begin if from_begin else None), 0
        for j in range(k - 1, -1, -1):
            ahead += counts[j]
            if ahead == depth:
                anchor = anchors[j]
                break
        if anchor is not None:
            moved += issue_before(c, anchor)
    return moved


def wait_at_next(program: Program, reductions: list[Collective], *, counts: list[bool]) -> None:
    """Each reduction waited right before the next counted one is issued (the last at the end): one
    flat buffer in flight at a time, overlapping the backward of the blocks before it."""
    counted = [c.start for c, k in zip(reductions, counts) if k]
    output = program.output_node()
    for c in reductions:
        nxt = next((s for s in counted if s > c.start), output)
        wait_before(c, nxt)


def _block_list(program: Program) -> set[str]:
    """The blocks that are items of a list of two or more (`h.0`, `h.1`, ...): BMTrain's
    TransformerBlockList."""
    by_parent: dict[str, list[str]] = {}
    for b in program.layout.blocks:
        parent, _, last = b.rpartition(".")
        if last.isdigit():
            by_parent.setdefault(parent, []).append(b)
    return {b for items in by_parent.values() if len(items) >= 2 for b in items}


def _positive(**knobs: int) -> None:
    for name, v in knobs.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"schedule option {name}={v!r}: must be a whole number, at least 1")
