"""`fbmt.calibrate` measures this machine into a profile the simulator then uses; `fbmt.profile`
measures a compiled program node by node, and the two compare (NOTE: [Calibration], [Profile])."""

from __future__ import annotations

import pytest
import torch

import fbmt
from fbmt.tools.calibration import _fit
from fbmt.tools.sim import Machine
from tests.dist import run_ranks


def test_the_link_fit_recovers_latency_and_bandwidth():
    xs = [2.0**k for k in range(16, 24, 2)]
    latency, per_byte = _fit(xs, [1e-4 + x / 2e9 for x in xs])
    assert latency == pytest.approx(1e-4) and 1 / per_byte == pytest.approx(2e9)
    latency, per_byte = _fit(xs, [x / 1e9 - 1e-6 for x in xs])  # noise below zero latency: through the origin
    assert latency == 0 and 1 / per_byte == pytest.approx(1e9, rel=1e-2)


def test_calibrate_measures_products_copies_nodes_and_every_collective_kind(tmp_path, monkeypatch):
    path = str(tmp_path / "m.json")
    machine = fbmt.calibrate(ranks=2, quick=True, path=path, log=lambda *a, **k: None)
    assert Machine.load(path) == machine
    assert machine.matmul_rates and all(d == "float32" and r > 1e6 for d, _, r in machine.matmul_rates)
    assert machine.memory_bandwidth > 1e8 and 0 < machine.launch < 1e-3
    assert sorted(k for k, _, _ in machine.links) == ["all_gather", "all_to_all_reduce", "reduce_scatter"]
    assert all(lat >= 0 and bw > 1e6 for _, lat, bw in machine.links) and machine.comm_slowdown >= 0
    assert machine.comm_buffer == pytest.approx(1.0, abs=0.1)  # gloo copies what it sends or reduces
    assert machine.comm_stretch >= 0
    # a CPU's attention and slow elementwise ops, measured
    assert machine.attention_rates and all(d == "float32" and r > 1e6 for d, _, r in machine.attention_rates)
    names = {name for name, _ in machine.elementwise_rates}
    assert {"gelu", "gelu_backward", "silu", "_softmax", "native_layer_norm_backward"} <= names
    assert all(r > 1e5 for _, r in machine.elementwise_rates)
    monkeypatch.setenv("FBMT_MACHINE", path)
    torch.manual_seed(0)
    program = fbmt.compile(torch.nn.Linear(8, 8), world_size=2).trace(torch.randn(4, 8))
    assert fbmt.simulate(program).machine == machine


def _profiled(rank: int, world: int) -> dict:
    from fbmt.models import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64)
    model = fbmt.compile(GPT(cfg), checks=True)
    idx = torch.randint(0, 64, (4, 32))
    prof = fbmt.profile(model, idx, idx, steps=2, warmup=1, loss_fn=lambda out: out[1])
    sim = fbmt.simulate(model.program, fbmt.sim.H200)
    program_nodes = {n.name for n in model.program.graph.nodes}
    return dict(
        nodes=[(t.node, t.phase, t.kind, t.seconds) for t in prof.nodes],
        program_nodes=program_nodes,
        collectives=len(model.program.collectives()),
        peak=prof.peak_bytes,
        predicted_peak=sim.peak_activation_bytes,
        table=prof.compare(sim),
        text=str(prof),
        step=prof.step_s,
    )


def test_profile_times_every_node_of_the_program_on_a_real_run():
    for got in run_ranks(2, _profiled):
        names = [n for n, _, _, _ in got["nodes"]]
        assert set(names) <= got["program_nodes"]  # the same nodes as the program's
        assert {phase for _, phase, _, _ in got["nodes"]} == {"fwd", "bwd"}
        kinds = [k for _, _, k, _ in got["nodes"]]
        assert kinds.count("start") == kinds.count("wait") == got["collectives"]
        assert all(s >= 0 for *_, s in got["nodes"]) and got["step"] > 0
        # the step's allocations, measured by the torch profiler, against the simulator's replay of the same
        # program: on a model this small (1 MiB) gloo's buffers and timing add 10-30% (BENCHMARKS.md for real sizes)
        assert got["predicted_peak"] * 0.9 <= got["peak"] <= got["predicted_peak"] * 1.5, (
            got["peak"],
            got["predicted_peak"],
        )
        assert "peak memory" in got["table"] and "%" in got["table"] and "measured on cpu, 2 rank(s)" in got["text"]
