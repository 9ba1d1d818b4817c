"""A program's collectives as records: what strategies, the Schedule format and the tools read.

`collectives(program, phase, role)` pairs each start with its wait (and a gathered buffer's release)
and says what it moves, in the order of the waits, which is the order their results are used in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.fx as fx

from fbmt.compiler import meta
from fbmt.compiler.collectives.spec import is_release, is_wait, kind_of, wire_bytes

if TYPE_CHECKING:  # annotations only: the program is built on the collectives
    from fbmt.compiler.program import Program


@dataclass(frozen=True)
class Collective:
    """One collective of a program: its nodes and what it moves (NOTE: [Strategies])."""

    start: fx.Node
    wait: fx.Node
    release: fx.Node | None  # where a gathered buffer's life ends (None for a reduction)
    kind: str  # its kind's name: "all_gather", "reduce_scatter", "all_to_all_reduce", ...
    role: str  # GATHER or REDUCE
    group: int  # index into program.layout.groups
    block: str  # the block that owns the group
    phase: str  # "fwd" or "bwd"
    bytes: int  # the whole buffer it gathers or reduces, in the dtype it crosses the wire in
    bucket: int | None = None  # the collectives fused with it share one (NOTE: [Buckets]); None: its own

    @property
    def name(self) -> str:
        return f"{self.phase} {self.kind} of group {self.group} ({self.block or '<root>'})"


def collectives(program: Program, phase: str | None = None, role: str | None = None) -> list[Collective]:
    """The collectives of `role` (GATHER or REDUCE; both when None) in `phase` (both when None), in the
    graph order of their waits."""
    blocks = {grp.index: grp.block for grp in program.layout.groups}
    out = []
    for n in program.graph.nodes:
        kind = kind_of(n.args[0]) if is_wait(n) else None
        if kind is None or (role is not None and kind.role != role):
            continue
        if phase is not None and meta.phase(n) != phase:
            continue
        start = n.args[0]
        release = next((u for u in n.users if is_release(u)), None)
        group = meta.group(n)
        out.append(
            Collective(
                start,
                n,
                release,
                kind.name,
                kind.role,
                group,
                blocks[group],
                meta.phase(n),
                wire_bytes(start),
                meta.bucket(start),
            )
        )
    return out
