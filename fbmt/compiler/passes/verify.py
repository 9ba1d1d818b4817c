"""Verify: static checks of a Program's invariants. Changes nothing; raises on the first violation.

Checks: fx lint; phases are contiguous (every forward node before every backward node) and no
forward node reads a tangent; every collective start is read by exactly one `wait`; every gather
reads the shard of the group it is tagged with, and every shard gradient the program returns is
its own group's reduction (a gather of another group's shard computes with the wrong weights, with
no error anywhere else); every gathered buffer is released exactly once (unless the program
returns it), after every node that reads it or its views; nothing reads a buffer after its
release; the members of a bucket (NOTE: [Buckets] in fbmt/compiler/collectives) stand next to each other
and agree on what one call needs. A failure names the pass that produced the program and the node,
and prints the program around it.

That every rank issues the same collectives in the same order is a property of the program (the
graph is the same on every rank, traced from the same shapes); `Program.collective_signature` is
what the runtime compares across ranks before a program first runs, so ranks that traced different
programs fail with a message instead of hanging.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fbmt.compiler import collectives as comm
from fbmt.compiler import meta, ops
from fbmt.compiler.program import BWD, FWD, Note, Program, format_graph


class VerifyError(AssertionError):
    pass


def verify_program(program: Program) -> tuple[Program, Note]:
    """The pipeline's last pass: `check` the program; it comes back unchanged (a new Program object,
    so the record the runner adds does not touch the input's history)."""
    check(program, after="verify")
    return dataclasses.replace(program, history=list(program.history)), Note("ok")


def check(program: Program, *, after: str) -> None:
    """Raise a VerifyError naming pass `after` and the node at the first broken invariant."""
    g = program.graph
    order = ops.node_order(g)
    for n in g.nodes:  # before fx's lint, whose message names the reader only, and prints the whole graph
        late = [a for a in n.all_input_nodes if order[a] >= order[n]]
        if late:
            _fail(program, after, n, f"reads %{late[0].name}{_collective_of(late[0])}, which comes after it")
    try:
        g.lint()
    except Exception as e:
        raise VerifyError(f"after pass '{after}': fx lint failed: {e}") from e
    roles = dict(zip(program.placeholders(), program.inputs))
    tangents = {n for n, r in roles.items() if r.kind == "tangent"}
    seen_bwd = None
    for n in g.nodes:
        phase = meta.phase(n)
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
        if comm.is_start(n):
            waits = list(n.users)
            if len(waits) != 1 or not comm.is_wait(waits[0]):
                _fail(program, after, n, f"must be read by exactly one wait, not {waits}")
        if comm.is_gather(n):
            _check_gathered_shard(program, after, n, roles)
        if comm.is_wait(n) and comm.is_gather(n.args[0]):
            _check_release(program, after, n, order)
    _check_buckets(program, after)
    for role, value in zip(program.outputs, program.output_values()):
        if role.kind == "shard_grad" and isinstance(value, fx.Node):
            tagged = meta.group(value)
            if not comm.is_wait(value) or not comm.is_reduction(value.args[0]) or tagged != role.key:
                _fail(
                    program, after, value, f"is returned as group {role.key}'s shard gradient but is not its reduction"
                )


def _collective_of(node: fx.Node) -> str:
    """`node` as part of a collective, for a message: ' (the wait of group 3's all_gather in the bwd)'."""
    start = node.args[0] if comm.is_wait(node) else node if comm.is_start(node) else None
    if start is None:
        return ""
    role = "the wait of " if node is not start else ""
    group, phase = meta.group(start), meta.phase(start)
    return f" ({role}group {group}'s {start.target.__name__} in the {phase}: a pass moved it past this reader)"


def _check_gathered_shard(program: Program, after: str, start: fx.Node, roles: dict) -> None:
    group, source = meta.group(start), comm.gather_args(start).shard
    role = roles.get(source)
    if role is None or role.kind != "shard" or role.key != group:
        what = f"%{source.name}" + (f" ({role})" if role is not None else "")
        _fail(program, after, start, f"gathers {what}, not the shard of its group {group}")


def _check_release(program: Program, after: str, buffer: fx.Node, order: dict[fx.Node, int]) -> None:
    found, returned = ops.buffer_readers(buffer)
    if returned:
        return
    releases = [r for r in found if comm.is_release(r)]
    readers = [r for r in found if not comm.is_release(r)]
    if len(releases) != 1:
        _fail(program, after, buffer, f"is a gathered buffer released {len(releases)} times (expected once)")
    late = [r for r in readers if order[r] > order[releases[0]]]
    if late:
        _fail(program, after, late[0], f"reads gathered buffer %{buffer.name} after its release")


def _check_buckets(program: Program, after: str) -> None:
    """Each bucket's starts are one run of adjacent nodes that agree on kind, phase, ranks, wire dtype
    and averaging: the runtime issues the run as one call."""
    first: dict[int, fx.Node] = {}
    previous: fx.Node | None = None
    for n in program.graph.nodes:
        b = meta.bucket(n) if n.op == "call_function" else None
        if b is not None:
            if comm.kind_of(n) is None or not comm.kind_of(n).bucketable:
                _fail(program, after, n, f"is in bucket {b}, but a {n.target.__name__} cannot be fused with others")
            head = first.setdefault(b, n)
            if head is not n and (previous is None or meta.bucket(previous) != b):
                _fail(
                    program, after, n, f"is in bucket {b}, but does not stand next to its other members (%{head.name})"
                )
            if comm.bucket_key(n) != comm.bucket_key(head):
                _fail(
                    program,
                    after,
                    n,
                    f"is in bucket {b} with %{head.name}, but one call cannot carry both "
                    f"({comm.bucket_key(n)} against {comm.bucket_key(head)})",
                )
        previous = n


def _fail(program: Program, after: str, node: fx.Node, what: str) -> None:
    lines = format_graph(program).splitlines()
    at = next(
        (i for i, line in enumerate(lines) if line.startswith(f"%{node.name}:") or line.startswith(f"%{node.name} ")), 0
    )
    context = "\n".join(lines[max(0, at - 6) : at + 4])
    raise VerifyError(f"after pass '{after}': %{node.name} {what}\n--- program around it ---\n{context}")
