"""A strategy as a user would write and register it (imported by the test and by its spawned ranks)."""

from __future__ import annotations

import fbmt
from fbmt.compiler.passes.schedule import GATHER, collectives, issue_before, phase_begin


@fbmt.register_strategy("all-at-start")
def gathers_all_at_the_start(program: fbmt.Program, *, phases: tuple[str, ...] = ("fwd", "bwd")) -> str:
    """Every gather of a phase issued when the phase begins (the most memory, the most overlap)."""
    moved = 0
    for phase in phases:
        begin = phase_begin(program, phase)
        for c in collectives(program, phase, GATHER):
            moved += issue_before(c, begin)
    return f"{moved} gathers issued when their phase begins"
