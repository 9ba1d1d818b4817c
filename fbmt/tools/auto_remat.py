"""remat="auto": each block's recompute policy under a memory budget, chosen on a cost model.

    fbmt.compile(model, remat="auto", memory_budget=40 << 30)                  # priced on fbmt.sim.H200
    fbmt.compile(model, remat="auto", memory_budget=40 << 30, cost_model=fbmt.sim.Machine.load(path))

`fbmt.compile` gives the compiler `choose` as its search: the compiler traces a program, and for
remat="auto" asks `choose(traced, plan)` for a `RematChoice`, which the remat pass applies (NOTE:
[Auto recompute] in fbmt/compiler/passes/remat.py). The programs are priced with the plan's
`cost_model`, or with `fbmt.sim.H200` where the user gave none: never with a profile found in this
host's cache, so that every rank, on any host, chooses the same.
"""

from __future__ import annotations

import dataclasses
import math

from fbmt.compiler import Plan, Program, pipeline_passes
from fbmt.compiler.passes import Costs, RematChoice, assign_blocks, block_costs, run_passes
from fbmt.tools import sim

# The prefetch depths tried, where neither `prefetch=` nor the strategy's options set one: a deeper
# prefetch hides more communication behind compute and holds more gathered parameters.
DEPTHS = (1, 2, 3)
NEAR = 0.01  # steps within this fraction of the fastest count as equally fast


def machine_of(cost_model: object) -> sim.Machine:
    """The machine a `cost_model` option names: a Machine, the path of a saved profile, or None (H200)."""
    if cost_model is None:
        return sim.H200
    if isinstance(cost_model, sim.Machine):
        return cost_model
    if isinstance(cost_model, str):
        return sim.Machine.load(cost_model)
    raise TypeError(
        f"fbmt.compile(cost_model={cost_model!r}): expected an fbmt.sim.Machine, the path of a profile "
        "fbmt.calibrate saved, or None (fbmt.sim.H200)"
    )


def choose(traced: Program, plan: Plan) -> RematChoice:
    """Each block's recompute policy under `plan.memory_budget`, and the prefetch depth that makes the
    fastest simulated step within the budget where the user left it to the strategy (NOTE: [Auto recompute])."""
    if not traced.needs_grad:
        return RematChoice({}, reason="a forward-only program saves nothing for a backward")
    machine = machine_of(plan.cost_model)
    candidates = [plan.with_depth(d) for d in DEPTHS] if plan.depth_free else [plan]
    fitted, refused = [], None
    for p in candidates:
        try:
            fitted.append((*_fit_budget(traced, p, machine), p))
        except ValueError as e:  # this depth holds too much; a shallower one may fit
            refused = refused or e
    if not fitted:
        raise refused
    fastest = min(step for _, step, _ in fitted)
    # the shallowest within 1% of the fastest: a deeper prefetch holds more for what the model cannot tell apart
    choice, _, chosen = next(f for f in fitted if f[1] <= fastest * (1 + NEAR))
    if len(candidates) == 1:
        return choice
    steps = {p.strategy_options["depth"]: step for _, step, p in fitted}
    return dataclasses.replace(choice, depth=chosen.strategy_options["depth"], steps=steps)


def _fit_budget(traced: Program, plan: Plan, machine: sim.Machine) -> tuple[RematChoice, float]:
    """`choose` for one plan (one prefetch depth): each block's policy, and the simulated step."""
    budget = plan.memory_budget
    named = plan.remat_per_block  # blocks whose policy the user set keep it
    tagged, _ = assign_blocks(traced)
    costs = {
        b: c
        for b, c in block_costs(tagged, lambda n: sim.compute_time(n, machine)).items()
        if b not in named and any(s for _, s in c.values())
    }
    fixed = {b: "none" for b in traced.layout.blocks if b not in costs and b not in named}

    def simulate(chosen: dict[str, str]) -> sim.Simulation:
        candidate = plan.with_choice(RematChoice({**fixed, **chosen, **named}))
        return sim.simulate(run_passes(traced, pipeline_passes(candidate), disable=plan.disable), machine)

    def result(chosen: dict[str, str], at: sim.Simulation) -> tuple[RematChoice, float]:
        policies = {**fixed, **chosen, **named}
        return RematChoice(policies, chosen, budget, at.peak_activation_bytes), at.step_s

    fastest = {b: "none" for b in costs}
    if (at := simulate(fastest)).peak_activation_bytes <= budget:
        return result(fastest, at)
    least = {b: min(c, key=lambda p: (c[p][0], c[p][1])) for b, c in costs.items()}  # noqa: B023
    lowest = simulate(least)
    floor = lowest.peak_activation_bytes
    if floor > budget:
        raise ValueError(
            f"fbmt.compile(remat='auto', memory_budget={budget}): the step needs at least {floor} bytes "
            f"({sim.size(floor)}) as the simulator predicts it, with every block recomputing what it can; that is "
            "the smallest budget that fits. Use more ranks or a smaller batch per rank"
            + (", or zero=3" if plan.zero == 2 else "")
        )
    rest = floor - sum(costs[b][p][0] for b, p in least.items())
    capacity = budget - rest
    for _ in range(6):  # the sum of saved bytes models the peak; shrink where the peak says otherwise
        chosen = cheapest_within(costs, capacity)
        if chosen is None:
            break
        if (at := simulate(chosen)).peak_activation_bytes <= budget:
            return result(chosen, at)
        capacity -= at.peak_activation_bytes - budget
    return result(least, lowest)


def cheapest_within(costs: Costs, capacity: float, bins: int = 2000) -> dict[str, str] | None:
    """The policy per block that recomputes the fewest seconds while the blocks' saved bytes sum to
    at most `capacity`; None if even the least memory does not fit (NOTE: [Auto recompute]).

    A multiple-choice knapsack, solved by dynamic programming over the capacity cut into `bins`
    steps (each block's bytes rounded up, so a choice that fits here fits exactly): blocks x policies
    x bins steps, a few million for 80 blocks."""
    if capacity < 0:
        return None
    bins = max(0, min(bins, int(capacity)))  # a step is at least a byte
    step = capacity / bins if bins else 1.0
    blocks = list(costs)
    inf = float("inf")
    best = [0.0] + [inf] * bins  # best[w]: least seconds with exactly w steps used so far
    choice: list[list[tuple[int, str] | None]] = []
    for block in blocks:
        nxt = [inf] * (bins + 1)
        pick: list[tuple[int, str] | None] = [None] * (bins + 1)
        for policy, (b, s) in costs[block].items():
            w = math.ceil(b / step - 1e-9)
            if w > bins:
                continue
            for used in range(bins + 1 - w):
                if best[used] + s < nxt[used + w]:
                    nxt[used + w] = best[used] + s
                    pick[used + w] = (used, policy)
        best = nxt
        choice.append(pick)
    end = min(range(bins + 1), key=best.__getitem__)
    if best[end] == inf:
        return None
    chosen: dict[str, str] = {}
    for block, pick in zip(reversed(blocks), reversed(choice)):
        used, policy = pick[end]
        chosen[block] = policy
        end = used
    return chosen
