"""The schedule simulator (NOTE: [Simulator]): its cost model on single ops, and that it ranks
schedules and recompute settings the way they must be ranked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fbmt
from fbmt import ops
from fbmt.sim import H200, Machine, _collective, compute_time, flops, simulate
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
        starts = [n for n in program.graph.nodes if n.target in ops.STARTS]
        copies = sum(_collective(n, copies_only)[0] for n in starts)
        work = sum(
            compute_time(n, copies_only)
            for n in program.graph.nodes
            if n.op == "call_function" and n.target not in ops.COLLECTIVES
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
        return sum(_collective(n, H200)[2] for n in program.graph.nodes if n.target in ops.REDUCTIONS)

    assert wire_bytes(ring) == 2 * wire_bytes(narrow)  # fp32 on the wire, not bf16
    assert simulate(narrow, H200).comm_s < simulate(ring, H200).comm_s
