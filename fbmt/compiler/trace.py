"""Trace a module's forward *and* backward into one functional, aten-level fx graph.

Requires: a module whose parameters may live on any device, `meta` included (tracing runs on fake
tensors, so a 13B model traces without being materialized), and a `Layout` from the compile step.
Ensures: a `Program` whose graph is functional (no in-place ops except one `copy_` per mutated
buffer, placed at the end of the forward), every node stamped with its phase (NOTE: [Phases]) and
every forward node with the innermost module path that produced it.

How: `make_fx` over `torch.func.functional_call` + `torch.autograd.grad` gives the joint graph,
in-place ops included; where it has any, a second `make_fx` over `torch.func.functionalize` of that
graph removes them (the functional transforms refuse `requires_grad_` inside, hence two steps). Global
module hooks tag each node with its module while the first trace runs; an Interpreter carries the
tags through the second.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot, make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from fbmt import flags, logs
from fbmt.compiler import assertions, host_calls, host_draws, masks, meta, objects, sizes, stamp
from fbmt.compiler.layout import Layout
from fbmt.compiler.ops import ctc, fake_kernels, masked_put, record
from fbmt.compiler.ops.graph import fake_value
from fbmt.compiler.program import BWD, FWD, Program, Results, Role
from fbmt.logs import user_line

aten = torch.ops.aten


# NOTE: [Ops whose schema hides a mutation]
# `aten.native_batch_norm` (what nn.BatchNorm runs in training) updates the running statistics in
# place, but its schema does not say so: functionalization keeps it as it is, and a copy of it
# that recompute places in the backward updates the statistics a second time. Traced as the op
# torch introduced to say what it mutates (`_native_batch_norm_legit`, torch's own decomposition,
# which AOTAutograd uses too), the update becomes a value, written back once, in the forward.
# On CUDA, BatchNorm and the recurrent layers pick cuDNN while they are traced (`cudnn_batch_norm`
# hides the same update; cuDNN's RNN repacks its weights through their storage, which fake tensors
# have none of), so tracing runs with cuDNN off: the program holds the native kernels, and
# convolutions, which choose cuDNN inside their kernel, are unaffected.
def _native_batch_norm(*args: Any) -> Any:
    from torch._decomp.decompositions import native_batch_norm_decomposition

    return native_batch_norm_decomposition(*args)


# NOTE: [Draws in memory order]
# Dropout draws its mask into `empty_like(x)`, laid out as `x`, with `bernoulli_`, whose kernel fills
# the tensor in the order of its memory; the functional op a program holds instead, `bernoulli.p`,
# draws into a new contiguous tensor, in the order of its indices. Where `x` is not contiguous (a
# transposed sequence, a convolution's output permuted) the two masks are as random but not the same,
# so a seeded run would not be eager's. The trace draws through a view whose index order is the
# tensor's memory order (a permute), which both functionalization and the rewrite of writes to fresh
# tensors (NOTE: [Writes to fresh tensors]) keep as a write through that view. The other random fills
# (`uniform_`, `normal_`, `exponential_`) have functional ops that keep the layout, and need nothing.
def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The permutation of `t`'s dimensions that lists them by stride, largest first (dimensions of size
    1 first, where they change nothing); None where that is `t`'s own order, or not known without a
    guard on a symbolic size."""
    unit = [d for d in range(t.dim()) if statically_known_true(t.shape[d] == 1)]
    rest = [d for d in range(t.dim()) if d not in unit]
    order: list[int] = []
    for d in rest:  # insertion by stride: a handful of dimensions
        at = len(order)
        while at > 0 and not statically_known_true(t.stride(order[at - 1]) >= t.stride(d)):
            if not statically_known_true(t.stride(order[at - 1]) < t.stride(d)):
                return None
            at -= 1
        order.insert(at, d)
    perm = unit + order
    return None if perm == sorted(perm) or statically_known_true(t.is_contiguous()) else perm


def _bernoulli_(self: torch.Tensor, p: float = 0.5, *, generator: Any = None) -> Any:
    """`self.bernoulli_(p)` drawn in the order of `self`'s memory, as its kernel draws (NOTE: [Draws in
    memory order]); NotImplemented (traced as it is) where that order is its indices'."""
    perm = _memory_order(self)
    if perm is None:
        return NotImplemented
    self.permute(perm).bernoulli_(p, generator=generator)
    return self


_DECOMPOSITIONS = {aten.native_batch_norm.default: _native_batch_norm, aten.bernoulli_.float: _bernoulli_}


def _constant_pad_nd(input: torch.Tensor, pad: list, value: Any = 0) -> torch.Tensor:
    """`constant_pad_nd` as narrows and, for each padded dimension, the input written into a tensor of
    `value`: its own fake kernel reads the input's sizes as plain integers, which fixes a symbolic size
    (Hugging Face's loss pads the labels by one). Not as a cat of the input and its padding: the padding's
    own size is then a size of its own, and cat's choice of layout asks whether it is 1, a guard on the
    length's residue where the padding aligns it (SDPA pads a mask to a multiple of 8 elements, `8 - s % 8`:
    generate() compiled a step's program per class). The result is contiguous, as eager's is for a contiguous
    input. Traced this way only where sizes are symbolic (NOTE: [Dynamic sizes])."""
    x = input
    for k in range(len(pad) // 2):
        dim, left, right = input.dim() - 1 - k, pad[2 * k], pad[2 * k + 1]
        if left < 0:
            x, left = x.narrow(dim, -left, x.shape[dim] + left), 0
        if right < 0:
            x, right = x.narrow(dim, 0, x.shape[dim] + right), 0
        if isinstance(left, int) and isinstance(right, int) and left == right == 0:
            continue
        shape = list(x.shape)
        n = shape[dim]
        shape[dim] = left + n + right
        x = x.new_full(shape, value).slice_scatter(x, dim, left, left + n)
    return x.clone() if x is input else x


def _baddbmm(input: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> Any:
    """`baddbmm` with `input` broadcast to the product's shape first (Bloom's ALiBi bias, one row for every
    query): the meta kernel's own broadcast calls `expand` with symbolic sizes on a meta tensor, which
    fails, so the model fell back to a program per shape. The kernel broadcasts the same way: results
    are unchanged. Traced this way only where sizes are symbolic (NOTE: [Dynamic sizes])."""
    shape = (batch1.shape[0], batch1.shape[1], batch2.shape[2])
    if input.dim() == 3 and all(statically_known_true(a == b) for a, b in zip(input.shape, shape)):
        return NotImplemented
    return torch.baddbmm(input.expand(shape), batch1, batch2, beta=beta, alpha=alpha)


def _polar(abs: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """`polar` as its two parts side by side, viewed as complex (Llama 4's rotary embedding): the fake
    kernels of `polar` and of `complex` fix a symbolic size, so the model compiled a program per shape.
    The kernel computes the same two products, its sine and cosine within their last bit of these.
    Traced this way only where sizes are symbolic (NOTE: [Dynamic sizes])."""
    abs, angle = torch.broadcast_tensors(abs, angle)
    return torch.view_as_complex(torch.stack([abs * torch.cos(angle), abs * torch.sin(angle)], -1))


_SYMBOLIC_DECOMPOSITIONS = {
    **_DECOMPOSITIONS,
    aten.constant_pad_nd.default: _constant_pad_nd,
    aten.baddbmm.default: _baddbmm,
    aten.polar.default: _polar,
}


class _Decompose(TorchDispatchMode):
    """Runs the ops of `table` as their decompositions (the fake forward's: make_fx takes a table)."""

    def __init__(self, table: dict) -> None:
        super().__init__()
        self.table = table

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        decomposition = self.table.get(func)
        out = decomposition(*args, **(kwargs or {})) if decomposition else NotImplemented
        return func(*args, **(kwargs or {})) if out is NotImplemented else out


# NOTE: [Draws compared with a bound]
# LayerDrop in transformers before 5.24 (BART, mBART, Marian, Pegasus, Whisper, ...) draws `torch.rand([])`
# for each layer in every training call and compares it in Python with the drop probability, even where
# that is 0: an `if` on a value no trace has, so those models could not be traced for training. A draw of
# `rand` lies in [0, 1), and its comparison with a number at or beyond those bounds has one answer
# whatever is drawn (`draw < 0` is false). While tracing, that answer is known, and `bool()` of the
# comparison gives it. The draw stays in the program (a random op is never dead), so the generator
# advances as in eager and a dropout after it draws eager's mask. A comparison that depends on the draw
# (a drop probability of 0.3) still fails, named, with the hint to set the probability to 0.
_DRAW_DTYPES = (torch.float32, torch.float64)  # a narrower float may round a draw up to 1
_COMPARISONS = {  # the comparison -> (all true, all false) of a draw in [0, 1) against a number c
    "lt": (lambda c: c >= 1, lambda c: c <= 0),
    "le": (lambda c: c >= 1, lambda c: c < 0),
    "gt": (lambda c: c < 0, lambda c: c >= 1),
    "ge": (lambda c: c <= 0, lambda c: c >= 1),
}
_COMPARED = {
    f: name
    for name in _COMPARISONS
    for f in (getattr(torch, name), getattr(torch.Tensor, name), getattr(torch.Tensor, f"__{name}__"))
}


# NOTE: [CTC's selected targets]
# CTC heads (wav2vec2, HuBERT, WavLM: transformers' CTC loss) gather their targets with `labels.masked_select(
# mask)`, a tensor whose length is the labels' count, a value, and hand it to `F.ctc_loss` with each row's
# count (`mask.sum(-1)`): a trace cannot hold the selection, and ctc_loss's sizes would read the longest row
# too. `ctc_loss` takes the same targets as rows as well (row b's first `target_lengths[b]`), and computes
# the same from them. So while tracing, a selection from a matrix of integers is held as the matrix and
# its mask (`_Selected`, no tensor: any other use of it fails the trace, named), and ctc_loss
# given it reads the matrix with each row's selected entries moved to its front, in order (a stable sort
# of the mask). The two agree where each row's count is its own: the program checks that at every call
# (NOTE: [Checks that raise]), and a call that counts otherwise raises.
class _Selected:
    """`values.masked_select(mask)` of a 2-d `values` while tracing: held for `F.ctc_loss` (NOTE: [CTC's
    selected targets])."""

    def __init__(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        self.values, self.mask = values, mask

    def __getattr__(self, name: str) -> Any:
        raise DynamicOutputShapeException(aten.masked_select.default)  # any use but ctc_loss's: named

    def rows(self) -> torch.Tensor:
        """Each row's selected entries first, in order; what follows them is never read."""
        moved = torch.sort(self.mask.logical_not().to(torch.uint8), dim=1, stable=True).indices
        return self.values.gather(1, moved)


def _ctc_of_selected(args: tuple, kwargs: dict) -> Any:
    """`F.ctc_loss(log_probs, selected, input_lengths, target_lengths, ...)` on the selection's rows."""
    log_probs, selected, input_lengths, target_lengths, *rest = args
    options = {**dict(zip(("blank", "reduction", "zero_infinity"), rest)), **kwargs}
    if log_probs.dim() != 3 or not isinstance(target_lengths, torch.Tensor):
        raise TraceError(
            "ctc_loss of targets selected with masked_select is traced for batched log_probs (T, N, C) and "
            "target_lengths as a tensor only (NOTE: [CTC's selected targets])"
        )
    counts = selected.mask.sum(-1)
    torch._assert_async(
        (target_lengths.to(counts.dtype) == counts).all(),
        "fbmt: ctc_loss's target_lengths are not the counts of each row's selected targets, which the "
        "program assumes (NOTE: [CTC's selected targets])",
    )
    input_lengths = torch.as_tensor(input_lengths, device=log_probs.device)
    return ctc.ctc_loss(log_probs, selected.rows(), input_lengths, target_lengths, **options)


_MASKED_SELECT = (torch.masked_select, torch.Tensor.masked_select)


_TENSOR_OF = (torch.tensor, torch.as_tensor, torch.from_numpy)


class _Decided(TorchFunctionMode):
    """Within a trace: `bool()` of a traced tensor where the answer is known: a comparison of a `rand` draw
    that has one answer (NOTE: [Draws compared with a bound]), a test whose other branch only raises,
    checked at every call (NOTE: [Checks that raise]); CTC's targets selected from a matrix (NOTE:
    [CTC's selected targets]); the results of functions called on the host at every call (NOTE: [Host
    calls]), and a differentiable value assigned where a mask is true (NOTE: [Masked assignment])."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = WeakTensorKeyDictionary()  # tensors drawn by rand: each value in [0, 1)
        self.decided = WeakTensorKeyDictionary()  # comparisons of a draw whose answer is known
        self.selected = False  # a `_Selected` was made: every call's arguments are looked at for one
        self.host = host_calls.Calls(TraceError)
        self._host_installed: contextlib.ExitStack | None = None

    def __enter__(self) -> _Decided:
        self._host_installed = contextlib.ExitStack()
        self._host_installed.enter_context(self.host.installed())
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            installed, self._host_installed = self._host_installed, None
            if installed is not None:
                installed.__exit__(*exc)  # a host array never made a tensor: refused (NOTE: [Host calls])

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _TENSOR_OF and args and isinstance(args[0], host_calls.HostArray):
            return args[0].tensor(*args[1:], **(kwargs or {}))
        if func is torch.Tensor.__setitem__ and _masked_assignment(*args):
            return None
        if func is torch.Tensor.__bool__:
            if args[0] in self.decided:
                return self.decided[args[0]]
            mode = get_proxy_mode()
            last = mode.tracer.graph._root.prev if mode is not None else None
            try:
                return func(*args, **(kwargs or {}))
            except (DataDependentOutputException, GuardOnDataDependentSymNode):  # a value the trace has not
                found = assertions.passing_answer()
                either = assertions.either_answer() if found is None else None  # NOTE: [Guards of masked writes]
                if found is None and either is None:
                    raise
                if last is not None:  # the read the failed attempt recorded: a later run of the graph fails on it
                    while (n := mode.tracer.graph._root.prev) is not last and not n.users:
                        mode.tracer.graph.erase_node(n)
                if found is None:
                    return either
                assertions.check(args[0], *found)
                return found[0]
        if self.selected and any(isinstance(a, _Selected) for a in (*args, *(kwargs or {}).values())):
            if func is torch.nn.functional.ctc_loss and len(args) >= 4 and isinstance(args[1], _Selected):
                return _ctc_of_selected(args, kwargs or {})
            raise DynamicOutputShapeException(aten.masked_select.default)  # any use but ctc_loss's: named
        if func in _MASKED_SELECT and len(args) == 2 and not kwargs:
            values, mask = args
            if values.dim() == 2 and mask.shape == values.shape and not values.is_floating_point():
                self.selected = True
                return _Selected(values, mask)  # targets (a symbolic trace would give them a size of a value)
        out = func(*args, **(kwargs or {}))
        if func in (torch.rand, torch.rand_like) and out.dtype in _DRAW_DTYPES:
            self.draws[out] = True
        elif func in _COMPARED and len(args) == 2 and args[0] in self.draws and _is_number(args[1]):
            always, never = _COMPARISONS[_COMPARED[func]]
            if always(args[1]) or never(args[1]):
                self.decided[out] = bool(always(args[1]))
        return out


# NOTE: [Masked assignment]
# `x[mask] = value`, where `value` requires grad: autograd's backward of the assignment gathers the
# gradient at the mask's true elements (`grad[mask]`), a size of values no trace has. Where `value` is the
# same for every selected element (it broadcasts to one element's shape: SpecAugment's learned embedding,
# a bias), the assignment is `x.copy_(masked_put(x, mask, value))` (fbmt/compiler/ops/masked_put.py), whose
# backward gathers `value`'s gradient inside an op (`fbmt::masked_sum`), at run time, as eager's does:
# eager's values, to the bit.
def _masked_assignment(x: Any, index: Any, value: Any) -> bool:
    """Assign `value` to `x` where the boolean `index` is true, as above; False where it does not apply."""
    if not (
        isinstance(x, torch.Tensor)
        and isinstance(index, torch.Tensor)
        and index.dtype is torch.bool
        and isinstance(value, torch.Tensor)
        and value.requires_grad
        and 0 < index.dim() <= x.dim()
        and value.dim() <= x.dim() - index.dim()
        and index.shape == x.shape[: index.dim()]
    ):
        return False
    x.copy_(masked_put.masked_put(x, index, value.to(x.dtype)))
    return True


def _forget_unbacked(fake_mode: FakeTensorMode) -> None:
    """A value the fake forward read (a check that raises, decided: NOTE: [Checks that raise]) is a symbol of
    a symbolic trace's shape environment that no graph binds; make_fx's first op would otherwise find it
    pending and fail. The trace reads it again, and binds it there, or erases the read."""
    pending = getattr(fake_mode.shape_env, "pending_fresh_unbacked_symbols", None)
    if pending:
        pending.clear()


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


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


# NOTE: [Checkpoints in the model's code]
# A model may call torch.utils.checkpoint itself (nanoGPT's forks, blocks written as torchtitan writes
# them): eagerly the function runs again in the backward to give the same values with less memory. A
# trace cannot run it so: the non-reentrant kind recomputes inside autograd's backward, where the
# module's parameters are no longer the trace's, and the reentrant kind refuses `autograd.grad`. What the
# backward recomputes is fbmt's to decide (`remat=`), so while tracing a checkpoint is a call of its
# function. Where eager gives other values it is followed: a reentrant checkpoint none of whose tensor
# inputs requires grad returns results that do not (its function's parameters get no gradient), with
# torch's own warning. Hugging Face's `gradient_checkpointing_enable()` makes each layer such a call
# (NOTE: [Hugging Face's checkpointing]).
#
# For the same reason `torch.autograd.graph.save_on_cpu` in the model's code (Hugging Face's
# `activation_checkpointing_enable(offload=True)` wraps each layer's checkpoint in one) saves nothing on
# the host while tracing: its hooks copy each saved tensor to the host and back, which gives the values
# it was given, and traced they became ops of the program (pinned buffers Inductor cannot make). The
# trace says so and warns: what it saves is remat='s to decide, on the GPU.
_saved_on_host: list[str] = []  # each save_on_cpu the traced forward entered, as the trace says it


class _ReentrantAsCall:
    """`torch.utils.checkpoint.CheckpointFunction` while tracing: its function, called."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        import torch.utils.checkpoint as checkpoint

        if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            checkpoint.check_backward_validity(args)  # eager's warning: gradients will be None
            with torch.no_grad():
                return function(*args)
        return function(*args)


def _nothing_around(*args: Any, **kwargs: Any) -> Iterator[None]:
    """The non-reentrant checkpoint's before and after while tracing: nothing (it yields twice)."""
    yield


@contextmanager
def _checkpoints_as_calls() -> Iterator[None]:
    """NOTE: [Checkpoints in the model's code]."""
    import torch.utils.checkpoint as checkpoint

    # the non-reentrant generator's name differs between releases (torch 2.15's `checkpoint` calls an `_impl`
    # of it that takes the arguments as a tuple and a dict): every one of them
    names = {"CheckpointFunction": _ReentrantAsCall}
    names.update({k: _nothing_around for k in vars(checkpoint) if k.startswith("_checkpoint_without_reentrant_gen")})
    saved = {k: getattr(checkpoint, k) for k in names if hasattr(checkpoint, k)}
    for k in saved:
        setattr(checkpoint, k, names[k])
    on_host = torch.autograd.graph.save_on_cpu
    made = on_host.__init__

    def nothing_on_host(self: Any, pin_memory: bool = False, device_type: str = "cuda") -> None:
        _saved_on_host.append(f"save_on_cpu(pin_memory={pin_memory})")
        torch.autograd.graph.saved_tensors_hooks.__init__(self, itself, itself)

    on_host.__init__ = nothing_on_host
    _saved_on_host.clear()
    try:
        yield
    finally:
        on_host.__init__ = made
        for k, v in saved.items():
            setattr(checkpoint, k, v)


def itself(t: Any) -> Any:
    """A saved-tensor hook that keeps the tensor as it is (the caller's hooks and save_on_cpu's, while tracing)."""
    return t


def _host_saves_said() -> tuple[str, ...]:
    """The trace's line on the model's save_on_cpu, and its warning (NOTE: [Checkpoints in the model's code])."""
    if not _saved_on_host:
        return ()
    logs.log.warning(
        "fbmt: the model's forward saves tensors for its backward on the host (torch.autograd.graph.save_on_cpu, "
        "as Hugging Face's activation_checkpointing_enable(offload=True) does); fbmt's program leaves those copies "
        "out and keeps what its backward needs on the device, as remat= decides (remat='block' keeps the least)"
    )
    return (f"{_saved_on_host[0]} in the forward left out: remat= decides what the backward keeps",)


def _watching_hooks(fn: Callable[..., Program]) -> Callable[..., Program]:
    @functools.wraps(fn)
    def traced(module: nn.Module, *args: Any, **kwargs: Any) -> Program:
        with _hooks_that_return_nothing(module):  # NOTE: [Hooks that return nothing]
            return fn(module, *args, **kwargs)

    return traced


@_watching_hooks
@_tracing()  # a fresh context for every call: tracing() is True while it runs
@_checkpoints_as_calls()  # NOTE: [Checkpoints in the model's code]
@torch.backends.cudnn.flags(enabled=False)  # NOTE: [Ops whose schema hides a mutation]
# A function of the model's code under torch.compile runs as Python while traced: Dynamo would compile
# it for the fake forward's tensors and run Inductor's kernel on them (a segmentation fault on the host),
# and refuses make_fx's trace; the program's own backend decides how it is compiled.
@torch.compiler.set_stance("force_eager")
@torch._dynamo.config.patch(error_on_nested_fx_trace=False)
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
    dynamic: dict[int, tuple[int, ...]] | None = None,
    numbers: tuple[tuple[int, tuple], ...] = (),
    at_most: dict[tuple[int, int], int] | None = None,
    entry: str = "",
) -> Program:
    """Trace one call `module(*args, **kwargs)` into a joint Program (see the module docstring).

    `trainable[k]` says whether group k's parameters get gradients (default: `group.requires_grad`).
    `dynamic[i]`: the dimensions of input tensor i traced as symbols (NOTE: [Dynamic sizes]).
    `numbers`: (argument leaf, path in it) of numbers argument objects hold, each the size of an input
    after the call's tensors, which the forward gets in their place (NOTE: [Numbers in an object]).
    `at_most`: (input, dimension) -> that symbol's bound, where above four times its traced size
    (`sizes.fake_inputs`).
    `entry`: call the submodule at this path instead, over the same parameters (NOTE: [Submodules
    through the program]); its nodes keep their paths in `module`.
    """
    started = time.perf_counter()
    fake_kernels()
    fake_mode = sizes.symbolic_mode() if dynamic else FakeTensorMode()
    rg = trainable if trainable is not None else tuple(g.requires_grad for g in layout.groups)
    params = [(s.name, s.shape, g.compute, rg[g.index]) for g in layout.groups for s in g.slots]
    with fake_mode:
        fake_params = [torch.empty(shape, dtype=dt, device=param_device) for _, shape, dt, _ in params]
        # never symbolic; a model compiled on meta, traced as if it lived on param_device, has its buffers
        # there too (BERT's token types index an embedding whose gradient is on that device)
        fake_buffers = [
            torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=param_device)
            if b.is_meta and param_device.type != "meta"
            else fake_mode.from_tensor(b, static_shapes=True)
            for b in buffers.values()
        ]
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    in_objects = {i: objects.tensors_in(x) for i, x in enumerate(leaves) if objects.is_object(x)}
    # an input made under inference_mode has no version counter, which the trace reads: traced from a copy
    real_inputs = [x.clone() if x.is_inference() else x for x in objects.input_tensors(leaves)]
    n_held = len(real_inputs)
    real_inputs += [sizes.number_input(objects.number_at(leaves, at), param_device) for at in numbers]
    symbolic = None
    if dynamic:
        fake_inputs = sizes.fake_inputs(fake_mode, real_inputs, dynamic, at_most)
        symbolic = sizes.SymbolicSizes.of(fake_inputs, real_inputs)  # the symbols as made, before any guard
    else:
        fake_inputs = [fake_mode.from_tensor(x) for x in real_inputs]
    input_rg = [needs_grad and x.requires_grad for x in real_inputs]
    names = [p[0] for p in params] + list(buffers)
    param_rg = [needs_grad and p[3] for p in params]

    decided: dict[fx.Node, str] = {}  # attention masks seen (NOTE: [Causal masks])
    checks: list[masks.MaskCheck] | None = [] if dynamic else None  # a symbolic program's, proved at each size

    def call(ps: list, bs: list, xs: list) -> tuple[Any, dict[int, Any], list[tuple[str, torch.Tensor]]]:
        """The forward on these tensors, the copies of the argument objects it was given, and the buffers
        it assigned that a program cannot write in place (NOTE: [Buffers a forward assigns])."""
        full = list(leaves)
        for i, x in zip(tensor_pos, xs):
            full[i] = x
        at, copies = len(tensor_pos), {}
        for i, held in in_objects.items():  # a copy holding fakes: the caller's object is never touched
            full[i] = copies[i] = objects.rebuild(leaves[i], xs[at : at + len(held)])
            at += len(held)
        for (i, path), x in zip(numbers, xs[n_held:]):  # NOTE: [Numbers in an object]
            objects.put(copies[i], path, ("plain", int, x.shape[0]))
        a, kw = pytree.tree_unflatten(full, in_spec)
        tensors = dict(zip(names, [*ps, *bs]))
        given = {k: tensors[k] for k in names[len(ps) :]}  # the buffers, whose reassignment is written back
        root = _Entry(module, entry, given)
        tensors = {f"root.{k}": v for k, v in tensors.items()}
        keeping = sizes.symbolic_kernels([*ps, *xs]) if dynamic else contextlib.nullcontext()
        with keeping, masks.CausalMasks(decided, checks), _Decided():
            return _functional_call(root, tensors, a, kw), copies, root.assigned

    writes = _ModuleWrites(module)  # NOTE: [What a forward keeps on its modules]
    try:
        # A fake forward first: the shapes of the outputs the backward will receive gradients for, and
        # what becomes of the objects among the arguments and results (NOTE: [Objects in a call]).
        probe_ops = _Decompose(_SYMBOLIC_DECOMPOSITIONS) if dynamic else contextlib.nullcontext()
        stamper = stamp.Stamper.for_module(module) if flags.STAMP.get() else None  # NOTE: [Stamped blocks]
        recording = stamper.recording() if stamper is not None else contextlib.nullcontext()
        with _translate_errors(module) as tagger, tagger.installed(), _prints(tagger), fake_mode, probe_ops, recording:
            draws = host_draws.refused(module, lambda: tagger.current, TraceError)  # NOTE: [Host draws]
            with draws as seeded, torch.enable_grad() if needs_grad else torch.no_grad():
                probe_ps = [p.detach().requires_grad_(rg) for p, rg in zip(fake_params, param_rg)]
                probe_bs = [b.clone() for b in fake_buffers]
                probe, copies, assigned = call(
                    probe_ps, probe_bs, [x.detach().requires_grad_(rg) for x, rg in zip(fake_inputs, input_rg)]
                )
        _forget_unbacked(fake_mode)
        kept = writes.observe({id(t) for t in (*probe_ps, *probe_bs)}, assigned)
        del probe_ps, probe_bs
        out_leaves, out_spec = pytree.tree_flatten(probe)
        drop_caches = needs_grad and kwargs.get("use_cache") is not True
        results = _Results(out_leaves, copies, writes.kept_at(), kept, drop_caches=drop_caches)
        probe_outs = results.tensors(out_leaves, copies, kept)
        diff_out = [k for k, o in zip(results.keys, probe_outs) if needs_grad and o.requires_grad]
        wrt_params = [i for i, rg in enumerate(param_rg) if rg]
        wrt_inputs = [i for i, rg in enumerate(input_rg) if rg]
        needs_grad = needs_grad and bool(diff_out) and bool(wrt_params or wrt_inputs)
        if not needs_grad:
            diff_out = []
        by_key = dict(zip(results.keys, probe_outs))
        if stamper is not None:  # which results of each block call the backward gives gradients to, then kinds
            stamper.keeping(writes.paths())
            stamper.group([by_key[k] for k in diff_out])
        with fake_mode:
            fake_tangents = [
                torch.empty(by_key[k].shape, dtype=by_key[k].dtype, device=by_key[k].device) for k in diff_out
            ]
        del probe, copies, probe_outs, by_key, kept, assigned

        n_p, n_b, n_x = len(fake_params), len(fake_buffers), len(fake_inputs)
        diff_pos = [results.keys.index(k) for k in diff_out]

        def joint(*flat: torch.Tensor) -> list:
            ps, bs = list(flat[:n_p]), list(flat[n_p : n_p + n_b])
            xs, ts = list(flat[n_p + n_b : n_p + n_b + n_x]), list(flat[n_p + n_b + n_x :])
            with torch.enable_grad() if needs_grad else torch.no_grad():
                out, copies, assigned = call(ps, bs, xs)
            kept = writes.read(assigned)
            if kept is None and stamper is not None:  # a stamped block set it: its kind's trace set its exemplar's
                raise stamp.Refused("a block kept a tensor on a module outside itself")
            if kept is None:
                raise TraceError(
                    "fbmt.compile: the forward kept tensors on its modules in one run and not in another "
                    f"({', '.join(writes.names())}); it must do the same at every run"
                )
            tensors = results.tensors(pytree.tree_leaves(out), copies, kept)
            if not needs_grad:
                return tensors
            wrt = [ps[i] for i in wrt_params] + [xs[i] for i in wrt_inputs]
            grads = _backward([tensors[i] for i in diff_pos], wrt, ts, allow_unused=True)
            return [*tensors, *grads]

        if needs_grad:  # leaves that require grad as they come in: a detach of each inside would cost a traced op
            fake_params = [p.requires_grad_(rg) for p, rg in zip(fake_params, param_rg)]
            fake_inputs = [x.detach().requires_grad_(rg) for x, rg in zip(fake_inputs, input_rg)]
        flat_in = [*fake_params, *fake_buffers, *fake_inputs, *fake_tangents]
        table = _SYMBOLIC_DECOMPOSITIONS if dynamic else _DECOMPOSITIONS
        if stamper is not None:  # each kind is traced at its first call, within the model's trace
            for kind in stamper.kinds:
                stamper.adopt(kind)

        def trace_kind(kind: stamp.Kind) -> str | None:  # within the model's trace: blocks run their own forward
            with stamper.paused():
                return _trace_kind(module, kind, fake_mode, table, needs_grad, checks)

        writes.reset()
        try:
            stamping = stamper.stamping(*_constants(), trace_kind) if stamper is not None else contextlib.nullcontext()
            with _translate_errors(module) as tagger, tagger.installed(), _prints(tagger), stamping:
                first = make_fx(joint, tracing_mode="fake", decomposition_table=table)(*flat_in)
        except stamp.Refused as e:  # a surprise in the backward: the trace again, every block as code
            stamper.release()
            stamper, decided = None, {}
            logs.log.info("traced again without stamping blocks: %s", e)
            writes.reset()
            with _translate_errors(module) as tagger, tagger.installed(), _prints(tagger):
                first = make_fx(joint, tracing_mode="fake", decomposition_table=table)(*flat_in)
        gm, graph = first, first.graph
        mutates = _mutates(graph)
        if mutates:
            _refuse_parameter_writes(graph, [p[0] for p in params])
        rewritten = mutates and _without_writes(graph)  # NOTE: [Writes to fresh tensors]
        # the dead masks go before any node is named again: by the second trace (which would trace them
        # again), or as it would name them
        dropped = mutates
        if dropped:
            masks.drop_dead(decided)
        if mutates and not rewritten:  # NOTE: [Functional already]
            with _translate_errors(module):
                gm = make_fx(
                    functionalize(lambda *a: _TagCarrier(first).run(*a), remove="mutations"), tracing_mode="fake"
                )(*flat_in)
            graph = gm.graph
        owner: Any = gm  # where the graph's get_attr nodes find their tensors
        if stamper is not None and stamper.of_call:
            graph, moved, kinds_decided, held = stamp.inline(graph, stamper, gm)
            owner = types.SimpleNamespace(**held)
            if dropped:
                masks.drop_dead(kinds_decided)
            # the masks' nodes as inlining copied them (and named them, as make_fx had); a dropped one, and
            # one of a graph traced again, as it was
            decided = {moved.get(n, n): kind for n, kind in decided.items()}
            decided.update(kinds_decided)
            stamper.release()
        elif rewritten:  # named as the functionalized trace would name them, as inlining names its own
            graph, moved = _named_as_make_fx(graph)
            decided = {moved.get(n, n): kind for n, kind in decided.items()}
        if not dropped:
            masks.drop_dead(decided)

        constants = _lift_constants(graph, owner, before=n_p + n_b + n_x)
        inputs = (
            [Role("param", p[0]) for p in params]
            + [Role("buffer", b) for b in buffers]
            + [Role("input", i) for i in range(n_x)]
            + [Role("constant", k) for k in constants]
            + [Role("tangent", i) for i in diff_out]
        )
        outputs = [Role("output", k) for k in results.keys] + (
            [Role("grad", params[i][0]) for i in wrt_params] + [Role("input_grad", i) for i in wrt_inputs]
            if needs_grad
            else []
        )
        program = Program(
            graph=graph,
            inputs=inputs,
            outputs=outputs,
            layout=layout,
            out_spec=out_spec,
            results=results.plan,
            needs_grad=needs_grad,
            constants=constants,
            sizes=symbolic,
            entry=entry,
        )
        if symbolic is not None and checks:
            symbolic.masks = checks  # admitted sizes are proved again (NOTE: [Causal masks])
        _canonicalize(program)
        program.seeded = seeded  # NOTE: [Host draws]
        if seeded and any(n.target is torch.ops.fbmt.host_call.default for n in program.graph.nodes):
            raise TraceError(
                "fbmt.compile: the forward seeds " + ", ".join(name for name, _ in seeded) + " and calls a "
                "function on the host at every call (NOTE: [Host calls]), which eager runs on the seeded generator "
                "and a program on the generator as the call finds it; draw with torch's random functions instead"
            )
        said = (
            *results.plan.notes,
            *masks.CausalMasks.said(decided),
            *(stamper.said() if stamper else ()),
            *host_calls.said(program.graph),
            *_host_saves_said(),
        )
        stats = TraceStats(tuple(constants), said)
        if stats.constants or stats.notes:  # what a reader of print(program) should know about the trace itself
            program.record("trace", time.perf_counter() - started, stats)
    except BaseException:
        writes.reset()  # a failed trace leaves the modules as the call found them
        raise
    program.writes = writes.done()
    return program


def _trace_kind(
    module: nn.Module,
    kind: stamp.Kind,
    fake_mode: FakeTensorMode,
    table: dict,
    needs_grad: bool,
    checks: list[masks.MaskCheck] | None = None,
) -> str | None:
    """Trace one call of a kind of block alone, forward and backward, as `trace` traces the model (NOTE:
    [Stamped blocks], step 2); why its calls cannot be stamped, or None. A kind for calls given
    arguments from constants or from sizes alone (`kind.known`) is traced within the model's trace, at
    its first call, and its masks decided by those values, as the model's trace decides them (NOTE:
    [Causal masks]). `checks`: a program of symbolic sizes's, which the masks it decides join."""
    if get_proxy_mode() is not None:
        with disable_proxy_modes_tracing():
            return _trace_kind(module, kind, fake_mode, table, needs_grad, checks)
    n, n_pb = kind.n_inputs, len(kind.params) + len(kind.buffers)
    rg = [r for _, r in kind.inputs]
    outs = kind.out_tensors()
    gets = kind.gets_grad or (True,) * len(outs)  # a result its calls' callers read no gradient of gets none
    diff = [i for i, o in enumerate(outs) if needs_grad and o.requires_grad and gets[i]]
    wrt = [i for i, r in enumerate(rg) if r] if diff else []
    if diff and not wrt:
        diff = []
    with fake_mode:
        flat_in = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t, _ in kind.inputs]
        flat_in += [
            torch.empty_strided(o.fake.shape, o.fake.stride(), dtype=o.fake.dtype, device=o.fake.device)
            for o in (outs[i] for i in diff)
        ]
    decided: dict[fx.Node, str] = {}

    def joint(*flat: torch.Tensor) -> list:
        ins = [x.detach().requires_grad_(r) for x, r in zip(flat[:n], rg)]
        tracer = get_proxy_mode().tracer
        known = {get_proxy_slot(ins[n_pb + i], tracer).proxy.node: v for i, v in kind.known.items()}
        with torch.enable_grad() if kind.grad_mode else torch.no_grad():
            args, kwargs, copies = kind.arguments(ins[n_pb:])
            before = {i: objects.state(o) for i, o in copies.items()}
            tensors = {f"block.{k}": v for k, v in zip(kind.params + kind.buffers, ins[:n_pb])}
            # as the model's trace calls it (`trace.call`): a symbolic one runs its kernels for every size, and
            # proves its rewritten masks again at each size it admits
            keeping = sizes.symbolic_kernels(ins) if checks is not None else contextlib.nullcontext()
            with keeping, masks.CausalMasks(decided, checks, known=known), _Decided():
                out = _functional_call(_Forward(kind.module, kind.block), tensors, args, kwargs)
        tensors = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        written = _written(kind, copies, before)
        if written is None:  # refuses the kind (below)
            raise TraceError("traced alone, it wrote to its argument objects otherwise than in the forward")
        if not diff:
            return [*tensors, *written]
        grads = _backward([tensors[i] for i in diff], [ins[i] for i in wrt], list(flat[n:]), allow_unused=True)
        return [*tensors, *written, *grads]

    try:
        with _translate_errors(module) as tagger, tagger.installed(), _prints(tagger):
            gm = make_fx(joint, tracing_mode="fake", decomposition_table=table)(*flat_in)
    except TraceError as e:  # the model's trace will meet it too and say so, where it is
        return f"its trace failed ({str(e).splitlines()[0]})"
    if _mutates(gm.graph) and not _without_writes(gm.graph):  # as the model's trace does (NOTE: [Functional
        # already], NOTE: [Writes to fresh tensors]); it must then write
        first = gm  # to no input: its copy would write to its exemplar's
        masks.drop_dead(decided)  # before the second trace, as the model's trace drops its own
        kind.notes = [f"{kind.block}'s kind: {line}" for line in masks.CausalMasks.said(decided)]
        decided = {}  # nodes of the first graph: nothing of them is copied
        try:
            with _translate_errors(module):
                gm = make_fx(
                    functionalize(lambda *a: _TagCarrier(first).run(*a), remove="mutations"), tracing_mode="fake"
                )(*flat_in)
        except TraceError as e:
            return f"its functionalization failed ({str(e).splitlines()[0]})"
        if _mutates(gm.graph):
            return "it writes to one of its inputs"
    kind.decided = decided  # dropped from each copy, as the model's trace drops its own (stamp.inline)
    kind.differentiable = diff
    return stamp.split_kind(kind, gm.graph, n_outputs=len(outs) + len(kind.written()), wrt=wrt)


def _written(kind: stamp.Kind, copies: dict[int, Any], before: dict[int, dict]) -> list[torch.Tensor] | None:
    """The tensors a kind's trace wrote to its copies of the objects, in the order of the exemplar's
    writes in the fake forward; None where it wrote anything else, or elsewhere."""
    done = []
    for i, o in copies.items():
        changed = objects.changes(before[i], objects.state(o))
        if changed is None:
            return None
        done += [(i, path, leaf) for path, leaf in changed]
    if [(i, path) for i, path, _ in done] != [(w.leaf, w.path) for w in kind.writes]:
        return None
    written = []
    for (_, _, leaf), w in zip(done, kind.writes):
        if isinstance(w.value, int) != isinstance(leaf, torch.Tensor):
            return None
        if isinstance(leaf, torch.Tensor):
            written.append(leaf)
        elif leaf != w.value:
            return None
    return written


def _constants() -> tuple[
    Callable[[torch.Tensor], bool], Callable[[torch.Tensor], Any], Callable[[torch.Tensor], torch.Tensor | None]
]:
    """Three questions, during a trace: whether a tensor's node in the graph derives from no placeholder
    (a mask built from sizes; NOTE: [Causal masks]); where it derives from the placeholders' sizes alone
    (such a mask in a program of symbolic sizes), its graph of them (`masks.of_sizes`; None where that
    will not run), else False; and a tensor of the first kind's value. Memoized: a trace asks them of
    every block's arguments, and the calls given one tensor get one graph of it."""
    reaches: dict[fx.Node, bool] = {}  # whether a node derives from a placeholder
    reads: dict[fx.Node, bool] = {}  # whether it derives from a placeholder's values, not only its sizes
    values: dict[fx.Node, torch.Tensor | None] = {}
    graphs: dict[fx.Node, Any] = {}

    def node_of(t: torch.Tensor) -> fx.Node | None:
        mode = get_proxy_mode()
        slot = get_proxy_slot(t, mode.tracer, None) if mode is not None else None
        return slot.proxy.node if slot is not None else None

    def derives(node: fx.Node, memo: dict[fx.Node, bool], sizes_count: bool) -> bool:
        todo = [node]
        while todo:
            n = todo[-1]
            if n in memo:
                todo.pop()
                continue
            if not sizes_count and isinstance(n.meta.get("val"), torch.SymInt):
                memo[n] = False  # a size: what it was read from does not flow through it
                todo.pop()
                continue
            pending = [a for a in n.all_input_nodes if a not in memo]
            if pending and n.op != "placeholder":
                todo += pending
                continue
            memo[n] = n.op == "placeholder" or any(memo[a] for a in n.all_input_nodes)
            todo.pop()
        return memo[node]

    def value(t: torch.Tensor) -> torch.Tensor | None:
        node = node_of(t)
        if node is None:
            return None
        if node not in values:
            values[node] = masks.constant_value(node, get_proxy_mode().tracer.root)
        return values[node]

    def constant(t: torch.Tensor) -> bool:
        node = node_of(t)
        return node is None or not derives(node, reaches, sizes_count=True)  # no node: a constant

    def of_sizes(t: torch.Tensor) -> Any:
        node = node_of(t)
        if node is None or not derives(node, reaches, True) or derives(node, reads, sizes_count=False):
            return False
        if node not in graphs:
            graphs[node] = masks.of_sizes(node, get_proxy_mode().tracer.root)
        return graphs[node]

    return constant, of_sizes, value


@dataclass(frozen=True)
class TraceStats:
    """What tracing did that a reader of the program should know (NOTE: [Pass stats])."""

    constants: tuple[str, ...]  # tensor constants the forward made, lifted as inputs of kind "constant"
    notes: tuple[str, ...]  # what tracing left out (a cache a training call dropped), the attention masks it dropped

    def __str__(self) -> str:
        lifted = [f"lifted {len(self.constants)} tensor constants as inputs: {', '.join(self.constants)}"]
        return "; ".join((lifted if self.constants else []) + list(self.notes))


# NOTE: [What a forward keeps on its modules]
# A forward may set attributes of its modules as it runs: a count of its calls (`self.calls += 1`), the
# length it saw last, or a tensor the training loop reads after the call (a VAE's `self.kl`, a mixture
# of experts' `self.aux_loss`, attention maps kept for a plot). Tracing runs the forward more than once
# (the fake forward, a block of each kind, the trace itself), so each run starts from the attributes the
# call found (`_ModuleWrites.reset`), and after the trace the modules hold what one run left: the program
# computes with the values eager's call would see, and a count counts the call once. A plain value
# written so is a watched attribute, whose new value builds the program of it (NOTE: [Attributes read as
# constants], which says what becomes of one written at every call). A tensor, or a list, tuple or dict
# holding tensors, that the forward assigns is an output of the program (`Results.kept`): after each
# call the attribute holds that call's value, its gradient flowing into the program's backward as in
# eager, and the trace leaves it as the call found it. A tensor put into a container the module already
# held (`self.losses.append(loss)`) has no such place and is refused, naming the attribute: assign a new
# value instead. A block whose call keeps a tensor is traced as code, not stamped (the stamp op would set
# nothing); a stamped block that set one outside itself makes the trace run again without stamping.
_ABSENT = object()
_MODULE_OWN = frozenset(vars(nn.Module()))  # what nn.Module keeps in every module: parameters, hooks...


# nn.Module's dicts of hooks (its parameters, buffers and children are the trace's own business)
_HOOK_DICTS = tuple(
    k for k, v in vars(nn.Module()).items() if isinstance(v, dict) and k not in ("_parameters", "_buffers", "_modules")
)


def _hooks_of(m: nn.Module) -> list[dict | None]:
    return [dict(d) if (d := vars(m).get(k)) is not None else None for k in _HOOK_DICTS]


def _same_dict(a: dict | None, b: dict | None) -> bool:
    """The same keys, each to the very same value."""
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(a[k] is v for k, v in b.items())


def _container(v: Any) -> bool:
    return isinstance(v, (list, tuple, dict))


def _plain(v: Any) -> bool:
    """A value the compile cache keeps as it is (a program's writes are among what it saves)."""
    plain = objects.PLAIN
    return isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))


def _undo(container: Any, was: Any) -> None:
    """A list or dict as it was before the forward added to it."""
    if isinstance(container, list):
        container[:] = was
    elif isinstance(container, dict):
        container.clear()
        container.update(was)


def _leaf_ids(v: Any) -> tuple[int, ...]:
    return tuple(map(id, pytree.tree_leaves(v)))


class _ModuleWrites:
    """The modules' attributes as the call found them, and what one run of the forward kept (NOTE: [What
    a forward keeps on its modules])."""

    def __init__(self, module: nn.Module) -> None:
        self.named = [(path, m, dict(vars(m))) for path, m in module.named_modules()]
        self.hooks = [_hooks_of(m) for _, m, _ in self.named]  # what a run installs goes with it (Hugging Face
        # installs its output recorders at the first call that asks for them, and sets a flag that says so)
        self.held = {  # the containers the modules hold: their leaves, and a copy to undo an addition by
            (i, k): (_leaf_ids(v), copy.copy(v))
            for i, (_, _, found) in enumerate(self.named)
            for k, v in found.items()
            if k not in _MODULE_OWN and _container(v)
        }
        self.buffers = [(dict(m._buffers), set(m._non_persistent_buffers_set)) for _, m, _ in self.named]
        self.index = {path: i for i, (path, _, _) in enumerate(self.named)}
        self.after: list[dict] = []  # each module's attributes after one run (the fake forward)
        self.hooks_after: list[list] = []
        # (module, attribute, how) of the values the forward assigned: how "attribute", or "buffer" (a
        # buffer assigned anew or registered, in another shape than it had: NOTE: [Buffers a forward assigns])
        self.kept: list[tuple[int, str, str]] = []
        self.specs: list[Any] = []  # each kept value's structure
        self.internal: list[tuple[int, str]] = []  # tensors set that the forward did not make

    def observe(self, passed: set[int], buffers: list[tuple[str, torch.Tensor]]) -> list[Any]:
        """After the fake forward: remember what it left, and return the values it kept (raising, naming
        it, where it put tensors into a container the module held). `passed`: the ids of the parameters
        and buffers it was given. A value that holds none of the tensors the forward made (a module's own
        references to its parameters, which nn.LSTM refreshes as they are swapped in) is not kept.
        `buffers`: the buffers it assigned that its program cannot write in place (`_Entry.assigned`)."""

        def made(x: Any) -> bool:
            return isinstance(x, FakeTensor) and id(x) not in passed

        values = []
        self.hooks_after = [_hooks_of(m) for _, m, _ in self.named]
        for i, (path, m, found) in enumerate(self.named):
            now = dict(vars(m))
            self.after.append(now)
            for k, v in now.items():
                if k in _MODULE_OWN:
                    continue
                leaves = pytree.tree_leaves(v) if _container(v) or isinstance(v, torch.Tensor) else ()
                if not any(made(x) for x in leaves):
                    if v is not found.get(k, _ABSENT) and any(isinstance(x, torch.Tensor) for x in leaves):
                        self.internal.append((i, k))  # left as found, as the kept values are
                    continue
                where = f"{type(m).__name__} '{path or '<root>'}'.{k}"
                if v is found.get(k, _ABSENT):
                    if (i, k) in self.held and _leaf_ids(v) != self.held[(i, k)][0]:
                        _undo(v, self.held[(i, k)][1])
                        raise TraceError(
                            f"fbmt.compile: the forward puts tensors into {where}, a {type(v).__name__} the module "
                            "held before the call; a compiled program runs no Python, so it cannot add to it at "
                            f"each call. Assign a new value (`self.{k} = ...`): after each call it holds that "
                            "call's tensors, or return them from the forward"
                        )
                    continue
                if any(not isinstance(x, (torch.Tensor, *objects.PLAIN)) for x in leaves):
                    raise TraceError(
                        f"fbmt.compile: the forward keeps tensors on {where} inside a "
                        f"{type(v).__name__} fbmt cannot rebuild after each call; keep a tensor, or a list, "
                        "tuple or dict of tensors and plain values there, or return it from the forward"
                    )
                self.kept.append((i, k, "attribute"))
                self.specs.append(pytree.tree_structure(v))
                values.append(v)
            for k, v in now.items():  # a size of a symbolic trace kept as a number: the program has no number
                if v is not found.get(k, _ABSENT) and any(
                    isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
                    for x in (pytree.tree_leaves(v) if _container(v) else (v,))
                ):
                    raise TraceError(
                        f"fbmt.compile: the forward keeps a size of its inputs on {type(m).__name__} "
                        f"'{path or '<root>'}'.{k}, which a program for many sizes has no number for"
                    )
        for name, v in buffers:
            owner, _, attr = name.rpartition(".")
            i = self.index[owner]
            persistent = attr not in self.named[i][1]._non_persistent_buffers_set
            self.kept.append((i, attr, "buffer" if persistent else "buffer, not persistent"))
            self.specs.append(pytree.tree_structure(v))
            values.append(v)
        return values

    def reset(self) -> None:
        """Every module's attributes as the call found them, for another run of the forward."""
        self._restore([found for _, _, found in self.named], self.hooks)
        self._restore_buffers()

    def done(self) -> list[tuple[str, str, Any]] | None:
        """After the trace: what one run left, but the kept values (the program's outputs) as found.
        Returns the other values it set, (module path, attribute, value), for a program loaded from the
        compile cache to set again; None where that would not do what the run did (it installed hooks,
        deleted an attribute, or set one to an object the cache cannot keep)."""
        for i, k in (*((i, k) for i, k, how in self.kept if how == "attribute"), *self.internal):
            found = self.named[i][2]
            if k in found:
                self.after[i][k] = found[k]
            else:
                del self.after[i][k]
        self._restore(self.after, self.hooks_after)
        self._restore_buffers()  # the program's outputs, registered after each call
        written, again = [], True
        for (path, _, found), after, hooks, hooks_after in zip(self.named, self.after, self.hooks, self.hooks_after):
            written += [(path, k, v) for k, v in after.items() if found.get(k, _ABSENT) is not v]
            again = again and found.keys() <= after.keys() and all(map(_same_dict, hooks, hooks_after))
        return written if again and all(_plain(v) for _, _, v in written) else None

    def _restore(self, dicts: list[dict], hooks: list[list]) -> None:
        for (_, m, _), want, want_hooks in zip(self.named, dicts, hooks):
            now = vars(m)
            if len(now) != len(want) or any(now.get(k, _ABSENT) is not v for k, v in want.items()):
                for k in [k for k in now if k not in want]:
                    del now[k]
                now.update(want)
            for k, was in zip(_HOOK_DICTS, want_hooks):
                d = now.get(k)
                if d is not None and was is not None and not _same_dict(d, was):
                    d.clear()
                    d.update(was)

    def _restore_buffers(self) -> None:
        """The buffers as found: one the forward registered is an output of the program, not a fake."""
        for (_, m, _), (found, hidden) in zip(self.named, self.buffers):
            if not _same_dict(m._buffers, found):
                m._buffers.clear()
                m._buffers.update(found)
            if m._non_persistent_buffers_set != hidden:
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(hidden)

    def read(self, buffers: list[tuple[str, torch.Tensor]]) -> list[Any] | None:
        """The values this run of the forward kept, or None where it assigned one of them no new value."""
        values = []
        assigned = dict(buffers)
        for (i, k, how), spec in zip(self.kept, self.specs):
            if how == "attribute":
                v = vars(self.named[i][1]).get(k, _ABSENT)
                if v is self.named[i][2].get(k, _ABSENT):
                    return None
            else:
                v = assigned.pop(f"{self.named[i][0]}.{k}".lstrip("."), _ABSENT)
            if v is _ABSENT or pytree.tree_structure(v) != spec:
                return None
            values.append(v)
        return values if not assigned else None

    def kept_at(self) -> list[tuple[str, str, str]]:
        """(module path, attribute, how) of each kept value."""
        return [(self.named[i][0], k, how) for i, k, how in self.kept]

    def paths(self) -> list[str]:
        """The module paths of the kept values."""
        return [path for path, _, _ in self.kept_at()]

    def names(self) -> list[str]:
        return [f"'{path or '<root>'}'.{k}" for path, k, _ in self.kept_at()]


# NOTE: [Objects in a call]
# A call's arguments and results are pytrees (`ModelOutput` is one), but some leaves are objects
# that hold tensors: a Hugging Face cache. An argument object's tensors become inputs of the
# program, and the forward runs on a copy holding fakes (`fbmt.compiler.objects`). A result's leaves are
# then one of: a tensor (an output), an argument object (its state after the forward is a set of
# outputs, `Results.states`; at run time the caller's object is brought to that state and
# returned itself, as eager returns the object it mutated), an object the forward made (its
# tensors are outputs, rebuilt around the traced object), or a plain value (returned as traced).
# A training call drops a cache its forward made, unless called with use_cache=True: every
# layer's keys and values would be outputs with gradients, a zero tensor each in the backward,
# for a cache no training step reads. It returns a `DroppedCache` that raises on any use instead,
# and says so in the program's summary.


class _Results:
    """Which tensors of a traced call are the program's outputs, and their keys (`Results`)."""

    def __init__(
        self,
        leaves: list[Any],
        copies: dict[int, Any],
        kept_at: list[tuple[str, str, str]],
        kept: list[Any],
        *,
        drop_caches: bool,
    ):
        self.plan = Results(n_leaves=len(leaves))
        self.sources: list[tuple[str, int]] = []
        self.keys: list[Any] = []
        argument = {id(c): a for a, c in copies.items()}
        for i, o in enumerate(leaves):
            if isinstance(o, torch.Tensor):
                self.sources.append(("tensor", i))
                self.keys.append(i)
            elif id(o) in argument:
                self.plan.returned[i] = argument[id(o)]
            elif objects.is_object(o) and objects.tensors_in(o):
                if drop_caches and type(o).__name__.endswith("Cache"):
                    self.plan.constants[i] = objects.DroppedCache(type(o).__name__)
                    self.plan.notes.append(
                        f"dropped the {type(o).__name__} the forward built (result leaf {i}): a training call "
                        "keeps it only when called with use_cache=True"
                    )
                    continue
                self.plan.objects[i] = o
                self._sized("object", i, o)
                self.sources.append(("object", i))
                self.keys += [("object", i, j) for j in range(len(objects.tensors_in(o)))]
            elif isinstance(o, torch.SymInt):  # a size of a symbolic trace: the call's own
                self.plan.constants[i] = size = objects.Size(o.node.expr)
                self.plan.sized[("constant", i)] = [((), size)]
            else:
                self.plan.constants[i] = o
        for a, c in copies.items():
            self.plan.states[a] = c
            self._sized("state", a, c)
            self.sources.append(("state", a))
            self.keys += [("state", a, j) for j in range(len(objects.tensors_in(c)))]
        for k, ((path, name, how), v) in enumerate(zip(kept_at, kept)):  # NOTE: [What a forward keeps on its modules]
            flat, spec = pytree.tree_flatten(v)
            tensors = tuple(j for j, x in enumerate(flat) if isinstance(x, torch.Tensor))
            template = [None if j in tensors else x for j, x in enumerate(flat)]
            self.plan.kept.append((path, name, how, spec, template, tensors))
            self.sources.append(("kept", k))
            self.keys += [("kept", k, j) for j in tensors]

    def _sized(self, where: str, i: int, template: Any) -> None:
        """The numbers `template` holds as sizes of a symbolic trace, kept as expressions to evaluate at
        each call (NOTE: [Numbers in an object])."""
        found = objects.sized(template)
        if found:
            self.plan.sized[(where, i)] = found

    def tensors(self, leaves: list[Any], copies: dict[int, Any], kept: list[Any]) -> list[torch.Tensor]:
        """The output tensors of one call of the forward, in the order of `keys`."""
        out: list[torch.Tensor] = []
        for kind, i in self.sources:
            if kind == "kept":
                out += [x for x in pytree.tree_leaves(kept[i]) if isinstance(x, torch.Tensor)]
                continue
            out += [leaves[i]] if kind == "tensor" else objects.tensors_in(leaves[i] if kind == "object" else copies[i])
        if len(out) != len(self.keys):
            raise TraceError(
                f"fbmt.compile: the forward returned {len(out)} tensors where its first run returned "
                f"{len(self.keys)}; a forward must return the same structure each time it runs"
            )
        return out


# NOTE: [Functional already]
# The second trace (functionalization) exists to remove in-place ops and to write mutated inputs
# back. Most joint graphs have none: the forward of a typical model mutates nothing, and autograd
# accumulates gradients out of place. Its only other effect is dropping `detach`, which
# `_canonicalize` does as well. So the second trace runs only where an op of the first graph may
# write to a tensor (its schema says so); elsewhere tracing takes little more than half as long
# (BENCHMARKS.md).
def _mutates(graph: fx.Graph) -> bool:
    """Whether any op of `graph` writes to one of its arguments (its schema says it may)."""
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in graph.nodes
    )


def _refuse_parameter_writes(graph: fx.Graph, names: list[str]) -> None:
    """A forward that writes a parameter in place (`self.weight.clamp_(-c, c)` under no_grad, as weight
    clipping inside a forward is written) would write the program's gathered copy of it, which no one
    reads back into the shards: refused, naming the parameter and the op."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][: len(names)]
    param = dict(zip(placeholders, names))
    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for a, v in zip(n.target._schema.arguments, n.args):
            if a.alias_info is None or not a.alias_info.is_write or not isinstance(v, fx.Node):
                continue
            while v not in param and v.op == "call_function" and getattr(v.target, "is_view", False):
                v = v.args[0]  # a write to a view of it writes it
            if v in param:
                raise TraceError(
                    f"fbmt.compile: the forward writes parameter '{param[v]}' in place ({n.target}); a compiled "
                    "program computes with a gathered copy of each parameter and never writes it back to the "
                    "shards. Compute the changed weight as a value (`w = self.weight.clamp(-c, c)`), or write "
                    "the shards after the optimizer's step (`for p in model.parameters(): p.data.clamp_(-c, c)`, "
                    "for a write element by element)"
                )


# NOTE: [Writes to fresh tensors]
# Most graphs that write at all write only to tensors they have just made: dropout draws its mask into
# `empty_like(x)` (`bernoulli_`, then `div_`), RMSNorm adds its epsilon to its mean in place, T5 and
# BART shift their labels right into `new_zeros` (`shifted[:, 1:] = ids[:, :-1]`, `shifted[:, 0] =
# start`), and autograd writes a slice's gradient into a new tensor. Such a write is its op's
# functional form on the value as it is at that point (`bernoulli.p`, `add.Tensor`), read by whatever
# reads the tensor after it; a write through slices and selects is the functional op on the view,
# scattered back into the whole (`slice_scatter`, `select_scatter`), and one through a permute or a
# transpose (NOTE: [Draws in memory order]) the functional op's value permuted back. That is what functionalization
# makes of it, at the cost of a second trace of the whole graph (as long as the first).
# `_without_writes` makes the rewrite where every write is of this kind, and soundly:
# - the written tensor is the result of an op that returns a tensor of its own (a factory, a product,
#   a mean: no input, no view; or such a write); a write to an input or a buffer is left to
#   functionalization, which writes it back;
# - a view holds the value its tensor had where the view was taken, so each use of a view (a read, a
#   view of it, the write through it) must come before the tensor is written again (a view read after
#   a write sees the write; the rewritten one would not), and nothing reads a write through a view;
# - an in-place op keeps the dtype of the tensor it writes where its functional op would promote
#   (bf16 plus fp32 is fp32): the result is cast back, as functionalization casts it.
# Autograd has already refused a write to a tensor its backward reads as it was (the trace runs
# autograd), and the backward's nodes read each tensor as it is when they run, later in the graph.
_WHOLE_ALIASES = {aten.detach.default, aten.alias.default}  # the tensor itself, under another node
_SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default}


def _inverse_permute(view: fx.Node) -> tuple[Any, tuple]:
    dims = [d % len(view.args[1]) for d in view.args[1]]
    return aten.permute.default, ([dims.index(d) for d in range(len(dims))],)


# views of every element, each with the view that undoes it: the written view, undone, is the whole
_WHOLE_VIEWS: dict[Any, Callable[[fx.Node], tuple[Any, tuple]]] = {
    aten.permute.default: _inverse_permute,
    aten.transpose.int: lambda view: (aten.transpose.int, tuple(view.args[1:3])),
    aten.t.default: lambda view: (aten.t.default, ()),
}
_FUNCTIONAL: dict[Any, Any] = {}
_RELAYOUTS = {"resize_", "resize_as_", "set_"}  # write a tensor's size or storage, not its values
# ops that read their first argument's storage by strides (NOTE: [Strides read after a write])
_BY_STRIDES = {aten.as_strided.default, aten.as_strided_scatter.default, aten._reshape_alias.default}


def _functional(op: torch._ops.OpOverload) -> Any:
    """The functional op of an in-place one that writes its first argument alone and returns it
    (`bernoulli_.float` -> `bernoulli.p`): an overload of the name without its `_` whose arguments
    are the same; None where there is none."""
    if op in _FUNCTIONAL:
        return _FUNCTIONAL[op]
    found, schema = None, op._schema
    args, rets = schema.arguments, schema.returns
    writes_self = (
        bool(args)
        and args[0].alias_info is not None
        and args[0].alias_info.is_write
        and all(a.alias_info is None for a in args[1:])
        and len(rets) == 1
        and rets[0].alias_info is not None
    )
    name = schema.name.split("::")[-1]
    packet = getattr(aten, name[:-1], None) if writes_self and name.endswith("_") else None
    for overload in packet.overloads() if packet is not None else ():
        cand = getattr(packet, overload)._schema
        # a view (`t_` as `t`) or a new size (`resize_`) changes the tensor's layout, which a value does not
        if cand.is_mutable or len(cand.returns) != 1 or cand.returns[0].alias_info is not None:
            continue
        if name in _RELAYOUTS or len(cand.arguments) != len(args):
            continue
        if all(
            (a.name, str(a.type), a.kwarg_only) == (b.name, str(b.type), b.kwarg_only)
            for a, b in zip(args, cand.arguments)
        ):
            found = getattr(packet, overload)
            break
    _FUNCTIONAL[op] = found
    return found


def _own_tensor(t: Any) -> bool:
    """Whether op `t` returns one tensor of its own (no input, no view of one; by its schema), which
    it does not write (`_unsafe_view`'s schema says so, but it views the value it is given)."""
    if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable or t is aten._unsafe_view.default:
        return False
    returns = t._schema.returns
    return len(returns) == 1 and returns[0].alias_info is None and str(returns[0].type) == "Tensor"


def _view(t: Any) -> bool:
    """Whether op `t` returns one view of its first argument and writes none (by its schema; and
    `_unsafe_view`, whose schema says otherwise)."""
    if t is aten._unsafe_view.default:
        return True
    if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable or t in _WHOLE_ALIASES:
        return False
    returns = t._schema.returns
    return len(returns) == 1 and str(returns[0].type) == "Tensor" and returns[0].alias_info is not None


def _reads_only(n: fx.Node) -> bool:
    """Whether `n` reads its arguments without aliasing or writing any (by its op's schema)."""
    t = n.target
    if n.op == "output":
        return True
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable:
        return False
    return t is not aten._unsafe_view.default and all(r.alias_info is None for r in t._schema.returns)


def _without_writes(graph: fx.Graph) -> bool:
    """Rewrite every in-place op of `graph` as its functional op, where all of them write to fresh
    tensors (NOTE: [Writes to fresh tensors]); False, and the graph as it was, where one does not."""
    root: dict[fx.Node, fx.Node] = {}  # a fresh tensor, a write to it or an alias of it -> the fresh tensor
    views: dict[fx.Node, fx.Node] = {}  # a view of a fresh tensor (or of such a view) -> its base
    through: dict[fx.Node, tuple[fx.Node, list[fx.Node]]] = {}  # a write through views -> its tensor, the views
    writes: list[tuple[fx.Node, Any]] = []
    written_at: dict[fx.Node, list[int]] = {}  # a fresh tensor -> the positions of its writes
    position = {n: i for i, n in enumerate(graph.nodes)}

    def fresh(x: Any) -> bool:
        return isinstance(x, fx.Node) and (x in root or (x.op == "call_function" and _own_tensor(x.target)))

    def chain_of(v: fx.Node) -> list[fx.Node]:  # the tensor a view is of, then its views, outermost first
        chain = [v]
        while chain[0] in views:
            chain.insert(0, views[chain[0]])
        return chain

    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if n.target in _BY_STRIDES:  # NOTE: [Strides read after a write]
            return False
        x = n.args[0] if n.args else None
        if n.target in _WHOLE_ALIASES and x in root:
            root[n] = root[x]
        elif (_view(n.target) or n.target in _WHOLE_ALIASES) and (fresh(x) or x in views):
            views[n] = x  # (a view's alias, as autograd saves `detach(t(x))`, is a view of it)
        elif n.target._schema.is_mutable:
            op = _functional(n.target)
            if op is None or not isinstance(x, fx.Node) or "val" not in n.meta:  # (its dtype: below)
                return False
            if x in views and not n.users:  # through views (nothing reads the view after, as written)
                base, *chain = chain_of(x)
                if any(v.target not in _SCATTERS and v.target not in _WHOLE_VIEWS for v in chain):
                    return False
                root[base] = top = root.get(base, base)
                through[n] = top, chain
            elif fresh(x):
                root[n] = root[x] = top = root.get(x, x)
            else:
                return False
            written_at.setdefault(top, []).append(position[n])
            writes.append((n, op))
    if not writes:
        return False
    for member in root:
        for user in member.users:
            if user not in root and user not in views and user not in through and not _reads_only(user):
                return False
    # a view holds its tensor's value where it is taken: each use of it (a read, a view of it, the
    # write through it) must come before the tensor is written again
    for view in views:
        base = chain_of(view)[0]
        after = written_at.get(root.get(base, base))
        if after is None:  # a view of a tensor nothing writes
            continue
        for user in view.users:
            if not (user in views or user in root or user in through or _reads_only(user)):
                return False
            if any(position[view] < w < position[user] for w in after):
                return False
    # in the graph's order, each read of a fresh tensor reads its value at that point
    now: dict[fx.Node, fx.Node] = {}
    written = dict(writes)
    for n in list(graph.nodes):
        for arg in [a for a in n.all_input_nodes if a in root]:
            value = now.get(root[arg], root[arg])
            if value is not arg:
                n.replace_input_with(arg, value)
        if n in written:
            value = _functional_node(graph, n, written[n])
            top, chain = through.get(n, (root.get(n), []))
            for view in reversed(chain):  # written back into each view's base, outermost last
                if view.target in _WHOLE_VIEWS:
                    undo, args = _WHOLE_VIEWS[view.target](view)
                    value = _new_node(graph, n, undo, (value, *args), {})
                    continue
                value = _new_node(graph, n, _SCATTERS[view.target], (view.args[0], value, *view.args[1:]), view.kwargs)
            now[top] = value
    for n, _ in reversed(writes):
        graph.erase_node(n)
    return True


def _functional_node(graph: fx.Graph, n: fx.Node, op: Any) -> fx.Node:
    """In-place op `n` as functional op `op`, before it: the arguments the trace left at their default
    (`bernoulli_`'s p=0.5), which the functional op may not default, given; its result in the dtype
    of the tensor written (an in-place op keeps it, where the functional op would promote: bf16 plus
    fp32 is bf16 in place), as functionalization casts it."""
    given = list(n.args)
    mine = op._schema.arguments
    for i, a in enumerate(n.target._schema.arguments[len(given) :], len(given)):
        if a.kwarg_only or a.name in n.kwargs or not a.has_default_value() or mine[i].has_default_value():
            break
        given.append(a.default_value)
    f = _new_node(graph, n, op, tuple(given), n.kwargs)
    dtype = n.meta["val"].dtype
    if f.meta["val"].dtype != dtype:
        f = _new_node(graph, n, aten._to_copy.default, (f,), {"dtype": dtype, "layout": torch.strided})
    return f


def _new_node(graph: fx.Graph, n: fx.Node, op: Any, args: tuple, kwargs: dict) -> fx.Node:
    """A node of `op` before `n`, tagged as `n` is, with its fake value."""
    with graph.inserting_before(n):
        f = graph.call_function(op, args, kwargs)
    f.meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
    vals = fx.map_arg((f.args, f.kwargs), lambda a: a.meta.get("val"))
    fake = next((v for v in pytree.tree_leaves(vals) if hasattr(v, "fake_mode")), None)
    if fake is not None:
        f.meta["val"] = fake_value(fake.fake_mode, op, *vals)
    return f


def _named_as_make_fx(graph: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of `graph` whose nodes are named in order as make_fx names them (an op's name and a
    count), and where each node went."""
    new, env = fx.Graph(), {}
    for n in graph.nodes:
        if n.op == "output":
            env[n] = new.output(fx.map_arg(n.args[0], env.__getitem__))
        else:
            args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
            name = stamp.base_name(new, n) if n.op == "call_function" else n.name
            env[n] = new.create_node(n.op, n.target, args, kwargs, name=name, type_expr=n.type)
        env[n].meta = dict(n.meta)
    return new, env


def _own_generator(op: Any) -> str:
    return (
        f"the forward draws random numbers from a torch.Generator of its own (`generator=` of {op}, an argument "
        "or an attribute), which a compiled program cannot advance as eager does: its draws would repeat or "
        "differ, silently. Draw from the default generator (the program draws from it as eager does, "
        "torch.manual_seed included), or make the random tensors outside the model and pass them in"
    )


def _lift_constants(graph: fx.Graph, owner: Any, before: int) -> dict[str, torch.Tensor]:
    """Tensors the forward makes from Python values (`torch.tensor([])` in a cache's set-up, the
    scalar of `x[:, 0] = 1.0`) are attributes of the traced module (`_tensor_constant0`); the
    program is a graph alone, so each becomes an input of kind "constant" (placed before the
    tangents, the `before`-th placeholder on), and the Program keeps its value."""
    constants: dict[str, torch.Tensor] = {}
    anchor = [n for n in graph.nodes if n.op == "placeholder"][before - 1] if before else None
    for n in list(graph.nodes):
        if n.op != "get_attr":
            continue
        value = getattr(owner, n.target)
        if isinstance(value, torch.Generator):
            use = next(iter(n.users), None)
            raise TraceError(f"fbmt.compile: {_own_generator(getattr(use, 'target', 'an op'))}")
        if not isinstance(value, torch.Tensor):
            raise TraceError(f"fbmt.compile: the traced forward reads a non-tensor attribute {n.target!r}")
        with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before():
            lifted = graph.placeholder(n.target)
        lifted.meta.update(n.meta)
        n.replace_all_uses_with(lifted)
        graph.erase_node(n)
        constants[n.target] = value.detach()
        anchor = lifted
    return constants


def _default(op: torch._ops.OpOverload, name: str, value: Any) -> bool:
    """Whether `value` is the default of `op`'s argument `name` (an autograd formula passes
    `attn_mask=None` explicitly; a trace of the same call through functionalization leaves it out)."""
    if value is not None and type(value) not in (bool, int, float, str):
        return False
    for a in op._schema.arguments:
        if a.name == name:
            return a.has_default_value() and type(a.default_value) is type(value) and a.default_value == value
    return False


def _canonicalize(program: Program) -> None:
    """Flatten the output, drop no-op detaches and keyword arguments given their default value, stamp
    phases, move buffer updates into the forward."""
    g = program.graph
    out = program.output_node()
    (values,) = out.args
    out.args = (list(pytree.tree_leaves(values, is_leaf=lambda x: x is None)),)
    for n in list(g.nodes):
        if n.op == "call_function" and n.target in (aten.detach.default, aten.alias.default):
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
        elif n.op == "call_function" and n.kwargs and isinstance(n.target, torch._ops.OpOverload):
            n.kwargs = {k: v for k, v in n.kwargs.items() if not _default(n.target, k, v)}
    placeholders = set(program.placeholders())
    # Functionalization writes mutated inputs back with copy_ at the very end; those are forward effects.
    epilogue = [
        n for n in g.nodes if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in placeholders
    ]
    last_fwd = None
    order = {}
    for i, n in enumerate(g.nodes):
        order[n] = i
        if n.op == "call_function" and meta.module(n) is not None and n not in epilogue:
            last_fwd = n
    # a buffer assigned anew is written after the module returned (NOTE: [Buffers a forward assigns]): the
    # value written, made outside every module, is the forward's too
    sources = [n.args[1] for n in epilogue if isinstance(n.args[1], fx.Node) and n.args[1].op != "placeholder"]
    latest = max(sources, key=order.__getitem__, default=None)
    if latest is not None and (last_fwd is None or order[latest] > order[last_fwd]):
        k = last_fwd.next if last_fwd is not None else next(iter(g.nodes))
        while True:
            if k.op == "call_function":
                meta.tag_missing(k, module="")
            if k is latest:
                break
            k = k.next
        last_fwd = latest
    late = _late_outputs(program, order, last_fwd, set(epilogue))
    for n in epilogue:
        (last_fwd or next(iter(g.nodes))).append(n)
        last_fwd = n
        meta.tag(n, module="")
    for n in late:
        (last_fwd or next(iter(g.nodes))).append(n)
        last_fwd = n
        meta.tag_missing(n, module="")
    phase = FWD
    for n in g.nodes:
        if n.op in ("placeholder", "output"):
            continue
        meta.tag(n, phase=phase)
        if n is last_fwd:
            phase = BWD
    g.lint()


def _functional_call(module: nn.Module, tensors: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
    """`torch.func.functional_call`, whose module keeps its own parameters and buffers afterwards also
    where one module is registered at two paths (`nn.ModuleList([layer, layer])`, a layer shared across
    depth): torch puts the originals back name by name, so the second name of a shared slot put back the
    tensor the first had been given, and a fake tensor of the trace was left on the model."""
    slots = [(table, k, v) for m in module.modules() for table in (m._parameters, m._buffers) for k, v in table.items()]
    try:
        return functional_call(module, tensors, args, kwargs)
    finally:
        for table, k, v in slots:
            if k in table and table[k] is not v:
                table[k] = v


def _late_outputs(program: Program, order: dict[fx.Node, int], last_fwd: fx.Node | None, epilogue: set) -> list:
    """The nodes after the forward's last that make one of its outputs (in graph order): functionalization
    takes a view again at the very end from a tensor written in place (`y.detach()[:, :1]` of a `y` that a
    setitem wrote, kept on a module), after the backward; left there, the output would be the backward's."""
    start = order[last_fwd] if last_fwd is not None else -1
    tangents = {n for n, r in zip(program.placeholders(), program.inputs) if r.kind == "tangent"}
    late: set[fx.Node] = set()
    for role, value in zip(program.outputs, program.output_node().args[0]):
        if role.kind != "output" or not isinstance(value, fx.Node) or order[value] <= start:
            continue
        chain, stack = set(), [value]
        while stack:
            n = stack.pop()
            if n in tangents:
                raise TraceError(f"fbmt.compile: the forward's output {role.key} is computed from a gradient")
            if n.op == "placeholder" or order[n] <= start or n in epilogue or n in chain or n in late:
                continue
            chain.add(n)
            stack.extend(n.all_input_nodes)
        late |= chain
    return sorted(late, key=order.__getitem__)


class _TagCarrier(fx.Interpreter):
    """Runs the first trace under functionalization and copies module tags onto the new nodes."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        # without autograd: the first trace's backward is in its graph already, and autograd would take
        # a stamp op's results as needing gradients where the first trace had marked some as not (an
        # attention kernel given one as its mask then refuses it)
        with torch.no_grad():
            return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        graph = get_proxy_mode().tracer.graph
        before = graph._root.prev
        self.node = n
        result = super().run_node(n)
        path = meta.module(n)
        if path is not None:
            k = before.next
            while k is not graph._root:
                meta.tag_missing(k, module=path)
                k = k.next
        return result

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        # NOTE: [Strides read after a write]
        # `as_strided` (and `as_strided_scatter`, `_reshape_alias`) reads its tensor's storage by
        # strides. A tensor written in place keeps the layout it was made with; the functional op that
        # stands for the write lays its result out as it likes (a product is row-major, whatever the
        # tensor it wrote). So `as_strided` reads a copy laid out as eager's tensor was (the first
        # trace's strides), unless the two provably agree; a tensor computed from the written one
        # follows its layout, so every `as_strided` is checked. The rewrite of NOTE: [Writes to fresh
        # tensors] checks nothing: a graph with one is left to this.
        if target in _BY_STRIDES and isinstance(self.node.args[0], fx.Node):
            x, want = args[0], self.node.args[0].meta.get("val")
            if isinstance(want, torch.Tensor) and not all(
                statically_known_true(a == b) for a, b in zip(x.stride(), want.stride(), strict=True)
            ):
                laid = torch.empty_strided(x.shape, want.stride(), dtype=x.dtype, device=x.device)
                args = (laid.copy_(x), *args[1:])
        return super().call_function(target, args, kwargs)


class _Forward(nn.Module):
    """What a kind's trace calls: the block's forward alone, for its own hooks run around each call of
    it in the model's trace, the stamped ones too; its nodes tagged with its path, as the model's
    trace tags them (NOTE: [Stamped blocks])."""

    def __init__(self, block: nn.Module, path: str):
        super().__init__()
        self.block, self.path = block, path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = get_proxy_mode().tracer.graph._root.prev
        out = self.block.forward(*args, **kwargs)
        root = start.graph._root
        k = start.next
        while k is not root:
            meta.tag_missing(k, module=self.path)
            k = k.next
        return out


class _Entry(nn.Module):
    """What `functional_call` runs for a call of the module ("") or of a submodule: the module's parameters
    under `root.`, so that tied names resolve as in the module (NOTE: [Submodules through the program]);
    a buffer the call assigned anew is written into the one it was given (NOTE: [Buffers a forward
    assigns]), before functional_call puts the module's own back."""

    def __init__(self, root: nn.Module, path: str, given: dict[str, torch.Tensor]):
        super().__init__()
        self.root, self.path, self.given = root, path, given
        self.assigned: list[tuple[str, torch.Tensor]] = []  # (name, tensor) of each one not written in place

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.root.get_submodule(self.path)(*args, **kwargs)
        for name, buffer in self.root.named_buffers():
            given = self.given.get(name)
            if buffer is given:
                continue
            if given is not None and _same_meta(buffer, given):
                with torch.no_grad():  # the value, as eager's next call reads it (a loss through it is the call's)
                    given.copy_(buffer)
            elif isinstance(buffer, FakeTensor):  # registered by this run, or in another shape than it had
                self.assigned.append((name, buffer))
        return out


# NOTE: [Buffers a forward assigns]
# A forward that assigns a registered buffer anew (`self.ema = 0.9 * self.ema + 0.1 * x.mean(0)`, where
# an update in place would be `mul_` and `add_`) leaves the module holding the new tensor in eager. In a
# trace, functional_call gives the forward the program's buffer and puts the module's own back after,
# so the assignment was lost: every call computed from the buffer's first value, without an error. The
# call therefore runs under `_Entry`, which writes each buffer assigned anew into the one it was given,
# as an update in place: the program's write of a mutated buffer (NOTE: [Ops whose schema hides a
# mutation]) brings it to the module's buffer after each call, broadcast as DDP's are. A buffer the
# forward registers (a rotary table made at the first call), or assigns in another shape or dtype (the
# table grown for a longer input), is an output of the program instead, registered after each call as
# a kept tensor is set (NOTE: [What a forward keeps on its modules]); the trace leaves the buffers as
# it found them. A block that assigns or registers one is traced as code, not stamped: its stamped
# copies would not.


def _same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    return all(isinstance(x, int) and x == y for x, y in zip(a.shape, b.shape))


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
            meta.tag_missing(k, module=path)
            k = k.next

    @property
    def current(self) -> str | None:
        return self.stack[-1][0] if self.stack else None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The tagger's hooks, and conversions in the forward kept as eager keeps them (NOTE:
        [Conversions in the forward])."""
        pre = nn.modules.module.register_module_forward_pre_hook(self._pre)
        post = nn.modules.module.register_module_forward_hook(self._post)
        convert, tagger = nn.Module._apply, self
        nn.Module._apply = lambda module, fn, recurse=True: tagger._unchanged(module, fn, recurse)
        try:
            yield
        finally:
            nn.Module._apply = convert
            pre.remove()
            post.remove()

    # NOTE: [Conversions in the forward]
    # A forward may convert a module each call: SwitchTransformers' router runs
    # `self.classifier = self.classifier.to(self.dtype)`. Where the module is in that dtype and on that
    # device already, eager's `.to` gives each tensor back as it is and changes nothing. Traced, the
    # module's parameters are fake tensors that `Module._apply` cannot swap in ("Couldn't swap
    # Linear.weight"), so a conversion that changes nothing is skipped, and one that would change a
    # tensor is an error that names the module and the tensor.
    def _unchanged(self, module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        tensors = [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]
        for name, t in tensors:
            if fn(t) is not t:
                raise TraceError(
                    f"fbmt.compile: module '{self.current or '<root>'}' converts a {type(module).__name__}'s "
                    f"{name} in its forward (`.to()`, `.float()`, ...: {tuple(t.shape)} {t.dtype} on {t.device}), "
                    "which the compiled program cannot do to its sharded parameters; convert the model before "
                    "fbmt.compile (its parameters then need no conversion each call), or compute in that dtype "
                    "with a cast of the input"
                )
        return module


# NOTE: [Hooks that return nothing]
# A forward hook on one of the model's modules runs where the module's forward runs: in the trace, once,
# on fake tensors, and never again. What it returns, or changes in place, joins the program, and trains
# as in eager. A hook that returns nothing may instead act by what it keeps: activations it stores, a
# statistic it logs, calls it counts. The program repeats none of that, so the list it fills holds the
# trace's fake tensors and the statistic is never logged again, without an error. Which of the two a
# hook is cannot be told from outside, so a forward or full backward hook (or pre-hook: one that keeps a
# module's inputs, or sets an attribute the forward reads, acts once too) that returned nothing in the
# trace is named in a warning, once, with what to do instead (transformers' DebugUnderflowOverflow too,
# which would watch nothing), unless it set tensors on its module, which the program keeps (NOTE: [What
# a forward keeps on its modules]). Not the hooks of torch, peft and accelerate, nor transformers' own that
# act within the trace: its output recorders (filled into the forward's outputs) and the hook that makes
# the embeddings' output require gradients (changed in place); torch's weight_norm and pruning, which
# recompute a weight in a pre-hook, are left alone as well. Only the hooks registered before the call are
# watched: those a forward registers for itself act within the trace.
_WITHIN_THE_TRACE = (
    "torch.",
    "fbmt.",
    "peft.",
    "accelerate.",
    "transformers.utils.output_capturing",
    "transformers.modeling_utils",
)
_warned_hooks: set[int] = set()


@contextmanager
def _hooks_that_return_nothing(module: nn.Module) -> Iterator[None]:
    """Warn of the user's hooks on `module`'s modules that returned nothing while traced."""
    watched: list[tuple[dict, Any, Callable]] = []
    silent: list[tuple[str, str, Callable]] = []
    for path, m in module.named_modules():
        for kind, hooks in (
            ("forward pre-hook", m._forward_pre_hooks),
            ("forward hook", m._forward_hooks),
            ("full backward pre-hook", m._backward_pre_hooks),
            ("full backward hook", m._backward_hooks),
        ):
            for key, hook in list(hooks.items()):
                owner = f"{getattr(hook, '__module__', None) or ''}."
                if owner.startswith(_WITHIN_THE_TRACE) or id(hook) in _warned_hooks:
                    continue

                def watch(
                    *args: Any, _hook: Callable = hook, _where: tuple = (path, kind), _m: nn.Module = m, **kwargs: Any
                ) -> Any:
                    found = dict(vars(_m))
                    out = _hook(*args, **kwargs)
                    if out is None and not _keeps(_m, found):
                        silent.append((*_where, _hook))
                    return out

                hooks[key] = watch
                watched.append((hooks, key, hook))
    try:
        yield
    finally:
        for hooks, key, hook in watched:
            if key in hooks:
                hooks[key] = hook
    for path, kind, hook in silent:
        if id(hook) not in _warned_hooks:
            _warned_hooks.add(id(hook))
            name = getattr(hook, "__qualname__", type(hook).__name__)
            logs.log.warning(
                "fbmt: module '%s' has a %s, %s, that returned nothing: it ran once, while tracing, on fake "
                "tensors, and the compiled program does not call it. If it changes its tensors in place, that "
                "is in the program; if it keeps values (activations, statistics, counts), they are the trace's. "
                "Return what you need from the forward, or print() it there (NOTE: [Hooks that return nothing])",
                path or "<root>",
                kind,
                name,
            )


def _keeps(m: nn.Module, found: dict) -> bool:
    """Whether a hook set an attribute of its module to tensors: the program keeps them there (NOTE: [What
    a forward keeps on its modules])."""
    return any(
        found.get(k, _ABSENT) is not v and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v))
        for k, v in vars(m).items()
        if k not in _MODULE_OWN and (_container(v) or isinstance(v, torch.Tensor))
    )


def _prints(tagger: _ModuleTagger) -> Any:
    """print() in the forward becomes an op of the program (NOTE in fbmt/compiler/ops/record.py)."""
    return record.prints_traced(lambda: f"'{tagger.current or '<root>'}'")


def _user_frame(exc: BaseException) -> str:
    """`file:line: source` of the innermost frame of the exception in the user's code, or ''."""
    return user_line(traceback.extract_tb(exc.__traceback__))


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


_HINT_PROVIDERS: list[Callable[[nn.Module, str], str | None]] = []


def register_trace_hint(provider: Callable[[nn.Module, str], str | None]) -> None:
    """Add `provider(module, exception kind) -> hint or None` to what a trace error suggests (an
    integration knows its library's settings: fbmt/integrations/transformers.py)."""
    if provider not in _HINT_PROVIDERS:
        _HINT_PROVIDERS.append(provider)


def _outside_tensor_hint(module: nn.Module) -> str:
    """What to do about a tensor the forward read that is neither a parameter, a buffer nor an input
    (the trace gives the program only those): the modules' plain tensor attributes, by name."""
    plain = [
        f"{path}.{name}" if path else name
        for path, m in module.named_modules()
        for name, v in vars(m).items()
        if isinstance(v, torch.Tensor)
    ]
    if plain:
        head, _, leaf = plain[0].rpartition(".")
        return (
            f"the forward reads a tensor that is neither a parameter, a buffer nor an argument, and the program "
            f"can take only those; these modules hold tensors as plain attributes: {', '.join(plain[:4])}. "
            f"Register each as a buffer (`self.register_buffer('{leaf}', tensor, persistent=False)` in "
            f"{head or 'the model'}'s __init__) or pass it as an argument"
        )
    return (
        "the forward reads a tensor that is neither a parameter, a buffer nor an argument (a global's, a "
        "closure's), and the program can take only those; register it as a buffer or pass it as an argument"
    )


def _backward(*args: Any, **kwargs: Any) -> tuple:
    """`torch.autograd.grad`, a failure in it marked as the backward's: no module's forward is running
    then, and the trace's error names the backward instead."""
    try:
        return torch.autograd.grad(*args, **kwargs)
    except Exception as e:
        e.fbmt_in_backward = True
        raise


@contextmanager
def _translate_errors(module: nn.Module) -> Iterator[_ModuleTagger]:
    tagger = _ModuleTagger(module)
    try:
        yield tagger
    except (TraceError, stamp.Refused):
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
        if "convert all Tensors to FakeTensors" in first:  # a real tensor met the traced ones
            hint = _outside_tensor_hint(module)
        if "torch._C.Generator" in first:  # torch 2.11's make_fx fails at it; later ones record it (_lift_constants)
            hint = _own_generator("the op on the line above")
        for provider in _HINT_PROVIDERS:  # what libraries around the compiler know (integrations)
            hint = provider(module, kind) or hint
        at = _user_frame(e)
        backward = where is None and getattr(e, "fbmt_in_backward", False)
        msg = (
            (
                f"fbmt.compile could not trace the backward of {mod} (the gradient formulas autograd runs after "
                "the forward traced)"
                if backward
                else f"fbmt.compile could not trace module '{path}' ({mod})"
            )
            + (f", op {op}" if op is not None else "")
            + f": {kind}: {first}\n"
            + (f"  at {at}\n" if at else "")
            + f"  why: {hint}."
        )
        raise TraceError(msg) from e
