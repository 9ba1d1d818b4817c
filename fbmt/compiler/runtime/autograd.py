"""Autograd glue: run an Executable's forward, and its backward when autograd asks, as one
`torch.autograd.Function`, so the training loop stays plain PyTorch: `loss.backward()` runs the
compiled backward, and autograd accumulates each shard's gradient into `shard.grad`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fbmt.compiler.runtime.graphs import Graphed
from fbmt.compiler.runtime.partition import Executable
from fbmt.compiler.runtime.unsynced import Unsynced, active

Routes = dict[int, list[tuple[int, int, int]]]  # group -> (view index, lo, hi in the shard) of each view


class RunProgram(torch.autograd.Function):
    """Runs an Executable's forward, and its backward when autograd asks, through `runner`: the
    Executable itself, or its CUDA graphs (`Graphed`).

    `args` are the forward graph's inputs, then (view mode) the per-parameter views: `routes` says
    which slice of each shard gradient is the gradient of which view argument. `gradient_sync`: the
    model's sync switch, which its backward's reductions read (NOTE: [Accumulation without sync]).
    """

    @staticmethod
    def forward(
        ctx: Any,
        exe: Executable,
        runner: Executable | Graphed,
        routes: Routes | None,
        gradient_sync: Unsynced | None,
        *args: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        outs, saved = runner.run_forward(*args[: len(exe.fwd_inputs)])
        ctx.exe, ctx.runner, ctx.routes, ctx.saved, ctx.n_args = exe, runner, routes, saved, len(args)
        ctx.gradient_sync = gradient_sync
        ctx.generation = exe.regions.generation if exe.regions is not None else None
        diff = set(exe.diff_outputs)
        # an output without a gradient is returned as an alias of its own. Where it is the very tensor of
        # one with (a forward returning `y` and `y.detach()`, the graph's one node twice), marking it would
        # mark the other too, whose gradient would then be lost without a word; where it is a view of one
        # (`y.detach()[:, 1:]` of a `y` written in place: the program takes it from `y` itself), autograd
        # would have it require grad as its base does, as eager's does not
        outs = [o.detach() if i not in diff and isinstance(o, torch.Tensor) else o for i, o in enumerate(outs)]
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i not in diff])
        # an output the caller does not differentiate gets no gradient here, but one that backward makes
        # (NOTE: [Unused outputs' gradients] in runtime/partition.py)
        ctx.set_materialize_grads(False)
        ctx.shapes = [(outs[i].shape, outs[i].dtype, outs[i].device) for i in exe.diff_outputs]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        exe = ctx.exe
        if torch.is_grad_enabled():  # autograd runs a backward with grad on for create_graph=True alone
            raise RuntimeError(
                "fbmt: a gradient of a compiled model's gradients was asked for (create_graph=True: a gradient "
                "penalty, a double backward, a Hessian-vector product). The compiled backward is a program of "
                "its own that autograd cannot differentiate, so the second-order terms through the model would "
                "be missing. Compute such a term with an eager copy of the model (loaded from "
                "model.state_dict()), or leave create_graph off"
            )
        if ctx.saved is None:
            raise RuntimeError(
                "fbmt: backward through the same compiled call twice is not supported "
                "(its saved values were freed); run the forward again"
            )
        expand = exe.zero_tangents if ctx.runner is exe else None  # graphs copy their inputs into buffers
        tangents = [
            grads[i].contiguous()
            if grads[i] is not None
            else torch.zeros((), dtype=dtype, device=device).expand(shape)
            if expand is not None and expand[k]
            else torch.zeros(shape, dtype=dtype, device=device)
            for k, (i, (shape, dtype, device)) in enumerate(zip(exe.diff_outputs, ctx.shapes))
        ]
        saved, ctx.saved = ctx.saved, None  # the graph empties the list: each value dies at its last use
        regions = exe.regions.backward_of(ctx.generation) if exe.regions is not None else contextlib.nullcontext()
        with active(ctx.gradient_sync), regions:  # NOTE: [Accumulation without sync]
            results = ctx.runner.run_backward(saved, *tangents)
        out: list[torch.Tensor | None] = [None] * ctx.n_args
        for arg, result in exe.grad_slots:
            grad, role = results[result], exe.fwd_inputs[arg]
            if ctx.routes is not None and role.kind == "shard":
                if grad is not None:
                    for view, lo, hi in ctx.routes[role.key]:
                        out[len(exe.fwd_inputs) + view] = grad[lo:hi]
            else:
                out[arg] = grad
        return (None, None, None, None, *out)
