"""Trace each kind of block once and stamp its graph for every block like it (NOTE: [Stamped blocks]).

NOTE: [Stamped blocks]
A model's blocks are mostly one kind: the 24 or 80 layers of a decoder run the same code on
parameters of the same shapes. Tracing (make_fx over the forward and its backward) costs a few
hundred microseconds per node and is most of the compiler's time; copying a node costs a few. So the
trace proves which block calls are alike, traces one call of each kind alone, and copies its graph
for the others:

1. **Proof, in the fake forward that precedes the trace** (`Stamper.recording`). Each call of a
   block (a child of a `ModuleList` of two or more modules of one class) records its signature: the
   aten ops it ran in order, each with its non-tensor arguments, which earlier tensor each tensor
   argument is (a parameter, a buffer, an argument, an earlier op's output, or a tensor from outside
   the block, by identity), and whether grad mode was on; then which tensors it returned. Calls
   whose class, parameter and buffer metadata, argument structure and metadata, and signature are
   equal are one kind: they ran the same ops on tensors of the same metadata, so their joint graphs
   (the backward being the autograd formulas of those ops) are the same up to which parameters they
   read. Attributes that differ between blocks (Hugging Face's `layer_idx`) need not be equal: the
   signature shows whether they changed what ran. A call given an object (Hugging Face's cache, which
   each layer writes its keys and values to) also records what it wrote there: each leaf of the
   object that changed (`objects.state`), by path, a tensor as which of its values it is, a plain
   value as itself. It must read no tensor the object held (a copy of the object would hold another),
   nor replace or resize a container in it; a tensor made from Python values (the cache's empty
   start) is recorded by its value, as each call makes its own.
2. **One trace per kind** (`trace._trace_kind`): the first call of the kind, alone, through the
   same make_fx, module tags and decompositions as the whole trace, forward and backward, made when
   the model's trace (step 3) reaches that call, which waits on it (a kind whose every call gets
   arguments from constants, below, is never traced without them). It calls
   the block's `forward`, not the block: the block's own hooks run around every call of it in the
   model's trace, the stamped ones too. A kind whose graph writes to one of its inputs (after the
   functionalization the model's trace would give it too) is traced as code.
3. **The trace of the model** (`Stamper.stamping`) runs each stamped call as one op, `fbmt::stamp`,
   whose fake kernel gives the kind's output metadata and whose backward is `fbmt::stamp_grad`;
   the autograd engine places the backward where the block's own backward would run. A call given
   a tensor computed from constants alone (Hugging Face's causal mask with `use_cache=False`, which
   the trace rewrites by its value: NOTE: [Causal masks]) gets a kind of its own for that value,
   traced there and then (the model's trace paused), whose masks are decided by it. A call's writes
   to its objects are done again after the op, at the paths the fake forward saw it write: the
   tensors are results of the op after the block's own (its kind's trace returns what it wrote to
   its copy of the object), the plain values are the fake forward's. They keep their history: a
   gradient one of them gets (a loss that reads the cache) is a surprise, and makes the trace run
   again (below); cut from the graph, it would have been lost without a word.
4. **Inlining** (`inline`) replaces each op by a copy of the kind's forward (its module paths moved to
   the block's), and each backward op by a copy of the kind's backward reading that copy's values.
   The graph is then rebuilt with the names make_fx gives (an op's name and a count; a tensor constant
   of each copy its own `_tensor_constantN`, numbered in order), and the masks
   the kinds decided are dropped from the copies as the trace drops its own, so a stamped program is
   the program tracing every block gives, names included (tests/test_stamp.py, and the golden
   programs, which stamping left unchanged).

Which results of a call get a gradient is part of its kind (`Stamper.group`): its kind's backward is
traced for those alone. The fake forward's autograd graph tells: a result gets one where a node made
after the call returned reads it on the way to what the backward differentiates. A result the block
returns as it got it (T5's layers return the position biases they got, for the next) is, after the
stamp op, that tensor itself, as after the block's own code: what the trace knows of it stays (the
next call knows the decoder's cross-attention bias as the zeros it is, and its kind drops that mask),
and its gradient goes around the op, so no call's kind depends on whether it gets one. That is the
one place a stamped program differs from the whole trace's: the layers' parts of such a tensor's
gradient are added in another order. A stamped call whose outputs still get other gradients than its
kind's (a reader whose backward gives none) makes the whole trace run again without stamping
(`Refused`): a surprise costs time, never a different program. `FBMT_STAMP=0` turns stamping off.

A program of symbolic sizes (NOTE: [Dynamic sizes]) is stamped too. Its calls' sizes are expressions
in the trace's symbols, so the signatures and metadata compare those expressions (`_size`), never the
sizes themselves, which would add a guard for each pair that differs. A kind is traced in the same
shape environment, keeping its products' sizes symbolic as the model's trace does; a mask it decides
joins the program's checks, proved again at every size the program admits. A copy reads each size
from the first node of the program that computes it, as the model's trace reads each symbol once
(read from its own inputs, a backward would read sizes from forward values). A call given a tensor
computed from the inputs' sizes alone (Hugging Face's causal mask at symbolic sizes) gets a kind for
that tensor, as a call given constants does, which knows it as its graph of the sizes
(`masks.of_sizes`): a mask the kind decides from it is proved again, at each size the program
admits, through that graph. The program computes what the whole trace computes, the same masks
rewritten; it is not node for node the same (fewer size reads).
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._python_dispatch import TorchDispatchMode

from fbmt.compiler import meta, objects

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


STAMPED = "block kind(s) once and stamped their calls"  # the trace's line on it (the progress line repeats it)
_ARG = object()  # where a tensor goes among a call's argument leaves
_OBJ = object()  # where an object goes (a Hugging Face cache)


class Refused(Exception):
    """A stamped call met what its kind's trace did not see; trace the model again without stamping."""


def _size(v: Any) -> Any:
    """A size as a key: an int, or a symbolic size's expression (NOTE: [Stamped blocks]: in a program of
    symbolic sizes every call's sizes are expressions in the trace's symbols, so equal expressions are
    equal sizes; sympy compares expressions by their structure, where comparing the SymInts themselves
    would add a guard to the trace for each pair that differs)."""
    return ("sym", v.node.expr) if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) else v


def _tensor_meta(t: torch.Tensor, requires_grad: bool | None = None) -> tuple:
    rg = t.requires_grad if requires_grad is None else requires_grad
    return (tuple(map(_size, t.shape)), tuple(map(_size, t.stride())), t.dtype, t.device.type, rg)


class _Tensor(NamedTuple):
    """A result leaf that is a tensor: a detached fake of its metadata, and whether it requires grad."""

    fake: torch.Tensor
    requires_grad: bool


class _Write(NamedTuple):
    """A call's write to one of its argument objects, as the fake forward saw it."""

    leaf: int  # which argument leaf the object is
    path: tuple  # where in it (`objects.state`'s paths)
    value: Any  # the signature's index of the tensor written, or ("plain", type, value)
    before: Any  # what the path held before (`objects.MISSING`: nothing)
    requires_grad: bool  # the tensor written's


@dataclass
class Kind:
    """One kind of block call: what its trace needs, and its graph once traced."""

    id: int
    block: str  # the path of the block whose call is traced (the exemplar)
    module: nn.Module
    params: list[str]  # block-local names, in the order the stamp op takes them
    buffers: list[str]
    inputs: list[tuple[torch.Tensor, bool]]  # per input of the op: a detached fake of its metadata, requires_grad
    in_spec: Any
    in_leaves: list[Any]  # the exemplar's argument leaves: `_ARG` where a tensor goes, else the plain value
    out_spec: Any
    out_leaves: list[Any]  # the exemplar's result leaves: a `_Tensor` where a tensor, else the value
    grad_mode: bool
    calls: list[int]  # the calls (in the forward's order) of this kind
    objects: dict[int, Any] = field(default_factory=dict)  # argument leaf -> the exemplar's object as it got it
    writes: list[_Write] = field(default_factory=list)  # the exemplar's writes to them
    graph: fx.Graph | None = None  # the kind's joint graph (`trace._trace_kind`)
    prelude: list[fx.Node] = field(default_factory=list)  # the detaches/aliases of its inputs its trace made first
    forward: list[fx.Node] = field(default_factory=list)  # its forward nodes, in order
    backward: list[fx.Node] = field(default_factory=list)
    placeholders: list[fx.Node] = field(default_factory=list)  # the inputs', then the tangents'
    outputs: list[fx.Node] = field(default_factory=list)  # per output tensor, its node
    wrt: list[int] = field(default_factory=list)  # which inputs get a gradient
    grads: list[fx.Node | None] = field(default_factory=list)  # per input of `wrt`, its gradient's node
    differentiable: list[int] = field(default_factory=list)  # which outputs receive a gradient (the tangents)
    # argument -> its value, where constant; its graph of the program's sizes, where computed from them alone
    known: dict[int, Any] = field(default_factory=dict)
    constants: dict[fx.Node, torch.Tensor] = field(default_factory=dict)  # tensors its forward made from values
    decided: dict[fx.Node, str] = field(default_factory=dict)  # the attention masks its trace decided
    notes: list[str] = field(default_factory=list)  # those it dropped itself (a kind it functionalized)
    gets_grad: tuple[bool, ...] | None = None  # per result tensor, whether its calls' get a gradient
    passes: dict[int, int] = field(default_factory=dict)  # result tensor -> the input its calls return as is

    def variant(self, known: dict[int, Any]) -> Kind:
        """This kind for calls that get these arguments from constants or from sizes alone (their values
        decide masks)."""
        return Kind(
            id=next(_ids),
            block=self.block,
            module=self.module,
            params=self.params,
            buffers=self.buffers,
            inputs=self.inputs,
            in_spec=self.in_spec,
            in_leaves=self.in_leaves,
            out_spec=self.out_spec,
            out_leaves=self.out_leaves,
            grad_mode=self.grad_mode,
            calls=self.calls,
            objects=self.objects,
            writes=self.writes,
            known=known,
            gets_grad=self.gets_grad,
            passes=self.passes,
        )

    @property
    def n_inputs(self) -> int:
        return len(self.inputs)

    def out_tensors(self) -> list[_Tensor]:
        return [x for x in self.out_leaves if isinstance(x, _Tensor)]

    def arguments(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict, dict[int, Any]]:
        """The call's (args, kwargs) with these tensors where the exemplar had its own, and a copy of
        each object it got (by argument leaf), as it got it."""
        it = iter(tensors)
        copies = {i: objects.rebuild(o, objects.tensors_in(o)) for i, o in self.objects.items()}
        leaves = [next(it) if x is _ARG else copies[i] if x is _OBJ else x for i, x in enumerate(self.in_leaves)]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return args, kwargs, copies

    def written(self) -> list[_Write]:
        """Its calls' writes of tensors to their objects: results of the stamp op after the block's own."""
        return [w for w in self.writes if isinstance(w.value, int)]

    def arg_metas(self) -> list[tuple]:
        return [_tensor_meta(t, rg) for t, rg in self.inputs[len(self.params) + len(self.buffers) :]]


_KINDS: dict[int, Kind] = {}  # the kinds of the trace under way, for the stamp ops' fake kernels
_ids = itertools.count()


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


@torch.library.custom_op("fbmt::stamp", mutates_args=())
def _stamp(kind: int, call: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError("fbmt::stamp exists only while a model is traced (NOTE: [Stamped blocks])")


# The stamp ops' results are shaped and strided as the kind's graph computes them (not as the fake
# forward did): the ops traced around a stamped call (a view of its result, the next block's backward)
# then decompose as they do around the inlined nodes.
@_stamp.register_fake
def _(kind: int, call: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_empty_like(o.meta["val"]) for o in _KINDS[kind].outputs]


@torch.library.custom_op("fbmt::stamp_grad", mutates_args=())
def _stamp_grad(kind: int, call: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError("fbmt::stamp_grad exists only while a model is traced (NOTE: [Stamped blocks])")


@_stamp_grad.register_fake
def _(kind: int, call: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_empty_like(g.meta["val"]) for g in _KINDS[kind].grads if g is not None]


class _Stamped(torch.autograd.Function):
    """A stamped call for autograd: `fbmt::stamp` forward, `fbmt::stamp_grad` backward (a Function of
    its own rather than the op's registered autograd, which wraps every call in pytree work that
    cost more than the copy it stands for)."""

    @staticmethod
    def forward(ctx: Any, kind: int, call: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.kind, ctx.call = kind, call
        k = _KINDS[kind]
        out = tuple(torch.ops.fbmt.stamp(kind, call, list(inputs)))
        # a tensor written to an object (a cache) keeps its history: a gradient it gets is a surprise
        n = len(k.out_tensors())
        may = {n + j for j, w in enumerate(k.written()) if w.requires_grad}
        ctx.mark_non_differentiable(*[o for i, o in enumerate(out) if i not in k.differentiable and i not in may])
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        k = _KINDS[ctx.kind]
        got = [i for i, g in enumerate(grads) if g is not None]
        if got != k.differentiable:
            raise Refused(
                f"a call of {k.block}'s kind got gradients for its outputs {got}, "
                f"its traced kind for {k.differentiable}"
            )
        tangents = k.placeholders[k.n_inputs :]
        given = [_laid_out_as(grads[i], t.meta["val"], k) for i, t in zip(got, tangents)]
        out = iter(torch.ops.fbmt.stamp_grad(ctx.kind, ctx.call, given))
        per_input: list[torch.Tensor | None] = [None] * k.n_inputs
        for i, g in zip(k.wrt, k.grads):
            if g is not None:
                per_input[i] = next(out)
        return None, None, *per_input


def _laid_out_as(g: torch.Tensor, traced: torch.Tensor, kind: Kind) -> torch.Tensor:
    """`g`, a gradient a stamped call gets, with the strides its kind's trace gave that tangent (its output's).
    A gradient need not be laid out as its output is (the input gradient of a convolution on a transposed
    tensor, say), and the kind's backward decided its reshapes on the traced layout: a `view` there of a
    gradient laid out otherwise fails when the program runs. Strides are compared where they are known
    to be equal, without guards on symbolic sizes; any other gradient is copied to the contiguous layout
    a kind's tangent has where its output had it, and a kind whose tangent has another is not stamped.
    The comparisons are the compiler's questions, not the program's: with the trace's proxy mode on, a
    comparison of symbolic strides would be recorded as a node, and torch 2.11 then fails on the traced
    tangent's stride, which no node of this trace computes ("... is not tracked with proxy")."""
    with disable_proxy_modes_tracing():
        if all(statically_known_true(a == b) for a, b in zip(g.stride(), traced.stride())):
            return g
        expected: Any = 1
        for size, stride in reversed(list(zip(traced.shape, traced.stride()))):
            if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
                raise Refused(f"a call of {kind.block}'s kind got a gradient laid out otherwise than its traced kind's")
            expected = expected * size
    return g.clone(memory_format=torch.contiguous_format)


class _Signature(TorchDispatchMode):
    """Records the ops a block call runs (NOTE: [Stamped blocks], step 1)."""

    def __init__(self, inputs: list[torch.Tensor], held_by_objects: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.index = {id(t): i for i, t in enumerate(inputs)}
        self.held = list(inputs)  # every tensor indexed stays alive while recording, so ids stay theirs
        self.ops: list[tuple] = []
        self.in_objects = {id(t) for t in held_by_objects if id(t) not in self.index}
        self.read_object = False  # whether an op read a tensor an argument object held

    def key(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            i = self.index.get(id(x))
            if i is None and id(x) in self.in_objects:  # its copy of the object would hold another tensor
                self.read_object = True
                return ("object", id(x))
            if i is None:  # a tensor from outside the block: equal signatures read the same one
                self.held.append(x)
                return ("outside", id(x))
            return i
        if isinstance(x, (list, tuple)):
            return tuple(self.key(v) for v in x)
        if isinstance(x, _PLAIN):
            return x
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _size(x)
        return ("value", type(x).__name__, id(x))  # anything else: equal only to itself

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        grad = torch.is_grad_enabled()
        if func is torch.ops.aten.lift_fresh.default and (value := _digest_or_none(args[0])) is not None:
            self.ops.append((func, ("constant", value), grad))  # made from Python values: each call makes its own
        elif func is torch.ops.prim.device.default and id(args[0]) in self.in_objects:  # its metadata alone
            self.ops.append((func, ("object", _tensor_meta(args[0])), grad))
        else:
            self.ops.append((func, self.key(args), tuple((k, self.key(v)) for k, v in kwargs.items()), grad))
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.index[id(t)] = len(self.held)
                self.held.append(t)
        return out


def _digest(t: torch.Tensor) -> tuple:
    """A tensor's value, as a key (a mask of a few million elements hashes in milliseconds)."""
    with unset_fake_temporarily(), disable_proxy_modes_tracing():  # a real tensor (a GPU's too), read within a trace
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (tuple(t.shape), t.dtype, hashlib.sha1(data).hexdigest())


def _digest_or_none(t: torch.Tensor) -> tuple | None:
    try:
        return _digest(t)
    except (RuntimeError, TypeError):  # a dtype numpy cannot take: the constant is then equal only to itself
        return None


def _plain(leaves: list[Any]) -> bool:
    return all(isinstance(x, (torch.Tensor, *_PLAIN)) for x in leaves)


def _local_tensors(block: nn.Module, names: list[str]) -> list[torch.Tensor]:
    """The block's tensors by local name, as its forward sees them now (functional_call's, in a trace)."""
    out = []
    for name in names:
        path, _, leaf = name.rpartition(".")
        out.append(getattr(block.get_submodule(path) if path else block, leaf))
    return out


def _writes(
    objs: dict[int, Any], before: dict[int, dict], signature: _Signature, out_leaves: list[Any]
) -> list[_Write] | None:
    """What a call wrote to its argument objects; None where a copy of its kind's graph could not
    write the same (a container replaced or resized, a tensor from outside the call, one tensor written
    twice or also returned: a copy would write two)."""
    out: list[_Write] = []
    returned = {id(x) for x in out_leaves if isinstance(x, torch.Tensor)}
    written: set[int] = set()
    for i, x in objs.items():
        changed = objects.changes(before[i], objects.state(x))
        if changed is None:
            return None
        for path, leaf in changed:
            old = before[i].get(path, objects.MISSING)
            if not isinstance(leaf, torch.Tensor):
                out.append(_Write(i, path, leaf, old, False))
                continue
            k = signature.key(leaf)
            if not isinstance(k, int) or id(leaf) in returned or id(leaf) in written:
                return None
            written.add(id(leaf))
            out.append(_Write(i, path, k, old, leaf.requires_grad))
    return out


def _as_recorded(objs: dict[int, Any], call: _Call) -> bool:
    """Whether the paths the call wrote in the fake forward hold what they held there (their copy
    writes there; what it read is its signature's)."""
    for w in call.writes:
        now, old = objects.get(objs[w.leaf], w.path), w.before
        if isinstance(old, torch.Tensor) or isinstance(now, torch.Tensor):
            if not (isinstance(old, torch.Tensor) and isinstance(now, torch.Tensor)):
                return False
            if _tensor_meta(old) != _tensor_meta(now):
                return False
        elif old != now:
            return False
    return True


def _as_before(obj: Any, writes: list[_Write], leaf: int) -> Any:
    """A copy of `obj` (after a call wrote to it) as the call got it."""
    copy = objects.rebuild(obj, objects.tensors_in(obj))
    for w in writes:
        if w.leaf == leaf:
            objects.put(copy, w.path, w.before)
    return copy


# the number autograd gives the next node it makes (older torch: none, and no call's results are
# predicted: a surprise in the backward then traces again, as NOTE: [Stamped blocks] says)
_next_node_number = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _read_after(roots: list[torch.Tensor]) -> dict[tuple[Any, int], float]:
    """For every (grad_fn, output_nr) autograd passes a gradient through from `roots`: the number of
    the latest node that reads it (`inf` for a root itself), so that a result a block passes on
    unchanged is told apart from its later readers' (T5's position bias, which each decoder layer
    returns as it got it)."""
    latest: dict[tuple[Any, int], float] = {}
    stack = []
    for t in roots:
        if t.grad_fn is not None:
            latest[(t.grad_fn, t.output_nr)] = float("inf")
            stack.append(t.grad_fn)
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        number = fn._sequence_nr()
        for nxt, nr in fn.next_functions:
            if nxt is not None:
                latest[(nxt, nr)] = max(latest.get((nxt, nr), -1), number)
                stack.append(nxt)
    return latest


@dataclass
class _Call:
    """A block call of the fake forward, and what it proved (its signature)."""

    block: str
    nested: int  # candidate calls made within this one
    key: tuple | None = None  # None: never stamped (an object among its arguments or results)
    inputs: list[tuple[torch.Tensor, bool]] = field(default_factory=list)
    in_spec: Any = None
    in_leaves: list[Any] = field(default_factory=list)
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)
    writes: list[_Write] = field(default_factory=list)  # to its argument objects
    objects: dict[int, Any] = field(default_factory=dict)  # the objects as the call got them (exemplars only)
    # per result tensor, where autograd will give it a gradient (`Stamper.group`): until then, the
    # (grad_fn, output_nr) it gets it through, "leaf" (none to follow), or None (it needs none)
    grad_fns: list[Any] | None = None
    gets_grad: tuple[bool, ...] | None = None
    ended: int = 0  # the number of the first autograd node made after it returned
    passes: dict[int, int] = field(default_factory=dict)  # result tensor -> the input it returned as it got it


class Stamper:
    """The blocks a trace may stamp, what the fake forward proved about their calls, and the kinds."""

    def __init__(self, module: nn.Module, candidates: dict[str, nn.Module]) -> None:
        self.candidates: dict[str, nn.Module] = {}  # block path -> module
        self.locals: dict[str, tuple[list[str], list[str]]] = {}  # block path -> its parameters, buffers
        tied = _tied(module)
        for path, block in candidates.items():
            if any(id(p) in tied for p in block.parameters()):
                continue  # a parameter shared with code outside the block: its gradient has two sources
            self.candidates[path] = block
            self.locals[path] = (
                [n for n, _ in block.named_parameters(remove_duplicate=False)],
                [n for n, _ in block.named_buffers(remove_duplicate=False)],
            )
        self.calls: list[_Call] = []
        self.kinds: list[Kind] = []
        self.of_call: dict[int, Kind] = {}
        self.traced: dict[int, str | None] = {}  # a kind traced at its first call -> why it cannot be stamped
        self.variants: dict[tuple, tuple[Kind | None, str]] = {}  # a kind for constant arguments, by their values
        self.pauses = 0
        self.stamped: dict[str, int] = {}  # a kind's exemplar block -> its calls stamped in the trace
        self.not_stamped: list[str] = []  # why a call of a traced kind was traced as code after all

    @classmethod
    def for_module(cls, module: nn.Module) -> Stamper | None:
        """The module's candidate blocks (the children of a ModuleList of two or more modules of one
        class), or None where it has none."""
        candidates: dict[str, nn.Module] = {}
        for path, mod in module.named_modules():
            if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(c) for c in mod}) == 1:
                for i, child in enumerate(mod):
                    candidates[f"{path}.{i}" if path else str(i)] = child
        seen: dict[int, int] = {}
        for child in candidates.values():
            seen[id(child)] = seen.get(id(child), 0) + 1
        # a module under two paths (one layer repeated in the list) is no block of its own
        candidates = {p: c for p, c in candidates.items() if seen[id(c)] == 1}
        stamper = cls(module, candidates)
        return stamper if stamper.candidates else None

    @contextmanager
    def _wrapped(self, wrapper: Callable) -> Iterator[None]:
        """Each candidate's forward runs through `wrapper(path, block, forward, *args, **kwargs)`, but
        while `paused` (a kind traced within the model's trace)."""
        before: list[tuple[nn.Module, Any]] = []

        def unless_paused(path: str, block: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
            if self.pauses:
                return forward(*args, **kwargs)
            return wrapper(path, block, forward, *args, **kwargs)

        try:
            for path, block in self.candidates.items():
                before.append((block, vars(block).get("forward")))
                block.forward = _Bound(unless_paused, path, block, block.forward)
            yield
        finally:
            for block, forward in reversed(before):
                if forward is None:
                    del block.forward  # the instance's attribute: the class's forward shows again
                else:
                    block.forward = forward

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The fake forward: every candidate block call records its signature (step 1)."""
        self.calls = []
        held: list[list[torch.Tensor]] = []
        exemplars: set[tuple] = set()
        uncopied: set[tuple] = set()

        def record(path: str, block: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
            at = len(self.calls)
            call = _Call(path, 0)
            self.calls.append(call)
            leaves, in_spec = pytree.tree_flatten((args, kwargs))
            objs = {i: x for i, x in enumerate(leaves) if objects.is_object(x)}
            if not _plain([x for i, x in enumerate(leaves) if i not in objs]):
                out = forward(*args, **kwargs)
                call.nested = len(self.calls) - at - 1
                return out
            params, buffers = self.locals[path]
            tensors = [*_local_tensors(block, params), *_local_tensors(block, buffers)]
            tensors += [x for x in leaves if isinstance(x, torch.Tensor)]
            before = {i: objects.state(x) for i, x in objs.items()}
            signature = _Signature(
                tensors, [t for b in before.values() for t in b.values() if isinstance(t, torch.Tensor)]
            )
            grad_mode = torch.is_grad_enabled()
            own = [id(b) for b in block.buffers()]
            with signature:
                out = forward(*args, **kwargs)
            held.append(signature.held)  # alive until the calls are grouped: no id is another's
            call.nested = len(self.calls) - at - 1
            if [id(b) for b in block.buffers()] != own:  # it assigned or registered a buffer, which its
                return out  # stamped copies would not: traced as code (NOTE: [Buffers a forward assigns])
            out_leaves, out_spec = pytree.tree_flatten(out)
            if not _plain(out_leaves) or signature.read_object:
                return out
            writes = _writes(objs, before, signature, out_leaves)
            if writes is None:
                return out
            call.writes = writes
            ops = (
                *signature.ops,
                ("out", tuple(signature.key(x) for x in out_leaves)),
                (
                    "writes",
                    tuple((w.leaf, w.value if isinstance(w.value, int) else "plain", w.requires_grad) for w in writes),
                ),
            )
            call.key = (
                type(block),
                tuple(params),
                tuple(buffers),
                tuple(_tensor_meta(t) for t in tensors),
                in_spec,
                tuple(
                    (type(x), "object" if i in objs else x)
                    for i, x in enumerate(leaves)
                    if not isinstance(x, torch.Tensor)
                ),
                out_spec,
                tuple(_tensor_meta(x) if isinstance(x, torch.Tensor) else (type(x), x) for x in out_leaves),
                grad_mode,
                ops,
            )
            call.inputs = [(t.detach(), t.requires_grad) for t in tensors]
            call.in_spec, call.out_spec = in_spec, out_spec
            call.in_leaves = [
                _ARG if isinstance(x, torch.Tensor) else _OBJ if i in objs else x for i, x in enumerate(leaves)
            ]
            call.out_leaves = [
                _Tensor(x.detach(), x.requires_grad) if isinstance(x, torch.Tensor) else x for x in out_leaves
            ]
            out_keys = [signature.key(x) for x in out_leaves if isinstance(x, torch.Tensor)]
            call.passes = {j: k for j, k in enumerate(out_keys) if type(k) is int and k < len(tensors)}
            if _next_node_number is not None:
                call.ended = _next_node_number()
                call.grad_fns = [
                    None if not x.requires_grad else "leaf" if x.grad_fn is None else (x.grad_fn, x.output_nr)
                    for x in out_leaves
                    if isinstance(x, torch.Tensor)
                ]
            if objs and call.key in uncopied:
                call.key = None
            elif objs and call.key not in exemplars:  # the objects as this call got them, for its kind's trace
                try:
                    call.objects = {i: _as_before(x, writes, i) for i, x in objs.items()}
                except Exception:  # an object copy.deepcopy refuses (a lock in it): its calls are traced as code
                    uncopied.add(call.key)
                    call.key = None
                    return out
                exemplars.add(call.key)
            return out

        self._held = held  # alive until the calls are grouped
        with self._wrapped(record):
            yield

    def keeping(self, paths: list[str]) -> None:
        """The module paths where the fake forward kept tensors: a call of a block that holds one is
        traced as code, since the stamp op would not set it (NOTE: [What a forward keeps on its
        modules] in fbmt/compiler/trace.py)."""
        for c in self.calls:
            if c.key is not None and any(p == c.block or p.startswith(c.block + ".") for p in paths):
                c.key = None
                self.not_stamped.append(f"{c.block}: it keeps tensors on its modules")

    def group(self, roots: list[torch.Tensor]) -> None:
        """After the fake forward: calls alike become kinds; a kind of one call is traced as code.
        `roots`: the results the backward will give gradients to. A call's kind includes which of its
        results get a gradient (the last layer of a T5 decoder returns a position bias no one reads),
        as its kind's backward is traced for those (NOTE: [Stamped blocks])."""
        read = _read_after(roots)
        for c in self.calls:
            # a result read by a node made after the call returned; one it returned as it got it is that
            # tensor again after the op, whose gradient goes around it
            if c.grad_fns is not None:
                c.gets_grad = tuple(
                    j not in c.passes and (g == "leaf" or (g is not None and read.get(g, -1) >= c.ended))
                    for j, g in enumerate(c.grad_fns)
                )
            elif c.passes:  # no node numbers to tell the others by (an older torch)
                c.gets_grad = tuple(
                    j not in c.passes for j in range(len([x for x in c.out_leaves if isinstance(x, _Tensor)]))
                )
            c.grad_fns = None  # the fake forward's autograd graph is not kept
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(self.calls):
            if c.key is not None:
                groups.setdefault((c.key, c.gets_grad), []).append(i)
        self.kinds = []
        for calls in groups.values():
            if len(calls) < 2:
                continue
            c = self.calls[calls[0]]
            params, buffers = self.locals[c.block]
            self.kinds.append(
                Kind(
                    id=next(_ids),
                    block=c.block,
                    module=self.candidates[c.block],
                    params=params,
                    buffers=buffers,
                    inputs=c.inputs,
                    in_spec=c.in_spec,
                    in_leaves=c.in_leaves,
                    out_spec=c.out_spec,
                    out_leaves=c.out_leaves,
                    grad_mode=c.key[-2],
                    calls=calls,
                    objects=c.objects,
                    writes=c.writes,
                    gets_grad=c.gets_grad,
                    passes=c.passes,
                )
            )
        self._held.clear()

    def adopt(self, kind: Kind) -> None:
        """A kind whose calls the model's trace stamps: its own trace comes at the first of them that needs
        it (a model whose every call gets arguments from constants, as a decoder gets its rotary tables,
        traces only the kind for those: `_variant`), and a kind that cannot be traced runs as code."""
        _KINDS[kind.id] = kind
        for i in kind.calls:
            self.of_call[i] = kind

    def release(self) -> None:
        """Forget the kinds (after inlining: the stamp ops are gone from the graph)."""
        for kind in [*self.kinds, *(k for k, _ in self.variants.values() if k is not None)]:
            _KINDS.pop(kind.id, None)

    @contextmanager
    def stamping(
        self,
        from_constants: Callable[[torch.Tensor], bool],
        from_sizes: Callable[[torch.Tensor], Any],
        value: Callable[[torch.Tensor], torch.Tensor | None],
        trace_kind: Callable[[Kind], str | None],
    ) -> Iterator[None]:
        """The trace of the model: each call of an adopted kind runs as `fbmt::stamp` (step 3).
        `from_constants(t)`: whether tensor t, in the graph being traced, derives from no input;
        `from_sizes(t)`: where it derives from the inputs' sizes alone, its graph of them (a
        `masks.MaskCheck`, or None where it cannot be evaluated), else False; `value(t)`: a tensor
        from constants' value; `trace_kind(kind)`: trace a kind there and then (step 2; for calls
        given some arguments from constants or sizes, `kind.known`), and why not, or None."""
        counter = iter(range(len(self.calls)))

        def stamp(path: str, block: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
            call = next(counter, None)
            kind = self.of_call.get(call) if call is not None else None
            if kind is None or self.calls[call].block != path:
                return forward(*args, **kwargs)
            leaves, in_spec = pytree.tree_flatten((args, kwargs))
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            objs = {i: x for i, x in enumerate(leaves) if kind.in_leaves[i] is _OBJ} if in_spec == kind.in_spec else {}
            same = (
                in_spec == kind.in_spec
                and _plain([x for i, x in enumerate(leaves) if i not in objs])
                and torch.is_grad_enabled() == kind.grad_mode
                and [_tensor_meta(x) for x in tensors] == kind.arg_metas()
                and [_ARG if isinstance(x, torch.Tensor) else _OBJ if i in objs else x for i, x in enumerate(leaves)]
                == kind.in_leaves
                and _as_recorded(objs, self.calls[call])
            )
            if not same:
                self.not_stamped.append(f"{path}: its arguments differ from the fake forward's")
                return forward(*args, **kwargs)
            known = {i: value(x) for i, x in enumerate(tensors) if from_constants(x)}
            known.update({i: g for i, x in enumerate(tensors) if (g := from_sizes(x)) is not False})
            if known:
                kind, why = self._variant(kind, known, trace_kind)
                if kind is None:
                    self.not_stamped.append(f"{path}: {why}")
                    return forward(*args, **kwargs)
            else:
                if kind.id not in self.traced:
                    self.traced[kind.id] = why = trace_kind(kind)
                    if why is not None:
                        self.not_stamped.append(f"{kind.block}'s kind: {why}")
                if self.traced[kind.id] is not None:
                    return forward(*args, **kwargs)
            for _ in range(self.calls[call].nested):  # the calls within it are stamped with it
                next(counter, None)
            inputs = [*_local_tensors(block, kind.params), *_local_tensors(block, kind.buffers), *tensors]
            made = list(_Stamped.apply(kind.id, call, *inputs))
            self.stamped[kind.block] = self.stamped.get(kind.block, 0) + 1
            # a result the block returns as it got it is that tensor, as the block's own code gives it: what
            # the model's trace knows of it (a mask from constants, which decides the next call's) stays
            n = len(kind.out_tensors())
            outs = iter([inputs[kind.passes[j]] if j in kind.passes else made[j] for j in range(n)] + made[n:])
            result = pytree.tree_unflatten(
                [next(outs) if isinstance(x, _Tensor) else x for x in kind.out_leaves], kind.out_spec
            )
            for w in self.calls[call].writes:  # its writes, as the fake forward saw them
                try:
                    objects.put(objs[w.leaf], w.path, next(outs) if isinstance(w.value, int) else w.value)
                except Exception as e:  # an object that will not take the write from outside (frozen)
                    raise Refused(f"{path} could not write {w.path} of its {type(objs[w.leaf]).__name__}: {e}") from e
            return result

        with self._wrapped(stamp):
            yield

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Blocks run their own forward within: a kind traced while the model's trace runs."""
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1

    def _variant(
        self, kind: Kind, known: dict[int, Any], trace_kind: Callable[[Kind], str | None]
    ) -> tuple[Kind | None, str]:
        """The kind for calls given these constants (or tensors of sizes), traced on its first call; or
        None and why."""
        if any(v is None for v in known.values()):
            return None, "an argument computed from constants or sizes alone could not be evaluated"
        # a graph of sizes is one object per tensor of the trace: the calls given that tensor share a kind
        key = (
            kind.id,
            tuple(
                (i, _digest(v) if isinstance(v, torch.Tensor) else ("sizes", id(v))) for i, v in sorted(known.items())
            ),
        )
        if key not in self.variants:
            variant = kind.variant(known)
            why = trace_kind(variant)
            self.variants[key] = (
                (variant, "") if why is None else (None, f"its kind, for its constant arguments: {why}")
            )
            if why is None:
                _KINDS[variant.id] = variant
        return self.variants[key]

    def said(self) -> list[str]:
        """What the program's summary says about stamping (the trace's line)."""
        lines = []
        if self.stamped:
            kinds = ", ".join(f"{b}'s x{n}" for b, n in self.stamped.items())
            lines.append(f"traced {len(self.stamped)} {STAMPED} ({kinds})")
            traced = [*self.kinds, *(k for k, _ in self.variants.values() if k is not None)]
            lines += list(dict.fromkeys(note for k in traced if k.block in self.stamped for note in k.notes))
        if self.not_stamped:  # "who: why", the blocks of one reason named together
            by_why: dict[str, list[str]] = {}
            for entry in self.not_stamped:
                who, _, why = entry.partition(": ")
                by_why.setdefault(why, []).append(who)
            said = [f"{', '.join(dict.fromkeys(who))}: {why}" for why, who in by_why.items()]
            lines.append(f"blocks traced as code: {'; '.join(said)}")
        return lines


class _Bound:
    """`block.forward` while a trace wraps it: the wrapper, told which block it serves."""

    def __init__(self, wrapper: Callable, path: str, block: nn.Module, forward: Callable) -> None:
        self.wrapper, self.path, self.block, self.forward = wrapper, path, block, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(self.path, self.block, self.forward, *args, **kwargs)


def _tied(module: nn.Module) -> set[int]:
    """The parameters reached under two or more paths."""
    seen: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def split_kind(kind: Kind, graph: fx.Graph, n_outputs: int, wrt: list[int]) -> str | None:
    """Read a kind's joint graph into its forward and backward; why it cannot be stamped, or None."""
    kind.graph, kind.wrt = graph, wrt
    kind.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = set(kind.placeholders)
    started = False
    owner = graph.owning_module
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr" and isinstance(getattr(owner, n.target, None), torch.Tensor):
            kind.constants[n] = getattr(owner, n.target)  # a tensor its forward made (a cache's empty start)
            (kind.backward if kind.backward else kind.forward).append(n)
            continue
        if n.op != "call_function":
            return f"its graph reads an attribute ({n.target})"
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            return f"it writes to a tensor ({n.target})"
        if meta.module(n) is not None:
            if kind.backward:
                return "its forward and backward interleave"
            started = True
            kind.forward.append(n)
        elif started:
            kind.backward.append(n)
        elif n.target in _INPUT_VIEWS and n.args[0] in inputs:
            kind.prelude.append(n)
        else:
            return f"its trace ran {n.target} before the block"
    (values,) = next(iter(reversed(graph.nodes))).args
    kind.outputs, kind.grads = list(values[:n_outputs]), list(values[n_outputs:])
    if not all(isinstance(o, fx.Node) for o in kind.outputs):
        return "a result is not a tensor of its graph"
    return None


# What a kind's trace may make of its inputs before the block's first op: the same values, read as its
# inputs (torch 2.13's trace makes detaches of them, 2.14's and later ones aliases).
_INPUT_VIEWS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)

_SIZE_READS = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.sym_numel.default,
}


def base_name(graph: fx.Graph, n: fx.Node) -> str:
    """The name make_fx gives a node of this target, before its count: an op's packet ("mm"), but a
    size read's whole overload ("sym_size_int"), which make_fx makes outside its op calls."""
    if isinstance(n.target, torch._ops.OpOverload) and n.target not in _SIZE_READS:
        return graph._target_to_str(n.target.overloadpacket.__name__)
    return graph._target_to_str(n.target)


def inline(
    graph: fx.Graph, stamper: Stamper, owner: nn.Module
) -> tuple[fx.Graph, dict[fx.Node, Any], dict[fx.Node, str], dict[str, torch.Tensor]]:
    """The graph with each stamp op replaced by its kind's nodes (step 4), every node named as make_fx
    names it; where each node of `graph` went; the attention masks the kinds decided, as copied
    (the trace drops the dead ones after, as it does its own: the names stay make_fx's); and the
    tensor constants its `get_attr` nodes read (`owner`'s for the graph's own), by their new names."""
    new = fx.Graph()
    env: dict[fx.Node, Any] = {}
    decided: dict[fx.Node, str] = {}
    copies: dict[int, dict[fx.Node, Any]] = {}  # a call -> its kind's nodes -> their copies
    constants: dict[str, torch.Tensor] = {}
    stamp_op, grad_op = torch.ops.fbmt.stamp.default, torch.ops.fbmt.stamp_grad.default

    sizes: dict[Any, fx.Node] = {}  # a symbolic size's expression -> the first node that computes it

    def copy(n: fx.Node, local: dict[fx.Node, Any], module: str | None = None, kind: Kind | None = None) -> fx.Node:
        size = n.meta.get("val")
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if kind is not None and expr in sizes:
            # a copy reads a size the program computes already: the model's trace reads each symbol once
            # too, and a backward that read it from a forward value would keep that value alive for it
            return sizes[expr]
        if n.op == "get_attr":  # each copy of a constant is one of its own, named in order as make_fx names them
            name = f"_tensor_constant{len(constants)}"
            constants[name] = kind.constants[n] if kind is not None else getattr(owner, n.target)
            c = new.create_node("get_attr", name, name=name)
        else:
            args, kwargs = fx.map_arg((n.args, n.kwargs), local.__getitem__)
            c = new.create_node(n.op, n.target, args, kwargs, name=base_name(new, n))
        c.meta = dict(n.meta)
        if module is not None:
            meta.tag(c, module=module)
        if expr is not None:
            sizes.setdefault(expr, c)
        return c

    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = new.placeholder(n.name, type_expr=n.type)
            env[n].meta = dict(n.meta)
        elif n.op == "output":
            new.output(fx.map_arg(n.args[0], env.__getitem__)).meta = dict(n.meta)
        elif n.target is operator.getitem and getattr(n.args[0], "target", None) in (stamp_op, grad_op):
            env[n] = env[n.args[0]][n.args[1]]
        elif n.target is stamp_op:
            kind_id, call, inputs = n.args
            kind = _KINDS[kind_id]
            local: dict[fx.Node, Any] = {p: env[x] for p, x in zip(kind.placeholders, inputs)}
            for kn in kind.prelude:  # the detaches/aliases of its inputs that the kind's trace made
                local[kn] = local[kn.args[0]]
            src, dst = kind.block, stamper.calls[call].block
            for kn in kind.forward:
                path = meta.module(kn)
                moved = dst + path[len(src) :] if path == src or path.startswith(src + ".") else path
                local[kn] = copy(kn, local, moved, kind)
            copies[call] = local
            decided.update({local[m]: d for m, d in kind.decided.items()})
            env[n] = [local[o] for o in kind.outputs]
        elif n.target is grad_op:
            kind_id, call, grads = n.args
            kind, local = _KINDS[kind_id], copies[call]
            local.update({t: env[g] for t, g in zip(kind.placeholders[kind.n_inputs :], grads)})
            for kn in kind.backward:
                local[kn] = copy(kn, local, kind=kind)
            env[n] = [local[g] for g in kind.grads if g is not None]
        else:
            env[n] = copy(n, env)
    return new, env, decided, constants
