"""The pass runner: it records, times, verifies and dumps every pass, and skips the disabled ones."""

from __future__ import annotations

import pytest
import torch

import fbmt
from fbmt.compiler import Note
from fbmt.compiler import collectives as comm
from fbmt.compiler.passes import VerifyError, assign_blocks, run_passes
from tests.models.reference import MLP, batch, gpt
from tests.passes.helpers import traced


def test_each_pass_leaves_a_record_with_its_time_summary_and_program():
    model = fbmt.compile(MLP(), world_size=2)
    model.trace(torch.randn(2, 12))
    history = model.program.history
    assert [r.name for r in history] == ["loss", "blocks", "remat", "merge", "fp8", "shard", "schedule", "verify"]
    assert all(r.seconds >= 0 and r.summary and r.text.count("\n") > 10 for r in history)
    assert model.program.stats("shard").zero == 3 and model.program.summary("shard").startswith("zero=3")
    with pytest.raises(KeyError, match="no pass named 'nope' ran"):
        model.program.summary("nope")
    text = str(model.program)
    for r in history:
        assert f"# pass {r.name}" in text
    assert "all_gather(%shard" in text and "reduce_scatter(" in text and "release(" in text


def test_disabling_a_pass_is_recorded_and_changes_nothing():
    model = fbmt.compile(MLP(), disable=("schedule",))
    model(torch.randn(2, 12)).sum().backward()
    history = {r.name: r for r in model.program.history}
    assert history["schedule"].stats == Note("disabled by the user")
    assert history["schedule"].text == history["shard"].text


def test_dump_dir_writes_one_file_per_pass(tmp_path):
    model = fbmt.compile(gpt(), world_size=4, dump_dir=str(tmp_path))
    (idx,), _, tgt = batch("gpt", 0)
    model.trace(idx, tgt)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "00-trace.txt",
        "01-loss.txt",
        "02-blocks.txt",
        "03-remat.txt",
        "04-merge.txt",
        "05-fp8.txt",
        "06-shard.txt",
        "07-schedule.txt",
        "08-verify.txt",
    ]
    assert (tmp_path / "06-shard.txt").read_text().startswith("# fbmt Program")


def test_with_checks_a_pass_that_breaks_an_invariant_is_named():
    def drops_a_release(program):
        program = program.copy()
        program.graph.erase_node(next(n for n in program.graph.nodes if n.target is comm.release))
        return program, "dropped a release"

    sharded = fbmt.compile(MLP(), world_size=2).trace(torch.randn(2, 12))
    with pytest.raises(VerifyError, match="after pass 'careless': .* released 0 times"):
        run_passes(sharded, [("careless", drops_a_release)], checks=True)
    run_passes(sharded, [("careless", drops_a_release)], checks=False)  # without checks it goes through


def test_a_pass_returns_a_new_program_and_leaves_its_input_as_it_was():
    program = traced(MLP(), torch.randn(2, 12))
    nodes_before = [(n.name, dict(n.meta)) for n in program.graph.nodes]
    run_passes(program, [("blocks", assign_blocks)], checks=True)
    assert [(n.name, dict(n.meta)) for n in program.graph.nodes] == nodes_before and not program.history


def test_passes_after_the_first_write_in_place_and_each_record_is_its_own_program():
    # the caller's program is copied once; after that each pass writes to the program the pass before
    # made (no one else holds it), and each record's text is still the program after its own pass
    from fbmt.compiler import pipeline
    from fbmt.compiler.options import CompileOptions
    from fbmt.compiler.plan import Plan

    program = traced(MLP(), torch.randn(2, 12), world_size=2)
    before = str(program.graph)
    copies = []

    def copying(fn):
        def run(p):
            graph = p.graph
            out, stats = fn(p)
            copies.append(out.graph is not graph)
            return out, stats

        return run

    passes = [(name, copying(fn)) for name, fn in pipeline.passes(Plan.of(CompileOptions(), 2))]
    done = run_passes(program, passes, dump_dir=None)
    assert str(program.graph) == before and not program.history
    assert copies.count(True) == 1, copies  # blocks copied the trace's graph; the rest wrote to it
    texts = {r.name: r.text for r in done.history}
    assert (
        texts["blocks"] != texts["shard"] and "all_gather(" in texts["shard"] and "all_gather(" not in texts["blocks"]
    )
    assert not done._owned and done.copy().graph is not done.graph  # outside the runner, copy() copies


def test_a_program_given_up_is_written_in_place_and_gives_the_same_program():
    # compile_program gives the traced program up: no pass copies its graph, and the result is the
    # program the copying run gives
    from fbmt.compiler import pipeline
    from fbmt.compiler.options import CompileOptions
    from fbmt.compiler.plan import Plan

    plan = Plan.of(CompileOptions(), 2)
    kept = pipeline.run(traced(MLP(), torch.randn(2, 12), world_size=2), plan)
    given = traced(MLP(), torch.randn(2, 12), world_size=2)
    graph = given.graph
    done = pipeline.run(given, plan, given_up=True)
    assert done.graph is graph
    assert [r.text for r in done.history] == [r.text for r in kept.history]
    assert str(done.graph) == str(kept.graph)


def test_a_nodes_line_changes_with_anything_it_is_formatted_from():
    # NOTE: [Lines of unchanged nodes]: each node keeps its line while nothing it is made from changes; a
    # copy of the program (other nodes) is formatted afresh, and must read the same
    from fbmt.compiler import meta
    from fbmt.compiler.program import format_graph

    model = fbmt.compile(gpt(), world_size=2, remat="block")
    (idx,), _, tgt = batch("gpt", 0)
    program = model.trace(idx, tgt)
    assert format_graph(program) == program.history[-1].text == format_graph(program.copy())
    adds = [n for n in program.graph.nodes if n.target is torch.ops.aten.add.Tensor and len(n.all_input_nodes) == 2]
    first, second = adds[0], adds[1]
    first.args = (first.args[1], first.args[0])  # its arguments
    meta.tag(second, recompute="activation")  # a fact of fbmt's
    mm = next(n for n in program.graph.nodes if n.target is torch.ops.aten.mm.default)
    mm.meta["val"] = mm.meta["val"].to(torch.float64)  # its value
    text = format_graph(program)
    assert text == format_graph(program.copy()) and text != program.history[-1].text
    assert f"%{first.name}: " in text and "recompute:activation" in text and "float64" in text
