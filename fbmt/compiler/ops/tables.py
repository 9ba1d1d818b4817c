"""What fbmt knows about each op, in one place: which ops alias their input, which have effects,
which are expensive, and how many FLOPs a matrix product or attention does.

Supporting a new op (a new attention kernel, say) means adding its name to the tables here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx as fx

from fbmt.compiler import collectives
from fbmt.compiler.ops import host_call, record

aten = torch.ops.aten


def op_name(target: Any) -> str:
    """An aten op's name without its overload ("mm", "view"); a function's `__name__`."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


# ---- aliasing ------------------------------------------------------------------------------

# Ops whose output costs nothing to make: views, and a reshape or copy that aliases a fresh value.
# A run of these alone is not worth a compiled region, and the simulator charges them no time.
FREE = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "slice",
        "t",
        "transpose",
        "permute",
        "expand",
        "alias",
        "unsqueeze",
        "squeeze",
        "select",
        "as_strided",
        "split",
        "split_with_sizes",
        "unbind",
        "detach",
        "lift_fresh_copy",
    }
)
# Reshapes of a whole value: what a matrix product's operand goes through on its way from a 3-D activation.
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def is_view(node: fx.Node) -> bool:
    """The node's output aliases its first input (view, slice, t, transpose, expand, ...), by its schema."""
    return is_view_op(node.target)


def is_view_op(t: Any) -> bool:
    """`is_view` of an op."""
    if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable:
        return False
    returns = t._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None


def aliases(node: fx.Node) -> bool:
    """The node's output shares its first input's memory: a view, or `_unsafe_view` (whose schema
    claims a new tensor, but which only reshapes the fresh value it is given)."""
    return is_view(node) or node.target is aten._unsafe_view.default


def costs_nothing(node: fx.Node) -> bool:
    """A view, a free reshape, or the unpacking of a multi-output op."""
    return node.target is operator.getitem or op_name(node.target) in FREE


def view_base(node: fx.Node) -> fx.Node:
    """The value a chain of views starts from."""
    while is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


# ---- effects -------------------------------------------------------------------------------

# Node targets with effects beyond their result: never dropped when unused, never recomputed, and a
# compiled region ends before each: communication (every kind of the collectives' table) and these:
# recording, a check that raises where eager would (NOTE: [Checks that raise] in compiler/assertions.py), and
# a function called on the host, which may draw (NOTE: [Host calls] in compiler/host_calls.py).
EFFECTFUL = record.OPS | {aten._assert_async.msg, host_call.host_call._opoverload}


def effectful(target: Any) -> bool:
    """Communication, recording, a mutation or a random draw."""
    if target in EFFECTFUL or collectives.is_collective(target):
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
    return False


def pure(node: fx.Node) -> bool:
    """A deterministic computation of its result alone: running it twice gives the same value."""
    if node.op != "call_function" or effectful(node.target):
        return False
    t = node.target
    return isinstance(t, torch._ops.OpOverload) or getattr(t, "__module__", None) == "_operator"


# ---- cost ------------------------------------------------------------------------------------

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
ATTENTION_FORWARD = frozenset(
    {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    }
)
ATTENTION_BACKWARD = frozenset(
    {
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_flash_attention_backward",
        "_efficient_attention_backward",
    }
)
# What remat="selective" saves instead of recomputing, and what no min-cut recomputes (NOTE: [Selective]).
EXPENSIVE = MATMULS | ATTENTION_FORWARD | {"convolution", "_scaled_mm", "_grouped_mm"}


def expensive(node: fx.Node) -> bool:
    """A forward matrix product, convolution or attention (or an output of one): worth saving."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and expensive(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and op_name(node.target) in EXPENSIVE


def hint(x: Any, largest: bool = True) -> Any:
    """A size as a plain number, for estimates only (memory, work): a symbolic one (a program for many
    sequence lengths) at the largest value its program admits (NOTE: [Dynamic sizes]), so that what the
    passes decide by memory holds at every size the program runs; without a bound, or with
    `largest=False`, at the value it was traced at. Neither makes the program depend on it."""
    if not isinstance(x, (torch.SymInt, torch.SymFloat)):
        return x
    node = x.node
    value = _upper(node) if largest else None
    if value is None:
        value = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr)
    return int(value) if isinstance(x, torch.SymInt) else float(value)


def _upper(node: Any) -> Any:
    """The largest value of a symbolic size's expression its shape environment allows; None if unbounded.
    Asked of every value the passes weigh, the same few expressions again and again: kept on the shape
    environment. A bound a later guard narrows stays the wider one, which errs towards less memory."""
    uppers = node.shape_env.__dict__.setdefault("_fbmt_uppers", {})
    if node.expr not in uppers:
        upper = node.shape_env.bound_sympy(node.expr).upper
        uppers[node.expr] = upper if isinstance(upper, sympy.Integer) else None  # not int_oo, torch's unbounded
    return uppers[node.expr]


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _matmul(node: fx.Node) -> float:
    args = [_val(a) for a in node.args]
    a, b = (args[0], args[1]) if op_name(node.target) in ("mm", "bmm", "_scaled_mm") else (args[1], args[2])
    return 2.0 * hint(a.numel()) * hint(b.shape[-1])


def _attention(node: fx.Node) -> float:
    q, k = _val(node.args[0]), _val(node.args[1])
    work = 4.0 * hint(q.numel()) * hint(k.shape[-2])  # QK^T and PV: 2 * b*h*s*t*d each
    if any(a is True for a in node.args[3:]) or node.kwargs.get("is_causal"):
        work /= 2
    return work * (2.5 if op_name(node.target) in ATTENTION_BACKWARD else 1.0)


def _grouped_mm(node: fx.Node) -> float:
    a, b, out = _val(node.args[0]), _val(node.args[1]), _val(node)
    if a.dim() == 2 and b.dim() == 2:  # groups along the contraction (a weight gradient)
        return 2.0 * hint(a.shape[0]) * hint(a.shape[1]) * hint(b.shape[1])
    return 2.0 * hint(out.numel()) * hint(a.shape[-1])


def _convolution(node: fx.Node) -> float:
    out, w = _val(node), _val(node.args[1])
    return 2.0 * hint(out.numel()) * w[0].numel() if out is not None else 0.0


FLOPS: dict[str, Callable[[fx.Node], float]] = {
    **dict.fromkeys(MATMULS | {"_scaled_mm"}, _matmul),
    **dict.fromkeys(ATTENTION_FORWARD | ATTENTION_BACKWARD, _attention),
    "convolution": _convolution,
    "_grouped_mm": _grouped_mm,
}


def flops(node: fx.Node) -> float:
    """Floating-point operations of a matrix product, attention or convolution (0 for the rest)."""
    rule = FLOPS.get(op_name(node.target))
    return rule(node) if rule is not None else 0.0
