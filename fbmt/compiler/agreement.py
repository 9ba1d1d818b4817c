"""Before every call of a compiled model, the ranks agree that they run the same program.

Ranks about to run different programs (one compiled a new one, one runs a cached one) would deadlock
in mismatched collectives, or pair the wrong ones. So every call compares the program's collective
signature across ranks on the host first (`fbmt.job.agree`, which also names a rank that
stalls), and where they differ fails on every rank, saying where their collective sequences part.
"""

from __future__ import annotations

from typing import Any

from fbmt import job
from fbmt.compiler import meta
from fbmt.compiler.program import Program


def check_ranks_agree(signature: str, program: Program) -> None:
    """Raise on every rank if some rank's program has another `signature` than this one's."""
    if program.layout.world_size == 1:  # compiled for one rank (world_size=1): no collectives to pair
        return
    digests = job.agree(int(signature[:15], 16), "a call of the compiled model")
    if len(set(digests)) == 1:
        return
    by_program: dict[int, list[int]] = {}
    for r, d in enumerate(digests):
        by_program.setdefault(d, []).append(r)
    sequences = job.gather_objects([_describe(n) for n in program.collectives()])
    raise RuntimeError(
        f"fbmt: ranks compiled different programs (ranks by program: {list(by_program.values())}); "
        f"{_first_difference(sequences)}. Every rank must call the model with the same input shapes, "
        "dtypes, train/eval mode and grad mode, and the same calls in the same order (a call on some "
        "ranks only, under no_grad on one rank, or after an exception caught on one rank breaks this)"
    )


def _describe(start: Any) -> str:
    """A collective start node, as a rank mismatch names it."""
    return f"{start.target.__name__} of group {meta.group(start)} ({meta.phase(start)})"


def _first_difference(sequences: list[list[str]]) -> str:
    """Where ranks' collective sequences first differ, and what each rank issues there."""
    longest = max(len(s) for s in sequences)
    for k in range(longest):
        at = [s[k] if k < len(s) else f"nothing (its program has {len(s)} collectives)" for s in sequences]
        if len(set(at)) > 1:
            ranks: dict[str, list[int]] = {}
            for r, what in enumerate(at):
                ranks.setdefault(what, []).append(r)
            issued = "; ".join(f"ranks {rs} issue {what}" for what, rs in ranks.items())
            return f"they first differ at collective #{k + 1}: {issued}"
    return "their collectives are the same, but their flat groups differ in size"
