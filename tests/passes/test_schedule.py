"""The schedule pass and its strategies: where gathers are issued and reductions waited; that a
strategy only reorders; and a strategy registered by a user."""

from __future__ import annotations

import pytest
import torch

import fbmt
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta, ops
from fbmt.compiler.collectives import GATHER, REDUCE
from fbmt.compiler.ops.record import OPS as RECORDING
from fbmt.compiler.passes import STRATEGIES, schedule_overlap
from fbmt.compiler.program import BWD, FWD, format_graph
from tests.dist import run_ranks
from tests.models.reference import batch, gpt
from tests.passes import strategies  # noqa: F401  (registers "all-at-start")
from tests.passes.helpers import (
    REDUCTIONS,
    apply,
    assert_same_results,
    nodes,
    run,
    tangents_for,
    through,
    traced,
)


def _communication_or_recording(n) -> bool:
    return comm.is_collective(n.target) or n.target in RECORDING


def _program(n_layer: int = 3, world: int = 8, **cfg):
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=n_layer), world_size=world, checks=True, **cfg)
    (idx,), _, tgt = batch("gpt", 0)
    return model.trace(idx, tgt)


def _first_compute(program, block: str, phase: str) -> int:
    nodes_ = list(program.graph.nodes)
    return min(
        i
        for i, n in enumerate(nodes_)
        if meta.block(n) == block
        and meta.phase(n) == phase
        and n.op == "call_function"
        and not _communication_or_recording(n)
    )


def _gather_at(program, phase: str) -> dict[int, int]:
    pos = ops.node_order(program.graph)
    return {meta.group(n): pos[n] for n in nodes(program, comm.all_gather, phase)}


@pytest.mark.parametrize("strategy", ["prefetch", "none"])
def test_a_strategy_only_reorders_the_program(strategy):
    torch.manual_seed(0)
    model = gpt(n_layer=3)
    idx = torch.randint(0, 64, (2, 16))
    before = through(traced(model, idx), "schedule")
    after, stats = apply(
        schedule_overlap, before, strategy=strategy, options={"depth": 1} if strategy == "prefetch" else {}
    )
    assert stats.strategy == strategy and str(stats).startswith(f"{strategy}: ")
    assert sorted(n.name for n in after.graph.nodes) == sorted(n.name for n in before.graph.nodes)
    tangents = tangents_for(before)
    assert_same_results(run(before, model, [idx], tangents), run(after, model, [idx], tangents), rtol=0, atol=0)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_issues_each_gather_that_many_blocks_ahead(prefetch):
    program = _program(n_layer=4, schedule="prefetch", prefetch=prefetch)
    groups = {g.block: g.index for g in program.layout.groups}
    start = _gather_at(program, FWD)
    for i in range(4 - prefetch):
        ahead, before = groups[f"h.{i + prefetch}"], _first_compute(program, f"h.{i}", FWD)
        assert start[ahead] < before, f"h.{i + prefetch} is not gathered before h.{i} computes"
        if i + prefetch + 1 < 4:  # and no further ahead
            assert start[groups[f"h.{i + prefetch + 1}"]] > before, f"h.{i + prefetch + 1} gathered too early"
    assert program.stats("schedule").options == {"depth": prefetch}  # the option is the strategy's depth


def test_reductions_overlap_the_backward_of_earlier_blocks():
    program = _program(schedule="prefetch")
    nodes_ = list(program.graph.nodes)
    pos = ops.node_order(program.graph)
    rs = nodes(program, REDUCTIONS, BWD)
    later = [
        n
        for n in nodes_[pos[rs[0]] + 1 :]
        if meta.phase(n) == BWD and not _communication_or_recording(n) and n.op == "call_function"
    ]
    assert later, "the first reduce-scatter should overlap later backward compute"
    waits = [next(iter(r.users)) for r in rs]
    for r, w in zip(rs[:-1], waits[:-1]):  # each waited right before a later one is issued, the last at the end
        assert w.next in rs and pos[w.next] > pos[r], w
    assert waits[-1].next.op == "output"


class _Norm(torch.nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class _Decoder(torch.nn.Module):
    """Linear blocks, a final norm and an untied output layer, as Llama ends."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
        self.norm, self.output = _Norm(), torch.nn.Linear(32, 64, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.output(self.norm(x)).sum()


def test_a_small_groups_reduction_does_not_wait_for_the_one_before():
    # NOTE: [Small groups]: the final norm's gradient is reduced right after the output layer's; were it
    # counted, the backward would wait there for the output layer's reduce-scatter to finish
    torch.manual_seed(0)
    program = fbmt.compile(_Decoder(), world_size=2, checks=True).trace(torch.randn(4, 8, 32))
    pos = ops.node_order(program.graph)
    groups = {g.block: g.index for g in program.layout.groups}
    starts = {meta.group(n): n for n in nodes(program, REDUCTIONS, BWD)}
    waits = {g: next(u for u in n.users if u.target is comm.wait) for g, n in starts.items()}
    assert pos[starts[groups["output"]]] < pos[starts[groups["norm"]]]
    assert pos[waits[groups["output"]]] > pos[starts[groups["norm"]]]
    assert pos[waits[groups["output"]]] < pos[starts[groups["layers.1"]]]  # still one large one in flight


def test_backward_gathers_its_first_block_when_the_backward_begins():
    # ln_f's weights are too few to hide a gather behind: h.2's gather must not wait for them
    program = _program(schedule="prefetch")
    nodes_ = list(program.graph.nodes)
    groups = {g.block: g.index for g in program.layout.groups}
    first_bwd = next(
        i
        for i, n in enumerate(nodes_)
        if n.op == "call_function" and meta.phase(n) == BWD and not _communication_or_recording(n)
    )
    start = _gather_at(program, BWD)
    assert start[groups["ln_f"]] < first_bwd and start[groups["h.2"]] < first_bwd
    assert start[groups["h.1"]] > first_bwd  # one block ahead, not all of them


def test_no_overlap_waits_right_after_each_start():
    program = _program(schedule="none")
    for n in program.collectives():
        assert n.next.target is comm.wait and n.next.args[0] is n


def _trains_with_the_registered_strategy(rank: int, world: int) -> None:
    from tests.workers import compare, eager_reference, train_compiled

    compare(
        train_compiled("gpt", rank, world, dict(schedule="all-at-start")),
        eager_reference("gpt"),
        f"gpt on {world} ranks with a registered strategy",
        buffers=False,
    )


def test_a_registered_strategy_is_used_by_name_and_trains_as_eager():
    assert "all-at-start" in STRATEGIES  # registered by importing tests.passes.strategies
    program = _program(schedule="all-at-start")
    stats = program.stats("schedule")
    assert stats.strategy == "all-at-start" and "when their phase begins" in stats.detail  # the strategy's own line
    first = min(_first_compute(program, g.block, FWD) for g in program.layout.groups)
    assert all(at < first for at in _gather_at(program, FWD).values())
    run_ranks(2, _trains_with_the_registered_strategy)


def test_an_unknown_strategy_names_the_known_ones():
    with pytest.raises(ValueError, match="schedule='fastest'.*known strategies.*register_strategy"):
        fbmt.compile(gpt(), schedule="fastest")


# ---- the built-in strategies and their options -------------------------------------------------

BUILT_IN = ("none", "prefetch", "fsdp2", "bmtrain", "greedy", "bucket")
# the test GPT's groups are 1-13 KiB: 20 KB fuses pairs, 1 byte none (a call each)
OPTIONED = [("greedy", {"memory_bound": 0}), ("prefetch", {"depth": 2}), ("bucket", {"bucket_bytes": 20000})]


def _trains_with_every_built_in_strategy(rank: int, world: int) -> None:
    from tests.workers import compare, eager_reference, train_compiled

    want = eager_reference("gpt")
    for schedule in [*BUILT_IN, *OPTIONED]:
        for zero in (3, 2):
            got = train_compiled("gpt", rank, world, dict(schedule=schedule, zero=zero))
            compare(got, want, f"gpt on {world} ranks, schedule={schedule!r}, zero={zero}", buffers=False)
    # a bucket's shard gradients are views of one output: accumulated over two backward calls
    got = train_compiled("gpt", rank, world, dict(schedule="bucket"), accum=2)
    compare(got, want, f"gpt on {world} ranks, schedule='bucket', 2 micro-batches", buffers=False)


def test_every_built_in_strategy_trains_as_eager():
    assert set(BUILT_IN) <= set(STRATEGIES)
    run_ranks(2, _trains_with_every_built_in_strategy)


@pytest.mark.parametrize("strategy", BUILT_IN)
def test_every_built_in_strategy_only_moves_collectives(strategy):
    torch.manual_seed(0)
    model = gpt(n_layer=3)
    idx = torch.randint(0, 64, (2, 16))
    before = through(traced(model, idx), "schedule", zero=2)
    after, _ = apply(schedule_overlap, before, strategy=strategy)
    compute = [n.name for n in before.graph.nodes if not comm.is_collective(n.target)]
    assert [n.name for n in after.graph.nodes if not comm.is_collective(n.target)] == compute
    tangents = tangents_for(before)
    assert_same_results(run(before, model, [idx], tangents), run(after, model, [idx], tangents), rtol=0, atol=0)


def test_strategy_options_are_passed_and_checked():
    deep = _program(n_layer=4, schedule=("prefetch", {"depth": 2}))
    assert deep.stats("schedule").options == {"depth": 2}
    assert format_graph(deep) == format_graph(_program(n_layer=4, prefetch=2))
    with pytest.raises(ValueError, match=r"schedule='prefetch'.*unknown option\(s\) \['dept'\].*depth=1, small=16"):
        fbmt.compile(gpt(), schedule=("prefetch", {"dept": 2}))
    with pytest.raises(TypeError, match="expected a strategy's name"):
        fbmt.compile(gpt(), schedule=("prefetch", 2))


def _gathered_peak(program) -> int:
    """The most gathered-parameter bytes alive at once, in program order."""
    from fbmt.compiler.collectives import collectives

    order = ops.node_order(program.graph)
    end = len(order)
    lives = [
        (order[c.start], order[c.release] if c.release else end, c.bytes) for c in collectives(program, None, GATHER)
    ]
    return max(sum(b for s, e, b in lives if s <= p < e) for p in range(end))


def test_greedy_issues_gathers_as_early_as_its_memory_bound_allows():
    none = _program(n_layer=4, schedule="none")
    largest = max(c for c in (g.padded_numel * g.dtype.itemsize for g in none.layout.groups))
    bound = 3 * largest
    greedy = _program(n_layer=4, schedule=("greedy", {"memory_bound": bound}))
    assert _gathered_peak(greedy) <= bound < _gathered_peak(_program(n_layer=4, schedule="all-at-start"))
    assert _gathered_peak(greedy) > _gathered_peak(none)  # it did prefetch
    # with no room beyond what the program holds anyway, no gather moves; with all the room, all go first
    unmoved = _program(n_layer=4, schedule=("greedy", {"memory_bound": 0}))
    assert _gather_at(unmoved, FWD) == _gather_at(none, FWD)
    everything = _program(n_layer=4, schedule=("greedy", {"memory_bound": 2**40}))
    first = min(_first_compute(everything, g.block, FWD) for g in everything.layout.groups)
    assert all(at < first for at in _gather_at(everything, FWD).values())


def test_fsdp2_counts_every_module_where_prefetch_skips_small_ones():
    torch.manual_seed(0)
    program = fbmt.compile(_Decoder(), world_size=2, checks=True, schedule="fsdp2").trace(torch.randn(4, 8, 32))
    groups = {g.block: g.index for g in program.layout.groups}
    starts = {meta.group(n): n for n in nodes(program, REDUCTIONS, BWD)}
    waits = {g: next(u for u in n.users if u.target is comm.wait) for g, n in starts.items()}
    # the output layer's reduction is waited when the final norm's is issued (FSDP2 frees it then)
    assert waits[groups["output"]].next is starts[groups["norm"]]


def test_bmtrain_prefetches_within_the_block_list_only():
    program = _program(n_layer=4, schedule="bmtrain")
    groups = {g.block: g.index for g in program.layout.groups}
    for c in program.schedule().collectives:
        if c.kind == "all_gather" and c.block in ("wte", "wpe", "ln_f", "lm_head"):
            assert c.issue.position == c.waited.position - 1, f"{c.name} is not gathered where it is used"
    start = _gather_at(program, FWD)
    for i in range(3):
        assert start[groups[f"h.{i + 1}"]] < _first_compute(program, f"h.{i}", FWD)
    assert start[groups["h.0"]] > _first_compute(program, "wpe", FWD)  # not before the list begins


def test_a_move_that_reads_a_value_too_early_is_refused_naming_the_collective():
    from fbmt.compiler.passes.schedule import ScheduleError, collectives, issue_before, phase_begin

    program = _program().copy()
    reduction = collectives(program, BWD, REDUCE)[0]
    with pytest.raises(ScheduleError, match=r"bwd reduce_scatter of group \d+ \(.*\): cannot be issued at .* before"):
        issue_before(reduction, phase_begin(program, BWD))


def test_a_strategys_own_default_depth_holds_unless_prefetch_is_set():
    calls = []

    @fbmt.register_strategy("records-its-depth")
    def records(program, *, depth: int = 3) -> str:
        calls.append(depth)
        return f"depth {depth}"

    _program(schedule="records-its-depth")
    _program(schedule="records-its-depth", prefetch=2)
    _program(schedule=("records-its-depth", {"depth": 4}), prefetch=2)
    assert calls == [3, 2, 4]


# ---- buckets (NOTE: [Buckets] in fbmt/compiler/collectives/) --------------------------------------


def _buckets(program) -> list[list]:
    """The program's buckets, each its members' Collective records in program order."""
    from fbmt.compiler.collectives import collectives

    order = ops.node_order(program.graph)
    by: dict[int, list] = {}
    for c in sorted(collectives(program), key=lambda c: order[c.start]):
        if c.bucket is not None:
            by.setdefault(c.bucket, []).append(c)
    return list(by.values())


def test_bucket_fuses_consecutive_collectives_within_its_bytes():
    limit = 20000  # the test GPT's groups are 128 B to 13 KiB: a block's and a small neighbour's fit
    program = _program(n_layer=4, schedule=("bucket", {"bucket_bytes": limit}))
    buckets = _buckets(program)
    assert buckets, program.summary("schedule")
    order = ops.node_order(program.graph)
    for members in buckets:
        assert len({(c.kind, c.phase) for c in members}) == 1, members
        assert sum(c.bytes for c in members) <= limit
        starts = sorted(order[c.start] for c in members)
        assert starts == list(range(starts[0], starts[0] + len(members))), "members do not stand together"
        assert all(order[c.wait] > starts[-1] for c in members), "a member is waited before the bucket is issued"
    # with all the room, each phase's gathers are one call and the reductions another
    one = _buckets(_program(n_layer=4, schedule=("bucket", {"bucket_bytes": 2**30})))
    assert [(m[0].kind, m[0].phase, len(m)) for m in one] == [
        ("all_gather", FWD, 7),
        ("all_gather", BWD, 5),
        ("reduce_scatter", BWD, 7),
    ]
    # a byte fuses nothing: every collective is its own call
    assert not _buckets(_program(n_layer=4, schedule=("bucket", {"bucket_bytes": 1})))


def test_a_bucket_runs_as_one_call_of_its_fused_implementation():
    from fbmt.compiler.collectives import torch_impl as impl
    from fbmt.compiler.runtime.partition import partition

    program = _program(n_layer=3, world=2, schedule=("bucket", {"bucket_bytes": 2**30}))
    exe = partition(program)

    def runs(n: torch.fx.Node) -> object:  # a reduction runs through its groups' sync switch, which holds it
        return getattr(n.target, "implementation", n.target)

    for gm, kinds in (
        (exe.forward, [impl.all_gather_bucket]),
        (exe.backward, [impl.all_gather_bucket, impl.reduce_scatter_bucket]),
    ):
        fused = [
            runs(n)
            for n in gm.graph.nodes
            if n.op == "call_function" and runs(n) in (impl.all_gather_bucket, impl.reduce_scatter_bucket)
        ]
        assert fused == kinds
        assert not any(runs(n) in (impl.all_gather, impl.reduce_scatter) for n in gm.graph.nodes)


def test_fuse_refuses_collectives_one_call_cannot_carry():
    from fbmt.compiler.passes.schedule import ScheduleError, collectives, fuse

    program = _program().copy()
    gather, reduction = collectives(program, BWD, GATHER)[0], collectives(program, BWD, REDUCE)[0]
    with pytest.raises(ScheduleError, match="a bucket is one call, of all_gathers or reduce_scatters of one phase"):
        fuse([gather, reduction])
    first, second = collectives(program, FWD, GATHER)[:2]
    with pytest.raises(
        ScheduleError, match=r"fwd all_gather of group \d+ .*: cannot be issued in a bucket at .* after its own wait"
    ):
        fuse([first, second], second.wait.next)
