"""The schedule simulator (NOTE: [Simulator]): its cost model on single ops, and that it ranks
schedules and recompute settings the way they must be ranked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fbmt
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta, ops
from fbmt.tools.sim import H200, Machine, _collective, compute_time, flops, simulate
from tests.models.reference import gpt

SLOW_LINK = dataclasses.replace(H200, name="slow link", bus_bandwidth=1e6, latency=1e-3)


def _program(world: int = 4, **options) -> fbmt.Program:
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=3), world_size=world, **options)
    return model.trace(torch.randint(0, 64, (4, 16)))


def test_matmul_and_elementwise_costs_follow_the_roofline():
    mm = next(
        n
        for n in _program().graph.nodes
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "mm.default"
    )
    a, b = mm.args[0].meta["val"], mm.args[1].meta["val"]
    assert flops(mm) == 2 * a.shape[0] * a.shape[1] * b.shape[1]
    fast = Machine(
        "fast", matmul_flops=1e12, memory_bandwidth=1e20, bus_bandwidth=1e9, launch=0.0, fp32_matmul_flops=1e12
    )
    assert compute_time(mm, fast) == pytest.approx(flops(mm) / 1e12)
    byte_bound = dataclasses.replace(fast, matmul_flops=1e30, fp32_matmul_flops=1e30, memory_bandwidth=1e9)
    moved = sum(x.meta["val"].numel() * 4 for x in (mm, mm.args[0], mm.args[1]))
    assert compute_time(mm, byte_bound) == pytest.approx(moved / 1e9)


def test_one_rank_has_no_communication():
    sim = simulate(_program(world=1), SLOW_LINK)
    assert sim.comm_s == 0 and sim.exposed_comm_s == 0 and sim.step_s == pytest.approx(sim.compute_s)


def test_prefetch_hides_communication_that_no_overlap_exposes():
    machine = dataclasses.replace(H200, bus_bandwidth=2e8)  # communication comparable to compute
    overlapped = simulate(_program(schedule="prefetch"), machine)
    serial = simulate(_program(schedule="none"), machine)
    assert serial.comm_s == pytest.approx(overlapped.comm_s)  # the same collectives
    assert serial.exposed_comm_s == pytest.approx(serial.comm_s, rel=1e-6)  # every one waited at once
    assert overlapped.exposed_comm_s < 0.8 * serial.exposed_comm_s
    assert overlapped.step_s < serial.step_s
    assert overlapped.step_s >= max(overlapped.compute_s, overlapped.comm_s)  # no step beats its busiest stream


def test_recompute_trades_time_for_memory():
    sims = {remat: simulate(_program(remat=remat)) for remat in ("none", "mincut", "selective", "block")}
    assert sims["block"].peak_activation_bytes < sims["none"].peak_activation_bytes
    # GPT-2's MLP and norms: every value mincut could recompute is a product's operand (NOTE: [Operands])
    assert (
        sims["selective"].peak_activation_bytes
        < sims["mincut"].peak_activation_bytes
        <= sims["none"].peak_activation_bytes
    )
    assert sims["block"].compute_s > sims["none"].compute_s  # the recomputed forward costs time
    assert "exposed communication" in str(sims["block"])


def test_zero2_keeps_gathered_parameters_and_gathers_less():
    zero3, zero2 = simulate(_program(zero=3)), simulate(_program(zero=2))
    assert zero2.comm_s < zero3.comm_s  # one all-gather per block instead of two
    assert zero2.peak_activation_bytes > zero3.peak_activation_bytes  # gathered buffers live to the backward


def test_collective_copies_run_on_the_communication_stream_when_there_is_one():
    """NOTE: [Copy stream]: the casts and gradient copy-ins of 2 ranks occupy the communication
    stream, not the compute stream; on one rank (no collective to wait for) they are compute."""
    mixed = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    copies_only = Machine(
        "copies only",
        matmul_flops=1e30,
        memory_bandwidth=1e9,
        bus_bandwidth=1e30,
        launch=0.0,
        latency=0.0,
        fp32_matmul_flops=1e30,
    )
    for world in (1, 2):
        program = _program(world=world, **mixed)
        sim = simulate(program, copies_only)
        starts = [n for n in program.graph.nodes if comm.is_start(n)]
        copies = sum(_collective(n, copies_only)[0] for n in starts)
        work = sum(
            compute_time(n, copies_only)
            for n in program.graph.nodes
            if n.op == "call_function" and not comm.is_collective(n.target)
        )
        assert len(starts) > 0 and copies > 0
        if world == 2:
            assert sim.compute_s == pytest.approx(work) and sim.comm_s == pytest.approx(copies)
        else:
            assert sim.comm_s == 0 and sim.compute_s == pytest.approx(work + copies)


def test_the_simulator_charges_the_wire_the_program_chose():
    """NOTE: [Narrow wire]: the shard pass decides the dtype on the wire; the simulator charges it."""
    mixed = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    narrow, ring = _program(narrow_wire=True, **mixed), _program(narrow_wire=False, **mixed)

    def wire_bytes(program):
        return sum(_collective(n, H200)[2] for n in program.graph.nodes if comm.is_reduction(n))

    assert wire_bytes(ring) == 2 * wire_bytes(narrow)  # fp32 on the wire, not bf16
    assert simulate(narrow, H200).comm_s < simulate(ring, H200).comm_s


# ---- what a simulation reports -------------------------------------------------------------------


def test_each_collective_is_recorded_with_its_bytes_and_the_stall_of_its_wait():
    program = _program(schedule="none")
    sim = simulate(program, SLOW_LINK)
    starts = program.collectives()
    assert len(sim.collectives) == len(starts)
    by_node = {c.node: c for c in sim.collectives}
    for n in starts:
        c = by_node[n.name]
        assert c.bytes == fbmt.compiler.collectives.wire_bytes(n) > 0 and c.group == meta.group(n)
        assert c.issued <= c.began <= c.ended and c.exposed == pytest.approx(c.ended - c.waited)  # waited at once
    assert sum(c.exposed for c in sim.collectives) == pytest.approx(sim.exposed_comm_s)
    table = sim.table().splitlines()
    assert len(table) == 1 + len(starts) and "fwd all_gather h.0" in sim.table()


def test_the_memory_curve_is_split_by_kind_and_peaks_at_the_reported_peak():
    gathered_at_turn = {}
    for zero in (3, 2):
        program = _program(zero=zero)
        sim = simulate(program)
        curve = sim.memory
        assert curve.peak == sim.peak_activation_bytes == fbmt.sim.peak_memory(program)
        assert len(curve.nodes) == len(curve.times) == len(curve.activations) == len(curve.gathered)
        assert sum(b for _, _, b in curve.alive_at_peak) == curve.peak
        assert max(curve.gradients) > 0 and max(curve.gathered) > 0
        turn = next(i for i, n in enumerate(program.graph.nodes) if meta.phase(n) == "bwd")
        gathered_at_turn[zero] = curve.gathered[turn]
    # ZeRO-2 holds every block's gathered buffer from its forward to its backward
    assert gathered_at_turn[2] > 2 * gathered_at_turn[3]


def test_the_chrome_trace_has_every_node_and_collective(tmp_path):
    sim = simulate(_program(schedule="none"), SLOW_LINK)
    trace = sim.chrome_trace(str(tmp_path / "t.json"))
    import json

    assert json.loads((tmp_path / "t.json").read_text()) == trace
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sum(e["tid"] == 1 for e in slices) == len(sim.collectives)
    assert sum(e["cat"] == "exposed" for e in slices) == sum(c.exposed > 0 for c in sim.collectives)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert max(sum(e["args"].values()) for e in counters) == sim.peak_activation_bytes


def test_a_machine_profile_prices_each_collective_kind_and_product_size(tmp_path):
    program = _program()
    slow_scatter = dataclasses.replace(SLOW_LINK, links=(("reduce_scatter", 1e-3, 1e4),))
    gathers = [n for n in program.collectives() if comm.is_gather(n)]
    scatters = [n for n in program.collectives() if n.target is comm.reduce_scatter]
    assert _collective(gathers[0], slow_scatter) == _collective(gathers[0], SLOW_LINK)
    assert _collective(scatters[0], slow_scatter)[1] > 5 * _collective(scatters[0], SLOW_LINK)[1]
    rated = dataclasses.replace(H200, matmul_rates=(("float32", 1e6, 1e9), ("float32", 1e8, 1e11)))
    assert rated.matmul_rate(1e6, torch.float32) == pytest.approx(1e9)
    assert rated.matmul_rate(1e7, torch.float32) == pytest.approx(1e10)  # log-log between the two
    assert rated.matmul_rate(1e12, torch.float32) == pytest.approx(1e11)  # clamped
    assert rated.matmul_rate(1e7, torch.bfloat16) == H200.matmul_flops  # no measurement: the flat rate
    rated.save(str(tmp_path / "m.json"))
    assert Machine.load(str(tmp_path / "m.json")) == rated


def test_compute_slows_while_a_collective_is_in_flight_by_the_measured_factor():
    program = _program(schedule="prefetch")
    machine = dataclasses.replace(H200, bus_bandwidth=2e8)
    plain, slowed = simulate(program, machine), simulate(program, dataclasses.replace(machine, comm_slowdown=0.5))
    assert plain.compute_s < slowed.compute_s <= 1.5 * plain.compute_s
    alone = simulate(_program(world=1), dataclasses.replace(machine, comm_slowdown=0.5))
    assert alone.compute_s == pytest.approx(simulate(_program(world=1), machine).compute_s)  # nothing to share with


def test_simulate_uses_the_calibrated_profile_of_this_host(tmp_path, monkeypatch):
    monkeypatch.setenv("FBMT_MACHINE", str(tmp_path / "m.json"))
    assert simulate(_program()).machine == H200  # none saved yet
    mine = dataclasses.replace(SLOW_LINK, name="this host")
    mine.save(str(tmp_path / "m.json"))
    assert simulate(_program()).machine == mine
    assert "simulated on this host" in str(simulate(_program()))


def test_a_model_built_and_compiled_on_meta_simulates_without_memory():
    # docs/tools.md's recipe: nothing is allocated, so nothing can be initialized or checked
    from fbmt.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=2, d_model=64))
    model = fbmt.compile(model, world_size=8, device="meta", param_dtype=torch.bfloat16)
    sim = simulate(model.trace(torch.zeros(2, 64, dtype=torch.long), device="cpu"), H200)
    assert sim.world_size == 8 and sim.step_s > 0 and sim.peak_activation_bytes > 0


def test_a_bucket_is_one_call_and_holds_its_buffer_until_cut():
    """NOTE: [Buckets]: one latency per call, not per member; the gathered bucket and its send
    buffer live beside its members' buffers until it is cut at the first wait."""
    separate = simulate(_program(world=8, schedule="prefetch"), H200)
    program = _program(world=8, schedule=("bucket", {"bucket_bytes": 2**30}))
    fused = simulate(program, H200)
    calls = len({(c.kind, c.phase) for c in fused.collectives})  # one bucket per kind and phase
    assert calls == 3 and len(fused.collectives) == len(separate.collectives)
    assert fused.comm_s == pytest.approx(separate.comm_s - (len(separate.collectives) - calls) * H200.latency)
    forward = [c for c in fused.collectives if c.phase == "fwd"]
    assert len({(c.began, c.ended) for c in forward}) == 1  # the members share the call's times
    # the members' buffers, the bucket's and what it sent (a shard of each member)
    assert max(fused.memory.gathered) == sum(c.bytes for c in forward) * (2 + 1 / 8)


def test_what_a_collective_allocates_while_it_runs_counts_where_the_machine_says_so():
    program = _program(world=2, schedule="none")
    plain = simulate(program, SLOW_LINK)
    gloo = simulate(program, dataclasses.replace(SLOW_LINK, comm_buffer=1.0))
    assert gloo.step_s == plain.step_s
    # with no overlap, each collective runs between its start and its wait: its copy is alive beside it
    c = max(gloo.collectives, key=lambda c: c.bytes)
    at = gloo.memory.nodes.index(c.node)
    assert gloo.memory.total[at] == plain.memory.total[at] + c.bytes
    assert gloo.memory.total[at - 1] == plain.memory.total[at - 1]  # not before it is issued


def test_a_reduce_scatter_holds_its_copy_until_its_wait_and_an_all_gather_until_it_ends():
    # gloo frees an all-gather's flat copy when the transfer ends; a reduce-scatter's copy belongs to
    # its work object, which lives until the wait: on a fast link the first is gone long before its
    # wait, the second is not (measured on 2 gloo ranks with benchmarks/predict.py's model)
    program = _program(world=2)  # the default schedule: collectives overlap compute
    instant = dataclasses.replace(H200, latency=0.0, bus_bandwidth=1e18)  # each transfer ends where it begins
    sim = simulate(program, dataclasses.replace(instant, comm_buffer=1.0))
    extra = [a - b for a, b in zip(sim.memory.total, simulate(program, instant).memory.total)]
    index = {name: i for i, name in enumerate(sim.memory.nodes)}
    wait_of = {w.args[0].name: index[w.name] for w in program.graph.find_nodes(op="call_function", target=comm.wait)}
    early = [c for c in sim.collectives if wait_of[c.node] - index[c.node] > 2]  # issued well before the wait
    reductions = [c for c in early if c.kind == "reduce_scatter"]
    gathers = [c for c in early if c.kind == "all_gather" and c.phase == "fwd"]  # no reduction runs beside them
    assert reductions and gathers
    assert all(extra[wait_of[c.node] - 1] >= c.bytes for c in reductions)
    starts = {index[c.node] for c in sim.collectives}
    checked = 0
    for c in gathers:
        assert extra[index[c.node]] >= c.bytes  # counted while it runs
        later = range(index[c.node] + 1, wait_of[c.node])
        ended = [i for i in later if i not in starts and sim.memory.times[i] > c.ended]
        if ended:  # and gone once it has ended, before its wait
            assert extra[ended[0]] == 0
            checked += 1
    assert checked


def _node(program: fbmt.Program, name: str) -> torch.fx.Node:
    return next(n for n in program.graph.nodes if n.op == "call_function" and ops.tables.op_name(n.target) == name)


def test_attention_and_slow_elementwise_ops_take_the_rates_the_machine_measured():
    program = _program()
    attention = _node(program, "_scaled_dot_product_flash_attention_for_cpu")
    backward = _node(program, "_scaled_dot_product_flash_attention_for_cpu_backward")
    gelu = _node(program, "gelu")
    plain = dataclasses.replace(H200, launch=0.0, memory_bandwidth=1e30)  # no op is bound by its bytes
    # without measured attention, it runs at the product rate
    assert compute_time(attention, plain) == pytest.approx(flops(attention) / plain.matmul_rate(1.0, torch.float32))
    measured = dataclasses.replace(
        plain,
        attention_rates=(("float32", 1e3, 1e9), ("float32", 1e12, 4e9)),
        elementwise_rates=(("gelu", 1e6),),
    )
    for n in (attention, backward):  # forward and backward, interpolated by FLOPs in log-log
        rate = measured.attention_rate(flops(n), torch.float32)
        assert 1e9 < rate < 4e9 and compute_time(n, measured) == pytest.approx(flops(n) / rate)
    assert flops(backward) == pytest.approx(2.5 * flops(attention))
    x = gelu.args[0].meta["val"]
    assert compute_time(gelu, measured) == pytest.approx(x.numel() / 1e6)  # slower than its bytes move
    assert compute_time(gelu, plain) < compute_time(gelu, measured)
    fast = dataclasses.replace(measured, elementwise_rates=(("gelu", 1e30),))
    assert compute_time(gelu, fast) == compute_time(gelu, plain)  # the roofline when that is longer
    assert Machine.from_dict(measured.to_dict()) == measured


def test_a_collective_runs_slower_beside_compute_and_at_full_speed_once_its_wait_stalls():
    overlapped, serial = _program(world=2), _program(world=2, schedule="none")
    stretched = dataclasses.replace(SLOW_LINK, comm_stretch=1.0)
    # with no overlap nothing runs beside a collective: its wait follows its start
    assert simulate(serial, stretched).step_s == pytest.approx(simulate(serial, SLOW_LINK).step_s)
    # beside compute it runs twice as slow, and what is left when the wait stalls runs at full speed
    plain, slow = simulate(overlapped, SLOW_LINK), simulate(overlapped, stretched)
    assert slow.step_s > plain.step_s
    for a, b in zip(plain.collectives, slow.collectives):
        assert a.node == b.node
        took, alone = b.ended - b.began, a.ended - a.began
        assert alone * (1 - 1e-9) <= took <= 2 * alone * (1 + 1e-9)
        if b.exposed:  # it stalled the compute stream, having run beside compute until its wait
            beside = max(0.0, b.waited - b.began)
            assert took == pytest.approx(beside + (alone - beside / 2))


def test_a_backend_with_two_workers_runs_two_collectives_at_once():
    program = _program(world=2)
    one = simulate(program, SLOW_LINK)
    two = simulate(program, dataclasses.replace(SLOW_LINK, comm_lanes=2))  # gloo's two threads
    queued = [c for c in one.collectives if c.began > c.issued]  # behind another on the one stream
    assert queued and two.step_s < one.step_s
    by_name = {c.node: c for c in two.collectives}
    assert any(by_name[c.node].began < c.began for c in queued)
    for c in two.collectives:  # never more than two at once, each started in issue order
        running = [o for o in two.collectives if o.began <= c.began < o.ended]
        assert len(running) <= 2
        assert all(o.began <= c.began for o in two.collectives if o.issued < c.issued)
