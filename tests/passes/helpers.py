"""What the pass tests share: a tiny model traced into a Program (before any pass), the pipeline's
passes up to one of them, and a run of a program on the reference executor, on one rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fbmt.compiler import collectives as comm
from fbmt.compiler import meta, ops, pipeline
from fbmt.compiler.layout import Layout, copy_into_shard, plan_layout
from fbmt.compiler.options import CompileOptions
from fbmt.compiler.passes import check, run_passes
from fbmt.compiler.plan import Plan
from fbmt.compiler.program import Program, Role
from fbmt.compiler.runtime.reference import run_program
from fbmt.compiler.trace import trace


def traced(model: nn.Module, *inputs: torch.Tensor, world_size: int = 1, **layout: Any) -> Program:
    """The joint program of one call `model(*inputs)`, as traced: no pass has run."""
    plan = plan_layout(model, world_size, layout.get("blocks"), param_dtype=layout.get("param_dtype"))
    return trace(
        model, plan, dict(model.named_buffers()), inputs, {}, param_device=torch.device("cpu"), needs_grad=True
    )


def through(program: Program, last: str, **options: Any) -> Program:
    """`program` after the pipeline's passes up to, and without, pass `last`."""
    passes = pipeline.passes(Plan.of(CompileOptions(**options), program.layout.world_size))
    names = [name for name, _ in passes]
    return run_passes(program, passes[: names.index(last)], checks=True)


def apply(fn: Any, program: Program, **options: Any) -> tuple[Program, Any]:
    """Run one pass and check the invariants of what it returns; the program and the pass's stats."""
    out, stats = fn(program, **options)
    check(out, after=getattr(fn, "__name__", "pass"))
    return out, stats


def run(program: Program, model: nn.Module, inputs: list[torch.Tensor], tangents: list[torch.Tensor]) -> dict:
    """Run a one-rank program on the reference executor with `model`'s parameter values: the outputs
    by index, and every parameter's gradient by name (from the `grad` or the `shard_grad` outputs)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    layout: Layout = program.layout
    assert layout.world_size == 1, "the reference runs one rank here"

    def shard(group: int) -> torch.Tensor:
        g = layout.groups[group]
        flat = torch.zeros(g.shard_numel, dtype=g.dtype)
        copy_into_shard(flat, g, 0, params)
        return flat

    feeders = {
        "param": params.__getitem__,
        "buffer": buffers.__getitem__,
        "input": inputs.__getitem__,
        "tangent": tangents.__getitem__,
        "shard": shard,
    }
    results = run_program(program, lambda role: feeders[role.kind](role.key))
    out: dict[str, Any] = {"outputs": {}, "grads": {}}
    for role, value in results.items():
        if role.kind == "output":
            out["outputs"][role.key] = value
        elif role.kind == "grad":
            out["grads"][role.key] = value
        elif role.kind == "shard_grad" and value is not None:
            for s in layout.groups[role.key].slots:
                out["grads"][s.name] = value[s.offset : s.offset + s.numel].view(s.shape)
    return out


def assert_same_results(a: dict, b: dict, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    assert a["outputs"].keys() == b["outputs"].keys() and a["grads"].keys() == b["grads"].keys()
    for kind in ("outputs", "grads"):
        for k in a[kind]:
            torch.testing.assert_close(a[kind][k], b[kind][k], rtol=rtol, atol=atol, msg=lambda m: f"{kind} {k}: {m}")


REDUCTIONS = (comm.reduce_scatter, comm.all_to_all_reduce)  # the reduction kinds fbmt emits


def nodes(program: Program, target: Any, phase: str | None = None) -> list:
    """The nodes calling `target` (or any of a tuple of targets), optionally of one phase."""
    targets = target if isinstance(target, tuple) else (target,)
    return [n for n in program.graph.nodes if n.target in targets and (phase is None or meta.phase(n) == phase)]


def tangents_for(program: Program, seed: int = 0) -> list[torch.Tensor]:
    """Random tangents of the shapes the program's tangent placeholders take."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n.meta["val"].shape, generator=g, dtype=n.meta["val"].dtype)
        for n, r in zip(program.placeholders(), program.inputs)
        if r.kind == "tangent"
    ]


__all__ = ["traced", "through", "apply", "run", "assert_same_results", "nodes", "tangents_for", "ops", "Role"]
