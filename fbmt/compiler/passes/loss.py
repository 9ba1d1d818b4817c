"""Loss: a cross-entropy over a large vocabulary, computed chunk by chunk over the tokens.

Requires: a joint Program from the trace (its forward and backward; or a forward alone).
Ensures: each cross-entropy (`F.cross_entropy` traces to `_log_softmax` then `nll_loss_forward`, and
their two backward ops) whose fp32 log-probabilities would take more than CHUNK_BYTES, without
class weights, averaged or summed, is computed in chunks of rows (tokens): no
[tokens, vocab] tensor of fp32 exists any more, in the forward or the backward. Values equal
eager's up to the order of summation. Every other cross-entropy is left as it was, and the pass's
line in `print(program)` says why.

NOTE: [Chunked cross-entropy]
What eager does: the logits of a language model ([tokens, vocab], in the model's dtype) are cast to
fp32 (Hugging Face's loss does it; so does fbmt's zoo), `log_softmax` makes a second fp32 tensor of
that size, which the backward keeps, and the backward makes a third (the gradient, before its cast
back). At 8k tokens a step and a 32k vocabulary each is 1 GiB; at 128k, 4 GiB; and it sits at the
very end of the forward, where the activations are at their peak.
What this pass makes of it: eager's own ops, on chunks of tokens. The forward casts a chunk of the
logits, takes its `log_softmax` and sums its `nll_loss` (the tokens that are not `ignore_index`), so
only one chunk of fp32 exists at a time; the chunks' sums and counts add up to the loss (divided by
the count for `reduction="mean"`). It keeps only the logits, in their own dtype (Hugging Face
returns them anyway). The backward makes each chunk's log-probabilities again, runs the two
backward ops on them with the whole loss's count, casts the result to the logits' dtype, and
concatenates the chunks into the logits' gradient (Inductor writes each chunk in place). Each
token's loss and gradient is eager's to the bit; only the order of the sum over tokens changes. The
chunk count makes one chunk's fp32 at most CHUNK_BYTES. The price is one more `log_softmax` over
the logits, in the backward.
Why a pass and not a kernel: the trace sees the ops Hugging Face's and everyone's loss functions
call, unmodified, and the pass finds them by their ops (the cast and the views before them
included), so no model is rewritten. The linear layer that makes the logits is left alone: its
output is the logits the model returns.
In a program of symbolic sizes (NOTE: [Dynamic sizes]) the number of tokens is a symbol: the
number of chunks is the one the traced length needs, and chunk i is tokens [i n // chunks,
(i + 1) n // chunks), that arithmetic being nodes of the graph. The fake kernels assume each chunk
has at least two tokens (as of any symbolic size); the program's guards say so, and a batch too
short for that gets a program of its own. So the count is not the one the largest length the program
admits would need (NOTE: [Dynamic sizes]): that many chunks would leave the shortest batches chunks of
one token, each a program of its own; a chunk grows with the length instead, to at most eight times
CHUNK_BYTES at that largest length.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from fbmt.compiler import meta, ops
from fbmt.compiler.ops import emit
from fbmt.compiler.ops.tables import hint
from fbmt.compiler.program import BWD, FWD, Program

aten = torch.ops.aten

CHUNK_BYTES = 256 << 20  # one chunk's fp32 logits at most; a smaller loss is not chunked
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_MEAN, _SUM = 1, 2  # nll_loss's `reduction` argument


@dataclass(frozen=True)
class LossStats:
    """What the loss pass did (NOTE: [Pass stats])."""

    chunked: tuple[tuple[int | str, int, int], ...]  # (tokens, vocab, chunks) of each chunked cross-entropy
    kept: tuple[str, ...]  # why each large cross-entropy not chunked was left as it was

    def __str__(self) -> str:
        said = [f"cross-entropy over {n} tokens x {v} classes in {c} chunks" for n, v, c in self.chunked]
        said += [f"cross-entropy kept: {why}" for why in self.kept]
        return "; ".join(said) or "no cross-entropy large enough to chunk"


@dataclass
class _Loss:
    """One cross-entropy of the graph, and the nodes the rewrite reads or replaces."""

    log_softmax: fx.Node
    nll: fx.Node  # nll_loss_forward: (loss, total_weight)
    logits: fx.Node  # the value the chunks are cut from: the fp32 input, or what it was cast from
    shape: tuple[int, int]  # (tokens, classes)
    target: fx.Node
    reduction: int
    ignore: int
    nll_backward: fx.Node | None = None
    logits_grad: fx.Node | None = None  # the backward's node whose value is the gradient of `logits`


def chunk_losses(program: Program, chunk_bytes: int | None = None) -> tuple[Program, LossStats]:
    limit = chunk_bytes or CHUNK_BYTES
    # most programs have nothing to chunk: they keep their graph (a copy costs more than the search)
    found = [_find(n, limit) for n in program.graph.nodes if n.target is aten._log_softmax.default]
    if not any(isinstance(f, _Loss) for f in found):
        return program.copy(shared=True), LossStats((), tuple(f for f in found if isinstance(f, str)))
    program = program.copy()
    g = program.graph
    chunked, kept = [], []
    for node in [n for n in g.nodes if n.target is aten._log_softmax.default]:
        found = _find(node, limit)
        if isinstance(found, str):
            kept.append(found)
        elif found is not None:
            n, v = found.shape  # chunks of at most `limit` at the traced number of tokens
            traced = hint(n, largest=False)
            chunks = min(traced, max(1, math.ceil(traced * v * 4 / limit)))
            _rewrite(g, found, chunks)
            chunked.append((n if isinstance(n, int) else str(n), v, chunks))
    g.lint()
    return program, LossStats(tuple(chunked), tuple(kept))


def _find(ls: fx.Node, limit: int) -> _Loss | str | None:
    """The cross-entropy `ls` begins, if it is one to chunk; why not where it is large; None if small."""
    x, dim, half_to_float = ls.args
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or dim not in (1, -1) or half_to_float:
        return None
    n, v = val.shape
    if hint(n, largest=False) * hint(v, largest=False) * 4 <= limit:  # at the traced size: see the NOTE
        return None
    if not isinstance(v, int):
        return "its number of classes is symbolic"
    if val.dtype != torch.float32:
        return f"its input is {val.dtype}, not float32"
    users = {u.target: u for u in ls.users}
    if len(users) != len(ls.users) or not set(users) <= {
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten._log_softmax_backward_data.default,
    }:
        return "its log-probabilities are read by other ops than the loss"
    nll = users.get(aten.nll_loss_forward.default)
    if nll is None or nll.args[0] is not ls:
        return "its log-probabilities are read by other ops than the loss"
    _, target, weight, reduction, ignore = nll.args
    if weight is not None:
        return "it weighs the classes"
    if reduction not in (_MEAN, _SUM):
        return "reduction='none'"
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1) for u in nll.users):
        return "its outputs are read in an unexpected way"
    found = _Loss(ls, nll, _source(x), (n, v), target, reduction, ignore)
    if not isinstance(n, int) and not _same_shape(found.logits.meta["val"].shape, (n, v)) and x.target not in _RESHAPES:
        return "its symbolic number of tokens is not a reshape's"
    nllb, lsb = users.get(aten.nll_loss_backward.default), users.get(aten._log_softmax_backward_data.default)
    if (nllb is None) != (lsb is None):
        return "only part of its backward was found"
    if nllb is not None:
        total = _output(nll, 1)
        if (
            list(nllb.users) != [lsb]
            or lsb.args[0] is not nllb
            or nllb.args[1:] != (ls, target, None, reduction, ignore, total)
        ):
            return "its backward is not autograd's"
        found.nll_backward = nllb
        found.logits_grad = _gradient_of(lsb, found.logits, (n, v))
        if found.logits_grad is None:
            return "its gradient does not reach the logits' shape"
        if not isinstance(n, int) and not _same_shape(found.logits_grad.meta["val"].shape, (n, v)):
            return "its gradient is reshaped from symbolic sizes"
    return found


def _same(a: Any, b: Any) -> bool:
    """Two sizes are the same, as numbers or as expressions of symbolic sizes. Never `==` on symbolic
    sizes: that would add a guard to the program (NOTE: [Dynamic sizes])."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    ea = a.node.expr if isinstance(a, torch.SymInt) else sympy.Integer(a)
    eb = b.node.expr if isinstance(b, torch.SymInt) else sympy.Integer(b)
    return sympy.expand(ea - eb) == 0


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _contiguous(val: torch.Tensor) -> bool:
    """Row-major and dense, read from the sizes and strides as expressions (no guard)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(val.shape, val.stride()))):
        if not (isinstance(size, int) and size == 1) and not _same(stride, expected):
            return False
        expected = expected * size
    return True


def _output(node: fx.Node, k: int) -> fx.Node | None:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == k), None)


def _source(x: fx.Node) -> fx.Node:
    """The value the fp32 input is made from by reshapes and at most one cast, read by nothing else:
    the chunks are cut from it, so the fp32 copy is never made whole."""
    node, cast = x, False
    while len(node.users) == 1 and isinstance(node.args[0] if node.args else None, fx.Node):
        if node.target in _RESHAPES:
            pass
        elif _cast(node) and not cast:
            cast = True
        else:
            break
        up = node.args[0]
        if len(up.users) != 1:  # read elsewhere too: it exists anyway, cut from it
            node = up
            break
        node = up
    val = node.meta.get("val")
    n, v = x.meta["val"].shape
    if not isinstance(val, torch.Tensor) or not _contiguous(val) or not _same(val.numel(), n * v):
        return x
    return node if _same(val.shape[-1], v) else x


def _cast(node: fx.Node) -> bool:
    """A `_to_copy` that changes the dtype alone (not the device, layout or strides)."""
    if node.target is not aten._to_copy.default or not set(node.kwargs) <= {"dtype", "layout", "device"}:
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (
        isinstance(src, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and (src.device, src.layout) == (out.device, out.layout)
        and _same_shape(src.stride(), out.stride())
    )


def _gradient_of(lsb: fx.Node, logits: fx.Node, flat: tuple[Any, Any]) -> fx.Node | None:
    """The node of the chain of reshapes and casts that follows the softmax's backward whose value is
    the logits' gradient: the first in their dtype and of shape (tokens, classes), where the chunks'
    concatenation replaces it as it is; else the latest of the logits' own shape."""
    want = logits.meta["val"]
    node, best = lsb, None
    while True:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == want.dtype:
            if _same_shape(val.shape, flat):
                return node
            if _same_shape(val.shape, want.shape):
                best = node
        if len(node.users) != 1:
            return best
        (u,) = node.users
        if u.target not in _RESHAPES and not _cast(u):
            return best
        node = u


def _rewrite(g: fx.Graph, loss: _Loss, chunks: int) -> None:
    """Each chunk runs the ops eager runs on the whole (`_log_softmax`, `nll_loss_forward`, and in the
    backward `nll_loss_backward`, `_log_softmax_backward_data`): torch's own fused kernels, so each
    token's loss and gradient is eager's to the bit, and only the sum over chunks is new. The chunk's
    log-probabilities are made again in the backward instead of being kept."""
    n, v = loss.shape
    dtype = loss.logits.meta["val"].dtype
    fwd = {k: x for k, x in meta.facts(loss.nll).items() if k != "phase"}
    bwd = {k: x for k, x in meta.facts(loss.nll_backward).items() if k != "phase"} if loss.nll_backward else {}

    def f(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return emit(g, target, args, FWD, kwargs=kwargs or None, **fwd)

    def b(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return emit(g, target, args, BWD, kwargs=kwargs or None, **bwd)

    def log_probs(e: Any, flat: fx.Node, start: int, end: int) -> fx.Node:
        x = e(aten.slice.Tensor, flat, 0, start, end)
        if dtype != torch.float32:
            x = e(aten._to_copy.default, x, dtype=torch.float32)
        return e(aten._log_softmax.default, x, 1, False)

    def spans(e: Any) -> list[tuple[Any, Any]]:
        """Chunk i is tokens [i n // chunks, (i + 1) n // chunks): of symbolic sizes, that arithmetic is
        nodes of the graph, as the program's other sizes are."""
        if isinstance(n, int):
            ends = [i * n // chunks for i in range(chunks + 1)]
        else:
            size = e(aten.sym_size.int, flat, 0)
            ends = [0] + [
                _arith(_arith(size, operator.mul, i, e), operator.floordiv, chunks, e) for i in range(1, chunks)
            ]
            ends.append(size)
        return list(zip(ends, ends[1:]))

    with g.inserting_before(loss.nll):
        x = loss.log_softmax.args[0]
        if _same_shape(loss.logits.meta["val"].shape, (n, v)):
            flat = loss.logits
        else:  # a symbolic number of tokens is given as the sizes the trace viewed the input with
            flat = f(aten.view.default, loss.logits, [n, v] if isinstance(n, int) else x.args[1])
        sums, counts = [], []
        for start, end in spans(f):
            target = f(aten.slice.Tensor, loss.target, 0, start, end)
            out = f(aten.nll_loss_forward.default, log_probs(f, flat, start, end), target, None, _SUM, loss.ignore)
            for k, into in ((0, sums), (1, counts)):
                into.append(f(operator.getitem, out, k))
                into[-1].meta["val"] = out.meta["val"][k]
        total, count = sums[0], counts[0]
        for s, c in zip(sums[1:], counts[1:]):
            total, count = f(aten.add.Tensor, total, s), f(aten.add.Tensor, count, c)
        value = f(aten.div.Tensor, total, count) if loss.reduction == _MEAN else total
    for k, new in ((0, value), (1, count)):
        old = _output(loss.nll, k)
        if old is not None:
            old.replace_all_uses_with(new)
    if loss.nll_backward is None:
        _erase_dead(g, loss)
        return

    want = loss.logits_grad.meta["val"].shape
    added = _added_to(loss.logits_grad, g, loss.nll_backward, (n, v))
    with g.inserting_before(loss.nll_backward):
        grad = loss.nll_backward.args[0]
        if added is not None:  # NOTE: [The logits' other gradient]
            other = (
                added[1] if _same_shape(added[1].meta["val"].shape, (n, v)) else b(aten.view.default, added[1], [n, v])
            )
        grads = []
        for start, end in spans(b):
            ls = log_probs(b, flat, start, end)
            target = b(aten.slice.Tensor, loss.target, 0, start, end)
            # the whole loss's count: a chunk's tokens get the gradient of the mean over all of them
            g_nll = b(aten.nll_loss_backward.default, grad, ls, target, None, loss.reduction, loss.ignore, count)
            d = b(aten._log_softmax_backward_data.default, g_nll, ls, 1, torch.float32)
            grads.append(d if dtype == torch.float32 else b(aten._to_copy.default, d, dtype=dtype))
            if added is not None:
                part = b(aten.slice.Tensor, other, 0, start, end)
                grads[-1] = b(aten.add.Tensor, *((part, grads[-1]) if added[2] == 0 else (grads[-1], part)))
        whole = grads[0] if len(grads) == 1 else b(aten.cat.default, grads, 0)
        if added is not None:
            want = added[0].meta["val"].shape
        if not _same_shape(whole.meta["val"].shape, want):  # static sizes only (`_find`)
            whole = b(aten.view.default, whole, list(want))
    (added[0] if added is not None else loss.logits_grad).replace_all_uses_with(whole)
    if added is not None:  # the add, then the reshapes between it and the old gradient
        node = added[0]
        while node is not loss.logits_grad and not node.users:
            up = node.args[0] if node.target in _RESHAPES else added[3]
            g.erase_node(node)
            node = up
    _erase_dead(g, loss)


def _added_to(
    grad: fx.Node, g: fx.Graph, before: fx.Node, flat: tuple[int, Any]
) -> tuple[fx.Node, fx.Node, int, fx.Node] | None:
    """The sum the logits' gradient from the loss makes with their gradient from elsewhere, when its only
    reader is one: (the `add`, the other term, its position in the add, the reshape of the gradient it
    reads). The other term is a value of the logits' shape and dtype made before the loss's backward,
    whole rows of which a chunk can add.

    NOTE: [The logits' other gradient]
    A model that returns its logits beside the loss (Hugging Face's do) gets a gradient for them from
    its caller too (autograd's zeros when the caller used only the loss), and the graph adds it to the
    loss's: `add(tangent, cat(chunks))`. Inductor lowers a concatenation that a pointwise op reads as one
    kernel that computes each element from whichever chunk holds it, so the chunks' fp32 gradients are
    written whole and read again, and every element evaluates every chunk's expression under a mask:
    on one H200 that kernel took 2.4 ms of a 0.89B model's step (the gradient itself moves 1 GiB).
    Adding each chunk's rows of the other term inside the chunk (`cat(add(tangent[rows], chunk))`, the
    same additions, so the same bits) leaves a concatenation that only products read, which Inductor
    writes chunk by chunk into the result (NOTE: [Cats of shared reads])."""
    node = grad
    while len(node.users) == 1 and next(iter(node.users)).target in _RESHAPES:
        node = next(iter(node.users))
    if len(node.users) != 1:
        return None
    (add,) = node.users
    if add.target is not aten.add.Tensor or add.kwargs or len(add.args) != 2 or add.args[0] is add.args[1]:
        return None
    at = add.args.index(node)
    other = add.args[1 - at]
    val, mine = getattr(other, "meta", {}).get("val"), node.meta["val"]
    if not isinstance(val, torch.Tensor) or val.dtype != mine.dtype or not _same_shape(val.shape, mine.shape):
        return None
    if not _same_shape(val.shape, flat) and not (all(isinstance(s, int) for s in val.shape) and _contiguous(val)):
        return None  # its rows are not a view of it
    order = ops.node_order(g)
    if order[other] >= order[before]:
        return None
    return add, other, at, node


def _arith(a: fx.Node, op: Any, k: int, e: Any) -> fx.Node:
    """`op(a, k)` on a symbolic size, as a node with its value."""
    node = e(op, a, k)
    node.meta["val"] = op(a.meta["val"], k)
    return node


def _erase_dead(g: fx.Graph, loss: _Loss) -> None:
    """Erase what the rewrite left unread: the old ops and the reshapes and casts around them."""
    todo = [loss.logits_grad, *loss.nll.users, loss.nll, loss.log_softmax]
    erased: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        if node is None or node in erased or node.users or not (ops.pure(node) or node.target is operator.getitem):
            continue
        inputs = node.all_input_nodes
        g.erase_node(node)
        erased.add(node)
        todo.extend(inputs)
