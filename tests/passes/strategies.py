"""A strategy as a user would write and register it (imported by the test and by its spawned ranks)."""

from __future__ import annotations

import fbmt
from fbmt import ops
from fbmt.passes import register_strategy
from fbmt.passes.schedule import pairs
from fbmt.program import BWD, FWD


@register_strategy("all-at-start")
def gathers_all_at_the_start(program: fbmt.Program, *, prefetch: int) -> str:
    """Every gather of a phase issued when the phase begins (the most memory, the most overlap)."""
    moved = 0
    for phase in (FWD, BWD):
        begin = next(
            (n for n in program.graph.nodes if n.op == "call_function" and n.meta["fbmt_phase"] == phase), None
        )
        for start, _ in pairs(program, ops.GATHERS, phase):
            if begin is not start:
                begin.prepend(start)
                moved += 1
    return f"{moved} gathers issued when their phase begins"
