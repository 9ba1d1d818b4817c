"""fbmt.viz: each picture shows what it says (one bar per collective, the peak at the simulator's
number, one row per collective, every block in the graph) and saves to a file."""

from __future__ import annotations

import torch

import fbmt
from tests.models.reference import gpt


def _sim(**options):
    torch.manual_seed(0)
    program = fbmt.compile(gpt(n_layer=3), world_size=4, **options).trace(torch.randint(0, 64, (4, 16)))
    return program, fbmt.simulate(program, fbmt.sim.H200)


def test_the_timeline_has_one_bar_per_collective_and_marks_exposed_waits(tmp_path):
    _, sim = _sim(schedule="none")
    fig = fbmt.viz.timeline(sim, path=str(tmp_path / "t.png"))
    ax = fig.axes[0]
    bars = sum(len(c.get_paths()) for c in ax.collections if (c.get_gid() or "").startswith("communication:"))
    assert bars == len(sim.collectives) > 0
    exposed = next(c for c in ax.collections if c.get_gid() == "exposed")
    assert len(exposed.get_paths()) == sum(c.exposed > 0 for c in sim.collectives)
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_the_timeline_sets_measured_beneath_predicted():
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=2))
    idx = torch.randint(0, 64, (2, 16))
    prof = fbmt.profile(model, idx, steps=1, warmup=1)
    fig = fbmt.viz.timeline(fbmt.simulate(model.program, fbmt.sim.H200), prof)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "predicted compute",
        "predicted communication",
        "measured compute",
    ]


def test_the_memory_curve_peaks_at_the_simulators_number(tmp_path):
    _, sim = _sim(zero=2)
    fig = fbmt.viz.memory(sim, path=str(tmp_path / "m.svg"))
    line = next(line for line in fig.axes[0].lines if line.get_gid() == "peak")
    assert line.get_ydata()[0] * 2**20 == sim.peak_activation_bytes
    assert sim.memory.peak_node in fig.axes[0].texts[0].get_text()
    assert "<svg" in (tmp_path / "m.svg").read_text()[:500]


def test_the_collective_table_has_a_row_per_collective(tmp_path):
    _, sim = _sim()
    table = fbmt.viz.collectives(sim)
    assert len(table.rows) == len(sim.collectives) and table._repr_html_().count("<tr>") == len(sim.collectives) + 1
    table.save(str(tmp_path / "c.csv"))
    assert len((tmp_path / "c.csv").read_text().splitlines()) == len(sim.collectives) + 1


def test_the_graph_draws_every_block_and_collective(tmp_path):
    program, _ = _sim()
    picture = fbmt.viz.graph(program, path=str(tmp_path / "g.svg"))
    svg = picture._repr_svg_()
    for block in program.layout.blocks:
        assert f">{block} " in svg or f">{block}<" in svg, block
    assert svg.count("all_gather") >= len(
        [c for c in program.collectives() if c.target is fbmt.compiler.collectives.all_gather]
    )
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")
