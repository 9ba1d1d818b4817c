"""FP8: the blocks' matrix products in 8-bit floats, scaled dynamically (`fbmt.compile(fp8=...)`).

Requires: a joint Program before shard (parameters are inputs of their own; the products recompute
makes are products too).
Ensures: with a recipe, every `mm` (and a linear layer's `addmm`) of the repeated layers (blocks named
`<list>.<i>`: its weight operand, or the parameter its result is the gradient of, is such a layer's)
whose operands are floating and whose inner and outer sizes are known multiples of 16 (what the FP8
kernels take) becomes `_scaled_mm` of its operands cast to FP8; every other product is left as it
was, and the pass's line in `print(program)` counts both. Without a recipe the program is returned
as it came.

NOTE: [FP8 products]
What it computes, per product `a @ b` ([m, k] @ [k, n]), each operand on its own:
    amax  = max |x|                  over the whole tensor ("tensorwise"), or per row of `a` and per
                                     column of `b` ("rowwise": a scale for each of the m rows and n columns)
    scale = FP8_MAX / max(amax, tiny)   so the largest value lands on the format's largest
    x8    = (x * scale) clamped to +-FP8_MAX, cast to FP8
and then `_scaled_mm(a8, b8, 1/scale_a, 1/scale_b)` in the product's own dtype, accumulated in fp32 by
the kernel. Dynamic scaling: the scales come from this step's values, nothing is carried between
steps (no amax history to keep, checkpoint or get wrong). Formats as in torchao's recipes: with
"tensorwise", values e4m3 (more precision) and gradients e5m2 (more range), a gradient being an
operand that depends on a loss gradient (a tangent); with "rowwise" everything e4m3, the rows'
scales giving the range.
Why every `mm` alone: in the joint graph a linear layer is three products (the forward, the input's
and the weight's gradients, and under recompute a fourth), each taking its operands as they are,
so each is made FP8 by itself with no need to pair them up; an operand read by several products is
cast once per product (with Inductor, in the region of that product).
Which products: those of the repeated layers (where the work is), not the output head's or the
embeddings', as torchao's convention leaves the last layer in high precision. A product's layer is
its weight's (found through views, a cast, and the `cat` of a merged product's weights) or that of
the parameter whose gradient it makes; a product of neither kind is counted as outside the layers.
`_scaled_mm` wants its first operand row-major and its second column-major; the casts write them so.

NOTE: [One cast per value]
A value is read by several products: a linear layer's input by its forward product and its weight's
gradient, a loss gradient by the input's and the weight's gradients, a weight by the forward, its
recompute and the input's gradient. Each product reads it in a layout of its own (the value or its
transpose), but the numbers are the same, so a tensorwise amax (a maximum over every element, which a
transpose does not change) is computed once per value, over the value as it is stored (Inductor
reads a reduction through a transpose with strided loads, several times slower), and a cast once per
value, layout and format; a rowwise amax once per value and layout (over the stored value's rows, or
its columns for the transpose's rows). Each is made before the first product that reads it (the
products are rewritten in program order), and the later ones read it, in the forward, the recompute
or the backward (a scalar the backward reads is saved; one computed from weights alone is computed
again in the backward by the shard pass, from the weights it gathers there). The program computes
the same numbers as casting per product, with fewer reductions over the operands.
A value that is a cat of transposes (a merged q/k/v product's input gradient: the heads' gradients
joined) is still reduced as the cat: its amax reads through the transposes, slowly, but taken over
the pieces as stored it ran slower in all (BENCHMARKS.md, FP8), since the rotary embedding's
backward, read by the amax and the cast, was then computed again inside the transposed cast; and
with the cat joined into a buffer first (a ConcatKernel), a cast kernel as slow took its place.
A weight's amax is taken once a step: the shard pass saves it for the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fbmt.compiler import meta, ops
from fbmt.compiler.ops import emit
from fbmt.compiler.program import Program

aten = torch.ops.aten

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_PRODUCTS = (aten.mm.default, aten.addmm.default)  # a linear layer's, without and with its bias
_CAT = aten.cat.default  # weights side by side (NOTE: [Merged products])
_TINY = 1e-12  # an all-zero operand gets scale FP8_MAX / _TINY: its cast is zeros, as the product


@dataclass(frozen=True)
class Fp8Stats:
    """What the fp8 pass did (NOTE: [Pass stats])."""

    recipe: str | None
    products: int  # products made FP8
    kept: tuple[str, ...]  # why the other products were left as they were: a count and a reason a line

    def __str__(self) -> str:
        if self.recipe is None:
            return "off"
        return "; ".join([f"{self.products} block products in FP8 ({self.recipe} scales)", *self.kept])


def fp8_products(program: Program, recipe: str | None = None) -> tuple[Program, Fp8Stats]:
    if recipe is None:
        return program.copy(shared=True), Fp8Stats(None, 0, ())
    if recipe not in RECIPES:
        raise ValueError(f"fbmt.compile(fp8={recipe!r}): expected one of {RECIPES} or None")
    program = program.copy()
    g = program.graph
    gradients = _gradients(program)
    owner = _Owners(program)
    casts = _Casts(recipe == "rowwise")
    made, kept = 0, {}
    for node in [n for n in g.nodes if n.target in _PRODUCTS]:  # in program order: NOTE: [One cast per value]
        why = None if _layer(owner.block(node)) else "outside the repeated layers (the head, the embeddings)"
        why = why or _unfit(node, recipe == "rowwise")
        if why:
            kept[why] = kept.get(why, 0) + 1
            continue
        _rewrite(g, node, recipe, gradients, casts)
        made += 1
    g.lint()
    return program, Fp8Stats(recipe, made, tuple(f"{k} kept: {why}" for why, k in kept.items()))


class _Owners:
    """The block a product belongs to, by the parameter it reads as its weight or whose gradient it
    makes (the forward's block tags do not reach the backward before the shard pass)."""

    def __init__(self, program: Program):
        block = {s.name: g.block for g in program.layout.groups for s in g.slots}  # the layout's own (ties too)
        self.param = {n: block[r.key] for n, r in zip(program.placeholders(), program.inputs) if r.kind == "param"}
        self.grad = {
            v: block[r.key]
            for r, v in zip(program.outputs, program.output_values())
            if r.kind == "grad" and isinstance(v, fx.Node)
        }

    def block(self, product: fx.Node) -> str | None:
        for x in _operands(product):
            while x not in self.param and x.op == "call_function" and (_passes_through(x) or x.target is _CAT):
                x = x.args[0][0] if x.target is _CAT else x.args[0]  # merged weights: the first one's
            if x in self.param:
                return self.param[x]
        todo, seen = [product], 0
        while todo and seen < 8:  # its result through views and a cast to a parameter's gradient
            x, seen = todo.pop(), seen + 1
            if x in self.grad:
                return self.grad[x]
            todo += [u for u in x.users if u.op == "call_function" and _passes_through(u)]
        return None


def _passes_through(node: fx.Node) -> bool:
    """A view or a dtype cast: its value is its first argument's."""
    return ops.is_view(node) or node.target in (aten._to_copy.default, aten._unsafe_view.default)


def _layer(block: str | None) -> bool:
    """Whether a block is one of a repeated list of layers (`layers.3`, `h.0`): its last name an index."""
    return bool(block) and block.rpartition(".")[2].isdigit()


def _unfit(node: fx.Node, rowwise: bool) -> str | None:
    """Why a product stays as it is, or None."""
    if node.kwargs:  # addmm's beta or alpha
        return "a product scaled by beta or alpha"
    a, b = (x.meta.get("val") for x in _operands(node))
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return "an operand of unknown value"
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or a.dtype != b.dtype:
        return f"operands of {a.dtype} and {b.dtype}"
    if rowwise and a.dtype != torch.bfloat16:  # the kernels with a scale per row write bf16 only
        return f"rowwise scales with {a.dtype} operands (param_dtype=torch.bfloat16 takes them)"
    k, n = a.shape[1], b.shape[1]
    if not all(isinstance(s, int) and s % 16 == 0 for s in (k, n)):
        return "inner or outer size not a known multiple of 16"
    return None


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    return node.args[1:3] if node.target is aten.addmm.default else node.args[:2]


def _gradients(program: Program) -> set[fx.Node]:
    """Nodes whose value depends on a loss gradient (a tangent input): the operands cast to e5m2."""
    tangents = {n for n, r in zip(program.placeholders(), program.inputs) if r.kind == "tangent"}
    seen = set(tangents)
    for n in program.graph.nodes:
        if n not in seen and any(a in seen for a in n.all_input_nodes):
            seen.add(n)
    return seen


class _Casts:
    """The FP8 casts of a program's operands, each made once (NOTE: [One cast per value])."""

    def __init__(self, rowwise: bool):
        self.rowwise = rowwise
        self.amaxes: dict[tuple, fx.Node] = {}
        self.scales: dict[tuple, fx.Node] = {}
        self.made: dict[tuple, tuple[fx.Node, fx.Node]] = {}

    def cast(self, x: fx.Node, flip: bool, fmt: torch.dtype, e: Callable[..., fx.Node]) -> tuple[fx.Node, fx.Node]:
        """`x` (transposed if `flip`) in `fmt`, row-major, scaled by its amax (per row if rowwise); and
        1 / scale. `e` emits a node before the product being rewritten."""
        root, flipped = _untransposed(x)
        flipped ^= flip
        key = (root, flipped, fmt)
        if key not in self.made:
            operand = e(aten.t.default, root) if flipped else root
            wide = (
                operand
                if operand.meta["val"].dtype == torch.float32
                else e(aten._to_copy.default, operand, dtype=torch.float32)
            )
            top = torch.finfo(fmt).max
            scale = self._scale(root, flipped, fmt, e)
            x8 = e(aten._to_copy.default, e(aten.clamp.default, e(aten.mul.Tensor, wide, scale), -top, top), dtype=fmt)
            if not x8.meta["val"].is_contiguous():
                x8 = e(aten.clone.default, x8, memory_format=torch.contiguous_format)
            self.made[key] = (x8, e(aten.reciprocal.default, scale))
        return self.made[key]

    def _scale(self, root: fx.Node, flipped: bool, fmt: torch.dtype, e: Callable[..., fx.Node]) -> fx.Node:
        """FP8_MAX / amax: over the whole value, whatever its layout ("tensorwise"), or per row of the
        operand as read ("rowwise")."""
        value = (root, flipped) if self.rowwise else (root,)
        if value not in self.amaxes:  # over the value as stored: a reduction read through a transpose is strided
            stored = (
                root if root.meta["val"].dtype == torch.float32 else e(aten._to_copy.default, root, dtype=torch.float32)
            )
            if not self.rowwise:
                amax = e(aten.amax.default, e(aten.abs.default, stored), [], False)
            elif flipped:  # the transpose's rows are the value's columns: [1, n] made as stored, as [n, 1]
                amax = e(aten.t.default, e(aten.amax.default, e(aten.abs.default, stored), [0], True))
            else:
                amax = e(aten.amax.default, e(aten.abs.default, stored), [1], True)
            self.amaxes[value] = amax
        if value + (fmt,) not in self.scales:
            inverse = e(aten.reciprocal.default, e(aten.clamp_min.default, self.amaxes[value], _TINY))
            self.scales[value + (fmt,)] = e(aten.mul.Tensor, inverse, torch.finfo(fmt).max)
        return self.scales[value + (fmt,)]


def _untransposed(x: fx.Node) -> tuple[fx.Node, bool]:
    """The value `x` is a transpose of (through any number of 2-D transposes), and whether it is one."""
    flipped = False
    while x.op == "call_function" and (
        x.target is aten.t.default
        or (x.target is aten.transpose.int and sorted(d % 2 for d in x.args[1:3]) == [0, 1])
        or (x.target is aten.permute.default and [d % 2 for d in x.args[1]] == [1, 0])
    ):
        if x.args[0].meta["val"].dim() != 2:
            break
        x, flipped = x.args[0], not flipped
    return x, flipped


def _rewrite(g: fx.Graph, mm: fx.Node, recipe: str, gradients: set[fx.Node], casts: _Casts) -> None:
    a, b = _operands(mm)
    out_dtype = mm.meta["val"].dtype
    tags = {k: v for k, v in meta.facts(mm).items() if k != "phase"}
    phase = meta.phase(mm)

    def e(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return emit(g, target, args, phase, kwargs=kwargs or None, **tags)

    def fmt(x: fx.Node) -> torch.dtype:
        return E5M2 if recipe == "tensorwise" and x in gradients else E4M3

    with g.inserting_before(mm):
        fa = fmt(a)
        a8, inv_a = casts.cast(a, False, fa, e)
        # the second operand column-major: its transpose cast row-major, transposed back (a view); never
        # both in e5m2, which the kernels refuse
        bt8, inv_b = casts.cast(b, True, E4M3 if fa == E5M2 else fmt(b), e)
        b8 = e(aten.t.default, bt8)
        if recipe == "rowwise":  # b's scales per column: [n, 1] made on the transpose, as [1, n]
            inv_b = e(aten.t.default, inv_b)
        out = e(aten._scaled_mm.default, a8, b8, inv_a, inv_b, None, None, out_dtype)
        if mm.target is aten.addmm.default:  # the bias in the product's dtype, added after (Inductor fuses it)
            out = e(aten.add.Tensor, out, mm.args[0])
    mm.replace_all_uses_with(out)
    g.erase_node(mm)
