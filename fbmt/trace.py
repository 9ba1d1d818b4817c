"""Trace a module's forward *and* backward into one functional, aten-level fx graph.

Requires: a module whose parameters may live on any device, `meta` included (tracing runs on fake
tensors, so a 13B model traces without being materialized), and a `Layout` from the compile step.
Ensures: a `Program` whose graph is functional (no in-place ops except one `copy_` per mutated
buffer, placed at the end of the forward), every node stamped with its phase (NOTE: [Phases]) and
every forward node with the innermost module path that produced it.

How: `make_fx` over `torch.func.functional_call` + `torch.autograd.grad` gives the joint graph,
in-place ops included; a second `make_fx` over `torch.func.functionalize` of that graph removes the
mutations (the functional transforms refuse `requires_grad_` inside, hence two steps). Global
module hooks tag each node with its module while the first trace runs; an Interpreter carries the
tags through the second.
"""

from __future__ import annotations

import linecache
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from fbmt.layout import Layout
from fbmt.ops import record
from fbmt.program import BWD, FWD, Program, Role

aten = torch.ops.aten


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module, the op and the source line."""


_depth = 0


def tracing() -> bool:
    """True while fbmt traces a module (its forward then runs on fake tensors)."""
    return _depth > 0


@contextmanager
def _tracing() -> Iterator[None]:
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


@_tracing()  # a fresh context for every call: tracing() is True while it runs
def trace(
    module: nn.Module,
    layout: Layout,
    buffers: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    *,
    param_device: torch.device,
    needs_grad: bool,
    trainable: tuple[bool, ...] | None = None,
) -> Program:
    """Trace one call `module(*args, **kwargs)` into a joint Program (see the module docstring).

    `trainable[k]` says whether group k's parameters get gradients (default: `group.requires_grad`).
    """
    fake_mode = FakeTensorMode()
    rg = trainable if trainable is not None else tuple(g.requires_grad for g in layout.groups)
    params = [(s.name, s.shape, g.compute, rg[g.index]) for g in layout.groups for s in g.slots]
    with fake_mode:
        fake_params = [torch.empty(shape, dtype=dt, device=param_device) for _, shape, dt, _ in params]
    fake_buffers = [fake_mode.from_tensor(b) for b in buffers.values()]
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    fake_inputs = [fake_mode.from_tensor(leaves[i]) for i in tensor_pos]
    input_rg = [needs_grad and leaves[i].requires_grad for i in tensor_pos]
    names = [p[0] for p in params] + list(buffers)
    param_rg = [needs_grad and p[3] for p in params]

    def call(ps: list, bs: list, xs: list) -> Any:
        full = list(leaves)
        for i, x in zip(tensor_pos, xs):
            full[i] = x
        a, kw = pytree.tree_unflatten(full, in_spec)
        return functional_call(module, dict(zip(names, [*ps, *bs])), a, kw)

    # A fake forward first: the shapes of the outputs the backward will receive gradients for.
    with _translate_errors(module) as tagger, tagger.installed(), _prints(tagger), fake_mode:
        with torch.enable_grad() if needs_grad else torch.no_grad():
            probe = call(
                [p.detach().requires_grad_(rg) for p, rg in zip(fake_params, param_rg)],
                [b.clone() for b in fake_buffers],
                [x.detach().requires_grad_(rg) for x, rg in zip(fake_inputs, input_rg)],
            )
    out_leaves, out_spec = pytree.tree_flatten(probe)
    tensor_out = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
    out_constants = {i: o for i, o in enumerate(out_leaves) if not isinstance(o, torch.Tensor)}
    diff_out = [i for i in tensor_out if needs_grad and out_leaves[i].requires_grad]
    wrt_params = [i for i, rg in enumerate(param_rg) if rg]
    wrt_inputs = [i for i, rg in enumerate(input_rg) if rg]
    needs_grad = needs_grad and bool(diff_out) and bool(wrt_params or wrt_inputs)
    with fake_mode:
        fake_tangents = (
            [torch.empty(out_leaves[i].shape, dtype=out_leaves[i].dtype, device=out_leaves[i].device) for i in diff_out]
            if needs_grad
            else []
        )
    del probe, out_leaves

    n_p, n_b, n_x = len(fake_params), len(fake_buffers), len(fake_inputs)

    def joint(*flat: torch.Tensor) -> list:
        ps, bs = list(flat[:n_p]), list(flat[n_p : n_p + n_b])
        xs, ts = list(flat[n_p + n_b : n_p + n_b + n_x]), list(flat[n_p + n_b + n_x :])
        if needs_grad:
            ps = [p.detach().requires_grad_(rg) for p, rg in zip(ps, param_rg)]
            xs = [x.detach().requires_grad_(rg) for x, rg in zip(xs, input_rg)]
        with torch.enable_grad() if needs_grad else torch.no_grad():
            outs = pytree.tree_leaves(call(ps, bs, xs))
        tensors = [outs[i] for i in tensor_out]
        if not needs_grad:
            return tensors
        wrt = [ps[i] for i in wrt_params] + [xs[i] for i in wrt_inputs]
        grads = torch.autograd.grad([outs[i] for i in diff_out], wrt, ts, allow_unused=True)
        return [*tensors, *grads]

    flat_in = [*fake_params, *fake_buffers, *fake_inputs, *fake_tangents]
    with _translate_errors(module) as tagger, tagger.installed(), _prints(tagger):
        first = make_fx(joint, tracing_mode="fake")(*flat_in)
    with _translate_errors(module):
        gm = make_fx(functionalize(lambda *a: _TagCarrier(first).run(*a), remove="mutations"), tracing_mode="fake")(
            *flat_in
        )

    inputs = (
        [Role("param", p[0]) for p in params]
        + [Role("buffer", b) for b in buffers]
        + [Role("input", i) for i in range(n_x)]
        + [Role("tangent", i) for i in diff_out]
    )
    outputs = [Role("output", i) for i in tensor_out] + (
        [Role("grad", params[i][0]) for i in wrt_params] + [Role("input_grad", i) for i in wrt_inputs]
        if needs_grad
        else []
    )
    program = Program(
        graph=gm.graph,
        inputs=inputs,
        outputs=outputs,
        layout=layout,
        out_spec=out_spec,
        out_constants=out_constants,
        needs_grad=needs_grad,
    )
    _canonicalize(program)
    return program


def _canonicalize(program: Program) -> None:
    """Flatten the output, drop no-op detaches, stamp phases, move buffer updates into the forward."""
    g = program.graph
    out = program.output_node()
    (values,) = out.args
    out.args = (list(pytree.tree_leaves(values, is_leaf=lambda x: x is None)),)
    for n in list(g.nodes):
        if n.op == "call_function" and n.target in (aten.detach.default, aten.alias.default):
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
    placeholders = set(program.placeholders())
    # Functionalization writes mutated inputs back with copy_ at the very end; those are forward effects.
    epilogue = [
        n for n in g.nodes if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in placeholders
    ]
    last_fwd = None
    for n in g.nodes:
        if n.op == "call_function" and "fbmt_module" in n.meta and n not in epilogue:
            last_fwd = n
    for n in epilogue:
        (last_fwd or next(iter(g.nodes))).append(n)
        last_fwd = n
        n.meta["fbmt_module"] = ""
    phase = FWD
    for n in g.nodes:
        if n.op in ("placeholder", "output"):
            continue
        n.meta["fbmt_phase"] = phase
        if n is last_fwd:
            phase = BWD
    g.lint()


class _TagCarrier(fx.Interpreter):
    """Runs the first trace under functionalization and copies module tags onto the new nodes."""

    def run_node(self, n: fx.Node) -> Any:
        graph = get_proxy_mode().tracer.graph
        before = graph._root.prev
        result = super().run_node(n)
        path = n.meta.get("fbmt_module")
        if path is not None:
            k = before.next
            while k is not graph._root:
                k.meta.setdefault("fbmt_module", path)
                k = k.next
        return result


class _ModuleTagger:
    """Global module hooks that tag each traced node with the innermost module that made it."""

    def __init__(self, module: nn.Module):
        self.paths = {m: name for name, m in module.named_modules(remove_duplicate=False)}
        self.stack: list[tuple[str, fx.Node]] = []

    def _pre(self, mod: nn.Module, args: Any) -> None:
        if mod in self.paths:
            mode = get_proxy_mode()
            self.stack.append((self.paths[mod], mode.tracer.graph._root.prev if mode is not None else None))

    def _post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if mod not in self.paths or not self.stack:
            return
        path, start = self.stack.pop()
        if start is None:  # the fake probe: no graph to tag, the stack only serves error messages
            return
        root = start.graph._root
        k = start.next
        while k is not root:
            k.meta.setdefault("fbmt_module", path)
            k = k.next

    @property
    def current(self) -> str | None:
        return self.stack[-1][0] if self.stack else None

    @contextmanager
    def installed(self) -> Iterator[None]:
        pre = nn.modules.module.register_module_forward_pre_hook(self._pre)
        post = nn.modules.module.register_module_forward_hook(self._post)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


def _prints(tagger: _ModuleTagger) -> Any:
    """print() in the forward becomes an op of the program (NOTE in fbmt/ops/record.py)."""
    return record.prints_traced(lambda: f"'{tagger.current or '<root>'}'")


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["fbmt"]))


def _user_frame(exc: BaseException) -> str:
    """`file:line: source` of the innermost frame in the user's code, or '' if there is none."""
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        f = frame.filename
        if f.startswith(_LIBRARY_DIRS) or "/lib/python" in f and "site-packages" not in f:
            continue
        line = (frame.line or linecache.getline(f, frame.lineno)).strip()
        found = f"{f}:{frame.lineno}: {line}"
    return found


_HINTS = {
    "DataDependentOutputException": "the value of a tensor decides Python control flow or is read "
    "with .item()/.tolist()/bool(); tracing runs on fake tensors that have no values. Use "
    "torch.where / masking instead of `if`, or compute the value outside the model and pass it in",
    "DynamicOutputShapeException": "the output shape depends on tensor values (nonzero, masked_select, "
    "unique, ...); use fixed-shape alternatives (torch.where with a mask)",
    "PrintError": "print() inside a traced forward runs as an op of the program, on every call, and "
    "prints the tensors it is given as arguments",
    "UnsupportedOperatorException": "this operator has no fake-tensor implementation; "
    "register one with torch.library.register_fake or move the op outside the model",
}


@contextmanager
def _translate_errors(module: nn.Module) -> Iterator[_ModuleTagger]:
    tagger = _ModuleTagger(module)
    try:
        yield tagger
    except TraceError:
        raise
    except Exception as e:  # translate any tracing failure into one actionable message
        kind = type(e).__name__
        op = getattr(e, "func", None)
        where = tagger.current
        path = "<root>" if where == "" else where or "<unknown>"
        mod = module.get_submodule(where).__class__.__name__ if where else module.__class__.__name__
        first = (str(e).strip().splitlines() or [kind])[0]
        hint = _HINTS.get(
            kind,
            "see the original error above; if the module is fine in eager mode, please report it with this message",
        )
        at = _user_frame(e)
        msg = (
            f"fbmt.compile could not trace module '{path}' ({mod})"
            + (f", op {op}" if op is not None else "")
            + f": {kind}: {first}\n"
            + (f"  at {at}\n" if at else "")
            + f"  why: {hint}."
        )
        raise TraceError(msg) from e
