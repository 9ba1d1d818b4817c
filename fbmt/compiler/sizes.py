"""Programs for many input sizes: the dimensions a call's inputs vary in, traced as symbols.

NOTE: [Dynamic sizes]
A language model is called with batches of many lengths; a program per length would compile for
most steps of a real run. So when a call's inputs differ from an existing program's only in the
sizes of some dimensions (the same ranks, dtypes, modes and everything else of the key), fbmt
compiles one more program with exactly those dimensions symbolic (`dynamic=True`, the default), and
every later call that program admits runs it. Every earlier program of the key counts, not only the
first (`CompiledModule._varying`): a batch of another size after many lengths differs from the
first program in its batch, from the symbolic one in both, so its program takes both as symbols.
And the first call in another mode (an evaluation without gradients after training at many lengths)
takes as symbols what varied in the calls of the same arguments in other modes
(`CompiledModule._varied_in_other_modes`): one evaluation program, not one for its first length too.

Tracing runs in a fake mode with a shape environment: the symbolic sizes flow through the model's
code, the gradient formulas and the passes, and the graph computes every size from its inputs' sizes
(`sym_size` nodes), so the layout, the sharding and the schedule are the same for every length.

A symbolic size is at most four times the size it was traced at, up to a power of two (`largest`:
traced at 24, at most 128), and what the passes estimate from sizes (memory, work) they read there
(`ops.hint`). So what they decide by memory holds at every size the program runs: which blocks keep
their activations although their policy recomputes them (NOTE: [Trailing blocks]: a program traced at
24 tokens that kept them held more at 128 than the program of exactly 128 would). The loss's chunk
count is the exception, decided at the traced size (NOTE: [Chunked cross-entropy] says why). A longer
call gets a program of its own, bounded likewise (a dimension an earlier program of the key took as a
symbol at least as that one was: `CompiledModule._bounds`), so a stream of lengths compiles a few
programs (16-128 from a symbolic program traced at 24: one; a stream that grows on, one more for every
fourfold) rather than one, with no length's activations decided at another.

What the program assumed while it was traced is kept by the shape environment as guards: a model's
`if seq_len > 1024:` is `s0 > 1024`, a specialization is `Eq(s0, 16)`, and every symbol is at least 2
(sizes 0 and 1 are traced as constants). Before a call runs a symbolic program, `admits` evaluates
every guard and bound at the call's sizes, checks that the dimensions traced as constants have their traced
size and that dimensions traced as one symbol (input ids and labels of one length) are equal; a call
the program does not admit gets a program of its own, so a guard that fails costs a compile, never
a wrong result; a forward that fails on symbolic sizes (a size used as a dict key) is warned about
once and compiled per shape. With backend="inductor" the compute regions are compiled with the same
sizes symbolic (NOTE: [Symbolic regions]). Not for CUDA graphs (a replay needs the captured shapes).
The compile cache keeps symbolic programs with what they assume (NOTE: [Symbolic programs on disk]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode

from fbmt.logs import user_line


def symbolic_mode() -> FakeTensorMode:
    """A fake mode whose tensors may have symbolic sizes; its shape environment keeps, for each
    symbol the trace fixes to one value, the line of the traced code that did it (`fixed_at`)."""
    return FakeTensorMode(shape_env=_shape_env_noting_fixes()())


@functools.cache
def _shape_env_noting_fixes() -> type:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    class NotingShapeEnv(ShapeEnv):
        """A ShapeEnv that notes where a symbol is replaced by a number (for `SymbolicSizes.fixed`).
        `_set_replacement` is private: on a torch without it, `fixed` names the guard instead."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fbmt_fixed_at: dict[Any, str] = {}

        def _set_replacement(self, a: Any, tgt: Any, *args: Any, **kwargs: Any) -> Any:  # torch's names
            if getattr(tgt, "is_number", False):
                self.fbmt_fixed_at.setdefault(a, _traced_code_line())
            return super()._set_replacement(a, tgt, *args, **kwargs)

    return NotingShapeEnv


def _traced_code_line() -> str:
    """The line of the traced model's code running now."""
    return user_line(traceback.extract_stack())


# NOTE: [Matmul on symbolic sizes]
# torch 2.11's `matmul` kernel (C++, run by `@`, `torch.matmul` and a `F.linear` without the fused
# bias path) reads its inputs' sizes as plain integers, so on a symbolic trace every product fixes
# the length to the one traced and the program holds for one shape (torch 2.13's kernel does not).
# torch's own Python decomposition of matmul computes the same products (mm or bmm over views of
# the inputs) with the sizes symbolic; where this torch's kernel fixes sizes (found by trying it once),
# symbolic traces run matmul and linear through it. `linear` keeps the kernel's addmm for a bias.
# SDPA's math backend (what CUDA falls back to where no fused kernel takes the call: fp32 with grouped
# key/value heads, say) runs that kernel inside C++, so where SDPA would choose it, the attention runs
# as the same ops written here (scaled products, the causal or given mask, softmax that gives zeros
# for a row with nothing to attend, as the kernel's does), with the same float32 accumulation.
# `F.multi_head_attention_forward` (nn.MultiheadAttention, WavLM's attention) is Python that calls
# `linear` and `scaled_dot_product_attention` by torch.nn.functional's global names; a mode is off
# within its own `__torch_function__`, so those calls would reach the kernels: for that call the
# names are bound to the versions here (`_functional_names`).

# NOTE: [Attention at symbolic sizes]
# One program runs every length, so its attention's kernel must suit every length. On CUDA, SDPA
# prefers cuDNN's kernel where it takes the call, and cuDNN builds an execution plan for each shape it
# meets, a forward's and a backward's: a cost per new length far above the kernel's own time, while
# flash's kernel needs no plan (BENCHMARKS.md, "Sequence lengths"). A stream of lengths meets a new one
# on most steps. So a program of symbolic sizes runs flash's kernel wherever flash takes the call, and
# a program of exact sizes keeps SDPA's own choice (one shape: one plan). With dropout the choice
# stays SDPA's too: the kernel's random stream is the one eager draws from. Which kernels can take a call
# is asked through the checks SDPA's kernel itself asks (`torch.backends.cuda.can_use_*`), with the
# fakes as they are: the op that answers the same question (`_fused_sdp_choice`) runs its meta kernel on
# fakes and answers "math" for every one, so a symbolic program's attention once ran as float32 products.
# A mask that takes a gradient (a learned position bias: T5's, the wav2vec2 conformer's) runs as SDPA's math
# as ops there instead, as it did before this route: traced at symbolic sizes on torch 2.11, the fused
# kernel's backward with a bias gradient stopped in torch's own argument parser ("dispatch_on_subclass ...
# INTERNAL ASSERT", outside every module's forward: in the backward, which CUDA runs on a thread of its
# own), and each length then compiled a program of its own.


@functools.lru_cache(None)
def _matmul_fixes_sizes() -> bool:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    x, w = fake_inputs(mode, [torch.empty(2, 3, 4), torch.empty(4, 5)], {0: (1,)})
    try:
        with mode:
            torch.matmul(x, w)
    except RuntimeError:  # "Cannot call numel() on tensor with symbolic sizes/strides"
        return True
    return bool(env.replacements)


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from torch._decomp.decompositions import matmul

    x = input  # F.linear's own names, for a call by keyword
    if bias is not None and x.dim() == 2:
        return torch.addmm(bias, x, weight.t())
    if bias is not None and x.dim() == 3 and x.is_contiguous():
        out = torch.addmm(bias, x.view(-1, x.shape[-1]), weight.t())
        return out.view(*x.shape[:-1], out.shape[-1])
    out = matmul(x, weight.t())
    return out if bias is None else out + bias


def _cuda_kernels_taking(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> set[str]:
    """Which of SDPA's fused CUDA kernels ("cudnn", "flash", "efficient") take this call: the checks SDPA's
    kernel asks, each also whether its kernel is enabled (NOTE: [Attention at symbolic sizes]). A check that
    cannot answer for these fakes (a torch whose check reads a data pointer) counts as a refusal."""
    taking = set()
    # the compiler's question, not the program's: the sizes' comparisons stay out of the graph
    with disable_proxy_modes_tracing():
        params = torch.backends.cuda.SDPAParams(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        for kernel in ("cudnn", "flash", "efficient"):
            try:
                if getattr(torch.backends.cuda, f"can_use_{kernel}_attention")(params):
                    taking.add(kernel)
            except RuntimeError:
                pass
    return taking


def _fused_attention_takes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> bool:
    """Whether SDPA would run one of its fused kernels on these inputs, not its math backend."""
    from torch.nn.attention import SDPBackend

    if query.device.type == "cuda":  # the choice op answers "math" for every fake there
        return bool(_cuda_kernels_taking(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa))
    # the compiler's question, not the program's: recorded, the choice stayed in the graph (unread) and cut
    # the Inductor region around it in two
    with disable_proxy_modes_tracing():
        choice = torch.ops.aten._fused_sdp_choice.default(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    return choice != int(SDPBackend.MATH.value)


def _math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    or_fused: bool = False,
) -> torch.Tensor | None:
    """SDPA's math backend as ops, where SDPA would choose it (`or_fused`: also where a fused kernel would
    take the call); else None (its own kernel runs)."""
    from torch._decomp.decompositions import matmul

    fused = not or_fused and _fused_attention_takes(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )
    if dropout_p > 0 or fused:
        return None  # dropout: the kernel's own random stream
    if attn_mask is not None and is_causal:  # the kernel refuses both; so must this
        return None
    dtype = query.dtype
    if dtype in (torch.float16, torch.bfloat16):  # the kernel accumulates these in float32
        query, key, value = query.float(), key.float(), value.float()
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    root = abs(query.shape[-1] ** -0.5 if scale is None else scale) ** 0.5
    # The products' operands in one layout, whatever their producers gave: the views the products make of
    # them are recorded for the layouts traced, and Inductor, compiling a region that holds the attention,
    # may lay a producer out otherwise (`cat` onto an empty cache: as its other input), where a view fails.
    dense = functools.partial(torch.clone, memory_format=torch.contiguous_format)
    query, key, value = query * (-root if scale is not None and scale < 0 else root), key * root, value
    query, key, value = dense(query), dense(key), dense(value)
    scores = matmul(query, key.transpose(-2, -1))
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.ops.aten._safe_softmax.default(scores, -1)
    return matmul(weights, value).to(dtype)


_KERNEL_LINEAR = torch._C._nn.linear  # what F.linear and F.scaled_dot_product_attention are
_KERNEL_ATTENTION = torch._C._nn.scaled_dot_product_attention


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    math_as_ops: bool,
) -> torch.Tensor:
    """SDPA as a program of symbolic sizes runs it (NOTE: [Attention at symbolic sizes]); with `math_as_ops`,
    its math backend as ops where SDPA would choose it (NOTE: [Matmul on symbolic sizes])."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    learned_bias = query.device.type == "cuda" and attn_mask is not None and attn_mask.requires_grad
    if math_as_ops or learned_bias:
        out = _math_attention(*args, or_fused=learned_bias)
        if out is not None:
            return out
    flash_first = contextlib.nullcontext()
    if query.device.type == "cuda" and dropout_p == 0:
        if "flash" in _cuda_kernels_taking(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
            flash_first = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    with flash_first:
        return _KERNEL_ATTENTION(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def _functional_names(**names: Any) -> Iterator[None]:
    """torch.nn.functional's globals `names` bound to other functions within (NOTE: [Matmul on symbolic
    sizes]: for the Python functions there that call them by those names). A trace holds the process's
    compile lock, and the functions bound compute what the kernels compute."""
    saved = {name: F.__dict__[name] for name in names}
    F.__dict__.update(names)
    try:
        yield
    finally:
        F.__dict__.update(saved)


class _SymbolicKernels(TorchFunctionMode):
    """SDPA as a program of symbolic sizes runs it (NOTE: [Attention at symbolic sizes]); where this torch's
    matmul fixes sizes, matmul and linear through torch's Python decomposition and SDPA's math backend as ops
    (NOTE: [Matmul on symbolic sizes])."""

    def __init__(self, matmul: bool | None = None) -> None:
        super().__init__()
        self.matmul = _matmul_fixes_sizes() if matmul is None else matmul  # tests ask for either route
        self.attention = functools.partial(_attention, math_as_ops=self.matmul)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._decomp.decompositions import matmul

        kwargs = kwargs or {}
        if func is _KERNEL_ATTENTION:
            return self.attention(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            names = {"scaled_dot_product_attention": self.attention, **({"linear": _linear} if self.matmul else {})}
            with _functional_names(**names):
                return func(*args, **kwargs)
        if not self.matmul:
            return func(*args, **kwargs)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and not kwargs:
            return matmul(*args)
        if func is torch.Tensor.__rmatmul__ and not kwargs:
            return matmul(args[1], args[0])
        if func is _KERNEL_LINEAR:
            return _linear(*args, **kwargs)
        return func(*args, **kwargs)


def symbolic_kernels(tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager:
    """Within: the kernels of a program of symbolic sizes over `tensors`, on every torch fbmt supports: products
    that keep the sizes symbolic, and an attention kernel for every length."""
    if not _matmul_fixes_sizes() and all(t.device.type != "cuda" for t in tensors):
        return contextlib.nullcontext()  # nothing to route, and a mode costs every call of the trace
    return _SymbolicKernels()


def largest(traced: int) -> int:
    """The largest size a program of symbolic sizes admits in a dimension it was traced at `traced` in:
    four times that, up to a power of two (NOTE: [Dynamic sizes])."""
    return 1 << (4 * traced - 1).bit_length()


# NOTE: [Numbers in an object]
# An argument object may count in a Python int what it holds: a Hugging Face cache layer that keeps a
# sliding window counts its tokens (`cumulative_length`), and its forward computes the mask's offset from
# the count. Traced as a constant, each step of generate() was a program. So where two calls differ in
# such ints (and otherwise in shapes alone), or where an integration says the next call passes them larger
# (`CompiledModule._growing`), the program takes each as the size of an input of its own, after the call's
# tensors: a byte tensor of that many elements (`number_input`), which no kernel reads. The trace puts that
# size, a symbol, where the object's copy held the int, so the forward computes with it as with any size:
# a branch on it is a guard, checked at every call (`SymbolicSizes.admits`), and the symbol is bounded as a
# length is (NOTE: [Dynamic sizes]). What the forward leaves in the object (the count plus the new tokens)
# is kept as an expression in the symbols (`objects.Size`) and evaluated at each call from its inputs'
# sizes, so the caller's object holds the int eager's would. `Program.numbers` names each number by its
# argument and path; programs are found for a call by its key without those numbers. A number of 0 or 1 is
# a constant, as a size of 0 or 1 is; one the trace fixes makes a program for that value alone.


def number_input(n: int | None, device: torch.device) -> torch.Tensor:
    """The input that gives a program a number an argument object holds, as its size (NOTE: [Numbers in
    an object]): one byte seen `n` times (a number may be large: a count of every token seen), which no
    kernel reads."""
    if n is None or n < 0:
        raise ValueError(f"fbmt: a number a program takes as a size must be an int of at least 0, not {n!r}")
    return torch.empty(1, dtype=torch.uint8, device=device).expand(n)


def fake_inputs(
    mode: FakeTensorMode,
    inputs: list[torch.Tensor],
    dims: dict[int, tuple[int, ...]],
    at_most: dict[tuple[int, int], int] | None = None,
) -> list:
    """Fakes of `inputs` in `mode`, dimension d of input i symbolic where `dims[i]` holds d, each symbol
    at most `largest` of its traced size, or `at_most[i, d]` where that is larger (NOTE: [Dynamic sizes])."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    out = []
    for i, x in enumerate(inputs):
        varying = dims.get(i, ())
        kinds = [DimDynamic.DYNAMIC if d in varying else DimDynamic.STATIC for d in range(x.dim())]
        fake = mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=kinds))
        for d, (n, size) in enumerate(zip(x.shape, fake.shape)):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                most = max(largest(n), (at_most or {}).get((i, d), 0))
                mode.shape_env.constrain_symbol_range(size.node.expr, compiler_min=2, compiler_max=most)
        out.append(fake)
    return out


@dataclass
class SymbolicSizes:
    """Which input dimensions of a program are symbolic, and what the program assumes of them."""

    traced: list[tuple[int, ...]]  # every input's shape at the call it was traced for
    symbols: dict[tuple[int, int], Any]  # (input, dimension) -> its sympy symbol
    shape_env: Any  # the trace's ShapeEnv: its guards grow while the passes run, and are read here
    # (input, dimension) -> the symbol of its stride, for a view whose strides vary with the sizes
    # (`tokens[:, :-1]`); the guards may name them (a view is not contiguous: `Ne(s1, s0)`)
    strides: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    # attention masks the trace made SDPA's is_causal (or dropped) at the traced sizes: a size is admitted only
    # where each is still that (fbmt.compiler.masks.MaskCheck; NOTE: [Causal masks])
    masks: list[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, fakes: list[torch.Tensor], inputs: list[torch.Tensor]) -> SymbolicSizes | None:
        """The symbols of `fakes` as they were made, before tracing (a guard may later replace one
        by another or by a number; the guards name the symbols as made). None: no symbol at all
        (a size 0 or 1 is made a constant)."""
        symbols, strides, env = {}, {}, None
        for i, f in enumerate(fakes):
            for d, s in enumerate(f.shape):
                if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                    symbols[(i, d)] = s.node.expr
                    env = s.node.shape_env
            for d, s in enumerate(f.stride()):
                if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol and s.node.expr not in symbols.values():
                    strides[(i, d)] = s.node.expr
        if not symbols:
            return None
        return cls([tuple(x.shape) for x in inputs], symbols, env, strides)

    def guards(self) -> list[Any]:
        """What the program assumes of its symbols, as sympy expressions (a program loaded from the
        compile cache: the saved ones too, NOTE: [Symbolic programs on disk])."""
        return getattr(self.shape_env, "fbmt_saved_guards", []) + [g.expr for g in self.shape_env.guards]

    def values(self, inputs: list[torch.Tensor]) -> dict[Any, int]:
        """Each symbol's value at a call with these inputs (one the program admits)."""
        out = {sym: inputs[i].shape[d] for (i, d), sym in self.symbols.items()}
        out.update({sym: inputs[i].stride(d) for (i, d), sym in self.strides.items()})
        return out

    def admits(self, inputs: list[torch.Tensor]) -> str | None:
        """None if this program computes the call with these inputs; else why not."""
        if len(inputs) != len(self.traced):
            return f"{len(inputs)} input tensors where the program takes {len(self.traced)}"
        values: dict[Any, int] = {}
        for i, (x, shape) in enumerate(zip(inputs, self.traced)):
            if x.dim() != len(shape):
                return f"input {i} has {x.dim()} dimensions where the program's has {len(shape)}"
            for d, (n, traced) in enumerate(zip(x.shape, shape)):
                sym = self.symbols.get((i, d))
                if sym is None:
                    if n != traced:
                        return f"input {i} dimension {d} is {n}, and the program was traced at {traced} there"
                elif values.setdefault(sym, n) != n:  # one symbol for two dimensions: equal when traced
                    return f"input {i} dimension {d} is {n}, and the program assumes it equals {values[sym]}"
        for (i, d), sym in self.strides.items():
            if values.setdefault(sym, inputs[i].stride(d)) != inputs[i].stride(d):
                return f"input {i}'s stride {d} is {inputs[i].stride(d)}, and the program assumes {values[sym]}"
        for sym, n in values.items():
            lower, upper = self.shape_env.var_to_range[sym].lower, self.shape_env.var_to_range[sym].upper
            if not (bool(lower <= n) and bool(n <= upper)):
                return f"the program assumes {sym} in [{lower}, {upper}], and it is {n}"
        for expr in self.guards():
            try:
                holds = bool(expr.xreplace(values))
            except TypeError:  # it names a symbol no input gives a value for
                return f"the program assumes {expr}, which these sizes cannot decide"
            if not holds:
                return f"the program assumes {expr}"
        for check in getattr(self, "masks", ()):  # a program saved before masks were checked has none
            if not check.holds(values):
                return f"its attention mask {check.name} is {check.kind} at the traced sizes, and not at these"
        return None

    def fixed(self) -> str | None:
        """None while some symbol may still take more than one value; else each symbol's one value
        and where the trace fixed it (a forward, or a kernel's shape rule, that read the size as a
        number): such a program is one for one shape."""
        values = []
        first = {}
        for dim, sym in self.symbols.items():
            first.setdefault(sym, dim)
        for sym, (i, d) in first.items():
            span = self.shape_env.var_to_range.get(sym)
            if span is None or span.lower != span.upper:
                return None
            where = getattr(self.shape_env, "fbmt_fixed_at", {}).get(sym) or next(
                (
                    str(g.sloc).strip("() ")
                    for g in self.shape_env.guards
                    if sym in g.expr.free_symbols and hasattr(g, "sloc")
                ),
                "",
            )
            values.append(f"input {i} dimension {d} made {span.lower}" + (f" at {where}" if where else ""))
        return "; ".join(values)

    def __str__(self) -> str:
        dims = ", ".join(
            f"input {i} dim {d} = {e} (traced at {self.traced[i][d]}, at most {self.shape_env.var_to_range[e].upper})"
            for (i, d), e in self.symbols.items()
        )
        assumed = ", ".join(str(g) for g in self.guards())
        return f"symbolic sizes: {dims}" + (f"; assumes {assumed}" if assumed else "")
