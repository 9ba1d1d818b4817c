"""verify: the invariants every program keeps, each broken by hand once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fbmt
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta
from fbmt.compiler.passes import VerifyError, check, verify_program
from fbmt.compiler.program import FWD, Note, Program
from tests.models.reference import batch, gpt


@pytest.fixture(scope="module")
def program() -> Program:
    torch.manual_seed(0)
    (idx,), _, tgt = batch("gpt", 0)
    return fbmt.compile(gpt(), world_size=4, checks=True).trace(idx, tgt)


def _first(program: Program, target) -> torch.fx.Node:
    return next(n for n in program.graph.nodes if n.target is target)


def _drop_a_release(p: Program) -> None:
    p.graph.erase_node(_first(p, comm.release))


def _release_early(p: Program) -> None:
    release = _first(p, comm.release)
    release.args[0].append(release)  # right after the wait, before the views are read


def _wait_twice(p: Program) -> None:
    wait = _first(p, comm.wait)
    with p.graph.inserting_after(wait):
        twin = p.graph.call_function(comm.wait, wait.args)
    twin.meta.update(wait.meta)


def _no_phase(p: Program) -> None:
    meta.clear(next(n for n in p.graph.nodes if n.op == "call_function"), "phase")


def _gather_another_shard(p: Program) -> None:
    gathers = [n for n in p.graph.nodes if n.target is comm.all_gather]
    first, other = gathers[0], next(g for g in gathers if g.args[0] is not gathers[0].args[0])
    first.args = (other.args[0], *first.args[1:])  # the first group's buffer filled with another's weights


def _return_another_gradient(p: Program) -> None:
    values = p.output_values()
    grads = [i for i, r in enumerate(p.outputs) if r.kind == "shard_grad" and values[i] is not None]
    values[grads[0]], values[grads[1]] = values[grads[1]], values[grads[0]]
    p.output_node().args = (values,)


def _gather_after_its_reader(p: Program) -> None:
    start = [n for n in p.graph.nodes if n.target is comm.all_gather and meta.phase(n) == "bwd"][1]
    wait = next(iter(start.users))
    p.output_node().prepend(start)  # a backward gather moved past everything, its readers included
    p.output_node().prepend(wait)


def _bucket_apart(p: Program) -> None:
    gathers = [n for n in p.graph.nodes if n.target is comm.all_gather]
    meta.tag(gathers[0], bucket=0)  # fused, but not side by side
    meta.tag(gathers[2], bucket=0)


def _bucket_two_wire_dtypes(p: Program) -> None:
    first, second = [n for n in p.graph.nodes if n.target is comm.all_gather][:2]
    first.append(second)  # side by side (gathered earlier: a legal prefetch)
    second.args = (second.args[0], second.args[1], torch.bfloat16)  # but cast for the wire, the other not
    meta.tag(first, bucket=0)
    meta.tag(second, bucket=0)


@pytest.mark.parametrize(
    "breaks, says",
    [
        (
            _gather_after_its_reader,
            "reads %wait.* \\(the wait of group [0-9]+'s all_gather in the bwd: a pass moved it",
        ),
        (_gather_another_shard, "gathers %shard[0-9]+ \\(shard\\[[0-9]+\\]\\), not the shard of its group"),
        (_return_another_gradient, "is returned as group [0-9]+'s shard gradient but is not its reduction"),
        (_drop_a_release, "released 0 times"),
        (_release_early, "after its release"),
        (_wait_twice, "must be read by exactly one wait"),
        (_no_phase, "has no phase"),
        (_bucket_apart, "is in bucket 0, but does not stand next to its other members"),
        (_bucket_two_wire_dtypes, "is in bucket 0 with %.*, but one call cannot carry both"),
    ],
)
def test_verify_rejects_a_broken_program_and_names_the_node(program: Program, breaks: Callable, says: str):
    verify_program(program)  # the program as compiled is fine
    broken = program.copy()
    breaks(broken)
    with pytest.raises(VerifyError, match=f"after pass 'by hand': %.* {says}") as e:
        check(broken, after="by hand")
    assert "--- program around it ---" in str(e.value)


def test_a_forward_node_that_reads_a_tangent_is_rejected(program: Program):
    broken = program.copy()
    tangent = next(n for n, r in zip(broken.placeholders(), broken.inputs) if r.kind == "tangent")
    first = next(n for n in broken.graph.nodes if n.op == "call_function")
    with broken.graph.inserting_before(first):
        reader = broken.graph.call_function(torch.ops.aten.neg.default, (tangent,))
    meta.tag(reader, phase=FWD)
    with pytest.raises(VerifyError, match="is a forward node that reads a tangent"):
        check(broken, after="by hand")


def test_verify_as_a_pass_leaves_the_input_untouched(program: Program):
    before = list(program.history)
    out, stats = verify_program(program)
    assert stats == Note("ok") and out is not program and program.history == before
