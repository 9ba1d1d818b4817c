"""remat="auto" with memory_budget: each block's recompute is chosen so the step's simulated peak fits
the budget at the least recompute (NOTE: [Auto recompute]); a budget nothing fits is an error that
names the smallest one that does; on 2 CPU ranks the measured peak fits too and training matches eager."""

from __future__ import annotations

import pytest
import torch

import fbmt
from fbmt.passes.remat import cheapest_within
from tests.dist import run_ranks
from tests.models.reference import gpt


def _program(**options):
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=4), world_size=2, checks=True, **options)
    idx = torch.randint(0, 64, (4, 16))
    return model.trace(idx, idx)


def _peak(program) -> int:
    return fbmt.simulate(program, fbmt.sim.H200).peak_activation_bytes


def test_the_knapsack_takes_the_least_recompute_that_fits():
    costs = {
        "a": {"none": (100, 0.0), "mincut": (60, 1.0), "block": (10, 5.0)},
        "b": {"none": (100, 0.0), "mincut": (40, 2.0), "block": (10, 3.0)},
    }
    assert cheapest_within(costs, 200) == {"a": "none", "b": "none"}
    assert cheapest_within(costs, 160) == {"a": "mincut", "b": "none"}  # 1 s beats b's 2 s
    assert cheapest_within(costs, 100) == {"a": "mincut", "b": "mincut"}  # 3 s
    assert cheapest_within(costs, 60) == {"a": "block", "b": "mincut"}  # 7 s: a's mincut leaves b too little
    assert cheapest_within(costs, 20) == {"a": "block", "b": "block"}
    assert cheapest_within(costs, 19) is None


def test_auto_fits_each_budget_between_the_least_and_the_most_memory():
    most, least = _peak(_program(remat="none")), _peak(_program(remat="block"))
    assert least < most
    chosen, recompute = [], []
    for budget in (most, (most + least) // 2, least + (most - least) // 5):
        program = _program(remat="auto", memory_budget=budget)
        assert _peak(program) <= budget, (budget, program.summary("remat"))
        assert program.summary("remat").startswith("auto under ")
        chosen.append(program.schedule().remat)
        recompute.append(fbmt.simulate(program, fbmt.sim.H200).compute_s)
    assert set(chosen[0].values()) == {"none"}  # everything fits: nothing is recomputed
    assert recompute[0] < recompute[1] < recompute[2], (recompute, chosen)  # the less room, the more recompute


def test_a_budget_nothing_fits_names_the_smallest_that_does():
    least = _peak(_program(remat="block"))
    with pytest.raises(ValueError, match=r"needs at least (\d+) bytes .*smallest budget that fits") as e:
        _program(remat="auto", memory_budget=least // 2)
    smallest = int(e.value.args[0].split("needs at least ")[1].split()[0])
    assert _peak(_program(remat="auto", memory_budget=smallest)) <= smallest


def test_auto_needs_a_budget_and_a_budget_needs_auto():
    with pytest.raises(ValueError, match="remat='auto' chooses each block's recompute to fit memory_budget"):
        fbmt.compile(gpt(), remat="auto")
    with pytest.raises(ValueError, match="give both, or neither"):
        fbmt.compile(gpt(), memory_budget=2**20)


def _binding_budget(model, *inputs) -> int:
    """A budget between the least and the most memory the model's step can take."""
    least, most = (_peak(model.trace(*inputs)) for model in (model("block"), model("none")))
    return least + (most - least) * 2 // 5


def _measured_under_budget(rank: int, world: int) -> dict:
    from fbmt.models import GPT, GPTConfig
    from tests.workers import BUILDERS, _local, batch, compare, eager_reference, train_compiled

    (idx,), _, _ = batch("gpt", 0)

    def reference(remat):
        torch.manual_seed(0)
        return fbmt.compile(BUILDERS["gpt"](), remat=remat)

    budget = _binding_budget(reference, _local(idx, rank, world))
    compare(
        train_compiled("gpt", rank, world, dict(remat="auto", memory_budget=budget)),
        eager_reference("gpt"),
        f"gpt on {world} ranks, remat='auto' under {budget} bytes",
        buffers=False,
    )

    def bigger(remat, **extra):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=64, seq_len=64, n_layer=4, n_head=2, d_model=64)
        return fbmt.compile(GPT(cfg), remat=remat, **extra)

    idx = torch.randint(0, 64, (8, 64))
    budget = _binding_budget(bigger, idx, idx)
    peaks = {"budget": budget}
    for remat, extra in (("none", {}), ("auto", dict(memory_budget=budget))):
        prof = fbmt.profile(bigger(remat, **extra), idx, idx, steps=1, warmup=1, loss_fn=lambda out: out[1])
        peaks[remat] = prof.peak_bytes
    return peaks


def test_on_two_ranks_auto_trains_as_eager_and_its_measured_peak_fits_the_budget():
    for peaks in run_ranks(2, _measured_under_budget):
        assert peaks["none"] > peaks["budget"] >= peaks["auto"], peaks


def test_auto_chooses_the_prefetch_depth_of_the_fastest_simulated_step(tmp_path, monkeypatch):
    import dataclasses
    import re

    slow = dataclasses.replace(fbmt.sim.H200, name="slow link", bus_bandwidth=2e8, latency=1e-5)
    slow.save(str(tmp_path / "machine.json"))
    monkeypatch.setenv("FBMT_MACHINE", str(tmp_path / "machine.json"))
    program = _program(remat="auto", memory_budget=2**30)
    line = program.summary("remat")
    steps = {int(d): float(ms) for d, ms in re.findall(r"(\d): ([\d.]+) ms", line.split("by depth")[1])}
    depth = int(re.search(r"prefetch depth (\d)", line).group(1))
    # the shallowest of those within 1% of the fastest (a deeper prefetch holds more)
    assert sorted(steps) == [1, 2, 3] and depth == min(d for d in steps if steps[d] <= min(steps.values()) * 1.01)
    assert f"issued {depth} block(s) ahead" in program.summary("schedule")
    assert fbmt.simulate(program).step_s * 1e3 == pytest.approx(steps[depth], abs=0.01)
    # a depth the user set is kept
    kept = _program(remat="auto", memory_budget=2**30, prefetch=3)
    assert "prefetch depth" not in kept.summary("remat") and "issued 3 block(s) ahead" in kept.summary("schedule")
