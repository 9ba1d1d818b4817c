"""`fbmt.Schedule`: the decisions on a program as data. It round-trips through JSON, replays to the
identical program, refuses a program it was not taken from, and its diff names what changed."""

from __future__ import annotations

import json

import pytest
import torch

import fbmt
from fbmt.compiler.program import format_graph
from tests.models.reference import gpt


def _program(n_layer: int = 4, world_size: int = 1, **options):
    """A GPT's program for 2x8 tokens: few enough that the last blocks save (NOTE: [Trailing blocks])."""
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=n_layer), world_size=world_size, checks=True, **options)
    idx = torch.randint(0, 64, (2, 8))
    return model.trace(idx, idx)


def test_a_schedule_round_trips_through_json(tmp_path):
    sched = _program(schedule="greedy").schedule()
    assert fbmt.Schedule.from_json(sched.to_json()) == sched
    sched.to_json(str(tmp_path / "s.json"))
    assert fbmt.Schedule.load(str(tmp_path / "s.json")) == sched
    assert json.loads((tmp_path / "s.json").read_text())["fbmt_schedule"] == 1


@pytest.mark.parametrize(
    "options",
    [
        dict(schedule="prefetch"),
        dict(schedule="fsdp2", remat="mincut"),
        dict(schedule="greedy", zero=2, remat="none"),
        dict(schedule=("bucket", {"bucket_bytes": 20000}), world_size=2),
    ],
)
def test_a_saved_schedule_replays_to_the_identical_program(tmp_path, options):
    original = _program(**options)
    path = str(tmp_path / "s.json")
    original.schedule().to_json(path)
    # compiled afresh with other defaults: the schedule's recompute policies and positions win
    replayed = _program(
        schedule=fbmt.Schedule.load(path), **{k: v for k, v in options.items() if k in ("zero", "world_size")}
    )
    assert format_graph(replayed) == format_graph(original)
    assert replayed.stats("schedule").strategy == "replay"
    assert replayed.schedule().collectives == original.schedule().collectives


def test_the_schedule_records_each_blocks_recompute_as_applied():
    sched = _program(remat="block").schedule()
    remat = sched.remat
    # the last blocks save as "mincut" would (NOTE: [Trailing blocks]), the others recompute
    assert remat["h.0"] == remat["h.1"] == "block" and remat["h.2"] == remat["lm_head"] == "mincut", remat
    by_block = {b.block: b for b in sched.blocks}
    assert by_block["h.0"].recomputed > 0 and by_block["h.0"].saved_bytes < by_block["h.3"].saved_bytes
    text = str(sched)
    assert "block h.0" in text and "remat=block" in text and "fwd all_gather of group" in text


def test_a_replayed_training_schedule_leaves_evaluation_calls_to_the_default_strategy():
    sched = _program().schedule()
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=4), world_size=1, schedule=sched)
    idx = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        forward_only = model.trace(idx)
    stats = forward_only.stats("schedule")
    assert stats.strategy == "prefetch" and "the saved schedule is of a training program" in stats.fallback
    assert model.trace(idx, idx).stats("schedule").strategy == "replay"


def test_replay_refuses_a_program_it_was_not_taken_from():
    sched = _program(n_layer=4).schedule()
    with pytest.raises(ValueError, match="schedule replay: .*another program"):
        _program(n_layer=3, schedule=sched)
    with pytest.raises(ValueError, match="the schedule is for 1 rank.*the program for 2"):
        _program(world_size=2, schedule=sched)


def test_replay_refuses_a_program_of_the_same_size_that_computes_otherwise():
    """Another program with as many nodes and the same collectives (tanh for relu): only the compute
    digest tells them apart, so a check of the node count alone would replay it."""
    import torch.nn as nn

    from tests.models.reference import MLP

    def mlp(act: nn.Module) -> nn.Module:
        torch.manual_seed(0)
        model = MLP()
        model.act = act
        return model

    x = torch.randn(4, 12)
    saved = fbmt.compile(mlp(nn.ReLU()), world_size=2).trace(x)
    other = fbmt.compile(mlp(nn.Tanh()), world_size=2).trace(x)
    assert len(saved.graph.nodes) == len(other.graph.nodes)
    with pytest.raises(ValueError, match="the program's compute differs from the one the schedule was taken from"):
        fbmt.compile(mlp(nn.Tanh()), world_size=2, schedule=saved.schedule()).trace(x)


def test_a_file_that_is_no_schedule_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not an fbmt schedule"):
        fbmt.Schedule.load(str(path))
    path.write_text("not json")
    with pytest.raises(ValueError, match="is not JSON"):
        fbmt.Schedule.load(str(path))


def test_diff_names_what_changed():
    one, two = _program(prefetch=1).schedule(), _program(prefetch=2).schedule()
    assert one.diff(one) == ""
    lines = one.diff(two).splitlines()
    assert lines and all(": issued before %" in line for line in lines), lines
    assert any(line.startswith("fwd all_gather of group") for line in lines)
    remat = _program(remat="none").schedule().diff(_program(remat="block").schedule())
    assert "block h.0: remat none -> block" in remat.splitlines()
