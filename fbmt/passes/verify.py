"""Verify: static checks of a Program's invariants. Changes nothing; raises on the first violation.

Checks: fx lint; phases are contiguous (every forward node before every backward node) and no
forward node reads a tangent; every collective start is read by exactly one `wait`; every gathered
buffer is released exactly once (unless the program returns it), after every node that reads it or
its views; nothing reads a buffer after its release. A failure names the pass that produced the
program and the node, and prints the program around it.

That every rank issues the same collectives in the same order is a property of the program (the
graph is the same on every rank, traced from the same shapes); `collective_signature` is what the
runtime compares across ranks before a program first runs, so ranks that traced different programs
fail with a message instead of hanging.
"""

from __future__ import annotations

import hashlib
import time

import dataclasses

import torch.fx as fx

from fbmt.program import BWD, FWD, Program, buffer_readers, format_graph
from fbmt.runtime import collectives


class VerifyError(AssertionError):
    pass


def verify(program: Program, *, after: str = "verify") -> Program:
    started = time.perf_counter()
    g = program.graph
    try:
        g.lint()
    except Exception as e:
        raise VerifyError(f"after pass '{after}': fx lint failed: {e}") from e
    order = {n: i for i, n in enumerate(g.nodes)}
    tangents = {n for n, r in zip(program.placeholders(), program.inputs) if r.kind == "tangent"}
    seen_bwd = None
    for n in g.nodes:
        phase = n.meta.get("fbmt_phase")
        if n.op in ("placeholder", "output"):
            continue
        if phase not in (FWD, BWD):
            _fail(program, after, n, "has no phase")
        if phase == BWD and seen_bwd is None:
            seen_bwd = n
        if phase == FWD and seen_bwd is not None:
            _fail(program, after, n, f"is a forward node after the backward began at %{seen_bwd.name}")
        if phase == FWD and any(a in tangents for a in n.all_input_nodes):
            _fail(program, after, n, "is a forward node that reads a tangent")
        if n.target in collectives.STARTS:
            waits = list(n.users)
            if len(waits) != 1 or waits[0].target is not collectives.wait:
                _fail(program, after, n, f"must be read by exactly one wait, not {waits}")
        if n.target is collectives.wait and n.args[0].target is collectives.all_gather:
            _check_release(program, after, n, order)
    if after == "verify":  # as a pipeline pass: leave a record in a new Program, never mutate the input
        program = dataclasses.replace(program, history=list(program.history))
        program.record("verify", started, "ok")
    return program


def _check_release(program: Program, after: str, buffer: fx.Node, order: dict[fx.Node, int]) -> None:
    found, returned = buffer_readers(buffer)
    if returned:
        return
    releases = [r for r in found if r.target is collectives.release]
    readers = [r for r in found if r.target is not collectives.release]
    if len(releases) != 1:
        _fail(program, after, buffer, f"is a gathered buffer released {len(releases)} times (expected once)")
    late = [r for r in readers if order[r] > order[releases[0]]]
    if late:
        _fail(program, after, late[0], f"reads gathered buffer %{buffer.name} after its release")


def collective_signature(program: Program) -> str:
    """A digest of the ordered collective sequence (kind, group, phase) of a program."""
    parts = [f"{n.target.__name__}:{n.meta.get('fbmt_group')}:{n.meta.get('fbmt_phase')}"
             for n in program.collectives()]
    sizes = [f"{grp.index}:{grp.padded_numel}:{grp.dtype}" for grp in program.layout.groups]
    return hashlib.sha1("|".join(parts + sizes).encode()).hexdigest()[:16]


def _fail(program: Program, after: str, node: fx.Node, what: str) -> None:
    lines = format_graph(program).splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(f"%{node.name}:") or line.startswith(f"%{node.name} ")), 0)
    context = "\n".join(lines[max(0, at - 6):at + 4])
    raise VerifyError(f"after pass '{after}': %{node.name} {what}\n--- program around it ---\n{context}")
