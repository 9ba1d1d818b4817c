"""Attention masks that depend on sizes alone, recognised while tracing (NOTE: [Causal masks]).

NOTE: [Causal masks]
Hugging Face's decoders called with `use_cache=False` (what gradient checkpointing and many training
scripts set) build the causal mask as a tensor (`arange`, `le`, `where`, ...) and hand it to
`F.scaled_dot_product_attention` as `attn_mask`; with a mask the attention leaves the flash kernel,
which takes `is_causal=True` only. That mask is a function of sizes: while fbmt traces, each SDPA call
given a mask is checked here, before it is recorded. The mask's node in the graph being traced is
found, and if nothing it derives from is an input of the program (no parameter, buffer, argument or
tangent: only constants and ops on them, the sizes being numbers in a program of fixed shapes), its
subgraph is run on real CPU tensors. Where the value is exactly the causal mask SDPA's `is_causal`
means (key j attended from query i iff j <= i, on every batch and head), the call is made with
`is_causal=True` and no mask; where it attends everywhere, with no mask; otherwise it is kept. The
mask's ops are then dead and are erased (`drop_dead`). So the rewrite is a proof for the shapes traced: a
padding mask (from `attention_mask`, an input), a sliding window narrower than the sequence, or any
other pattern keeps its mask, and the results are eager's either way.

In a program of symbolic sizes the mask reads the inputs' sizes (`sym_size`), and a mask equal to the
causal one at the traced length (a sliding window wider than it) need not be at another. So the proof
is made at the traced sizes, and the mask's subgraph is kept as a `MaskCheck` (a graph of its own whose
inputs are those sizes) in the program's `SymbolicSizes`: a size the program would admit is admitted
only where the check gives the same answer again (a host computation of one mask per new size), and
another size gets a program of its own that keeps the mask. The checks travel with the program into
the compile cache. A stamped kind of block given such a mask as an argument (NOTE: [Stamped blocks])
knows it as the graph of sizes that computes it (`of_sizes`), and the check of a mask it decides
inlines that graph, so it reads the program's sizes as the whole trace's would. Each decision is listed
in the program's summary (the `trace` pass line).

NOTE: [Grouped heads]
A decoder with fewer key/value heads than query heads (grouped-query attention: Llama 3, Mistral, Qwen)
hands SDPA either the key and value as they are, with `enable_gqa=True`, or copies with each head
repeated in turn (`repeat_kv`, `repeat_interleave`): transformers repeats them wherever it passes a mask,
so a causal mask rewritten above would leave the copies, twice the key/value bytes written and read in
the forward and summed back in the backward. So an SDPA call without a mask whose key and value are both
such repeats (`_repeated_heads`: `x.unsqueeze(2)` expanded along the new axis, copied, and viewed with
that axis merged into the heads) reads `x` with `enable_gqa=True` instead: SDPA's grouped heads are
exactly that repeat (query head h reads key head h // R), so the results are the same up to the
order of the backward's sums. Not where the call has a mask or dropout, nor where the grouped call
would run on SDPA's math kernel (which repeats them itself; `_math_kernel` runs it on the fakes to
see), nor where the repeated tensor is written in place after the repeat (its version counter says
so). The repeats are then dead and erased with the dead masks.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # after query, key, value
_GROUPED = "repeated heads"  # a key or value SDPA reads as grouped heads (NOTE: [Grouped heads])


class CausalMasks(TorchFunctionMode):
    """Within (while make_fx traces): SDPA calls given a mask that is provably causal, or attends
    everywhere, run without it (NOTE: [Causal masks]). `said(decided)` lists each mask's decision."""

    _active: list[CausalMasks] = []  # the innermost decides: a kind of block traced within a model's trace

    def __init__(
        self,
        decided: dict[fx.Node, str],
        checks: list[MaskCheck] | None = None,
        known: dict[fx.Node, Any] | None = None,
    ) -> None:
        super().__init__()
        self.decided = decided  # the mask's node -> "causal", "all" or why it is kept; shared by a trace's calls
        self.checks = checks  # a symbolic trace's: each rewritten mask, to prove again at every size it admits
        # nodes of inputs whose value is known, or computed from sizes (a `MaskCheck`; NOTE: [Stamped blocks])
        self.known = known or {}
        self.recent: collections.deque[tuple[torch.Tensor, int]] = collections.deque(maxlen=16)  # ops' first tensors

    def __enter__(self) -> CausalMasks:
        CausalMasks._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        CausalMasks._active.remove(self)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention or len(args) < 3 or CausalMasks._active[-1] is not self:
            # held for `_grouped`: the tensor whose heads a repeat copies (gone where the model rebinds its
            # name), and its version then (one written in place since no longer holds what the copies hold)
            self.recent.extend((a, a._version) for a in args[:1] if isinstance(a, torch.Tensor))
            return func(*args, **kwargs)
        q, k, v = args[:3]
        kwargs.update(zip(_SDPA_ARGS, args[3:]))
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and not kwargs.get("is_causal", False):
            kind = self._kind(mask, q.shape[-2], k.shape[-2])
            if kind in ("causal", "all"):
                kwargs.update(attn_mask=None, is_causal=kind == "causal")
        if kwargs.get("attn_mask") is None and not kwargs.get("enable_gqa", False) and not kwargs.get("dropout_p"):
            k, v = self._grouped(q, k, v, kwargs)
        return func(q, k, v, **kwargs)

    @staticmethod
    def said(decided: dict[fx.Node, str]) -> list[str]:
        """One line per mask seen: what became of it; one for the attentions that read their key and value
        heads once (NOTE: [Grouped heads])."""
        out, grouped = [], sum(kind == _GROUPED for kind in decided.values()) // 2
        for node, kind in decided.items():
            if kind == _GROUPED:
                continue
            if kind == "causal":
                out.append(f"attention mask {node.name} is causal: SDPA runs with is_causal=True")
            elif kind == "all":
                out.append(f"attention mask {node.name} attends everywhere: SDPA runs without it")
            else:
                out.append(f"attention mask {node.name} kept ({kind})")
        if grouped:
            out.append(f"{grouped} attention(s) read their key/value heads once (enable_gqa), not repeated")
        return out

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> tuple[Any, Any]:
        """Key and value as SDPA is to read them: the tensors they repeat the heads of, where both are
        such repeats and SDPA takes grouped heads there on a kernel other than its math (NOTE: [Grouped
        heads]); otherwise `k, v` as they are."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        mode = get_proxy_mode()
        if mode is None or q.dim() != 4:
            return k, v
        found = []
        for t in (k, v):
            slot = get_proxy_slot(t, mode.tracer, None)
            repeat = _repeated_heads(slot.proxy.node) if slot is not None else None
            source = _tensor_of(repeat[0], mode.tracer, self.recent) if repeat is not None else None
            if source is None:
                return k, v
            found.append((slot.proxy.node, source))
        (k_node, k0), (v_node, v0) = found
        if k0.shape[1] != v0.shape[1] or q.shape[1] % k0.shape[1] != 0:
            return k, v
        if _math_kernel(q, k0, v0, kwargs):  # which would repeat the heads itself, slower than the copies read
            return k, v
        self.decided[k_node] = self.decided[v_node] = _GROUPED  # dead now: drop_dead erases the repeats
        kwargs["enable_gqa"] = True
        return k0, v0

    def _kind(self, mask: torch.Tensor, q_len: Any, kv_len: Any) -> str | None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        mode = get_proxy_mode()
        if mode is None:  # the fake probe before the trace: no graph, and the output's shape is the same
            return None
        slot = get_proxy_slot(mask, mode.tracer, None)
        if slot is None:
            return None
        node = slot.proxy.node
        if node not in self.decided:
            symbolic = not (isinstance(q_len, int) and isinstance(kv_len, int))
            if symbolic and self.checks is None:
                self.decided[node] = "symbolic sizes"
            else:
                self.decided[node], check = _decide(node, mode.tracer.root, q_len, kv_len, self.known)
                if symbolic and check is not None:
                    self.checks.append(check)
        return self.decided[node]


def drop_dead(decided: dict[fx.Node, str]) -> None:
    """Erase from the traced graph the masks its SDPA calls no longer read, and the repeats of heads
    (NOTE: [Grouped heads]), with the ops only they read (make_fx records every op, used or not)."""
    todo, erased = [n for n, kind in decided.items() if kind in ("causal", "all", _GROUPED)], set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op not in ("call_function", "get_attr"):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        erased.add(n)
        todo.extend(inputs)


def _repeated_heads(node: fx.Node) -> tuple[fx.Node, int] | None:
    """Where `node` is a tensor of shape (B, H, S, D) whose heads each repeat R times in turn, as
    Hugging Face's `repeat_kv` and `torch.repeat_interleave(x, R, dim=1)` trace (`x.unsqueeze(2)`
    expanded to (B, H, R, S, D), copied, viewed as (B, H * R, S, D)): the node of `x`, and R."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    aten = torch.ops.aten
    if node.op != "call_function" or node.target not in (aten.view.default, aten._unsafe_view.default):
        return None
    clone = node.args[0]
    if not isinstance(clone, fx.Node) or clone.target is not aten.clone.default:
        return None
    if clone.kwargs.get("memory_format", torch.contiguous_format) is not torch.contiguous_format:
        return None
    expand = clone.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not aten.unsqueeze.default:
        return None
    source = unsqueeze.args[0]
    vals = [n.meta.get("val") for n in (source, expand, node)]
    if not all(isinstance(x, torch.Tensor) for x in vals) or unsqueeze.args[1] not in (2, -3):
        return None
    x, wide, out = (x.shape for x in vals)
    if len(x) != 4 or len(out) != 4 or not isinstance(wide[2], int) or not isinstance(x[1], int):
        return None
    # expand widens only the new axis (the others are x's own); the view must merge (H, R) and no other
    same = [known(out[0] == x[0]), out[1] == x[1] * wide[2], known(out[2] == x[2]), known(out[3] == x[3])]
    return (source, wide[2]) if all(same) else None


def _math_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> bool:
    """Whether SDPA would run grouped heads on its math kernel for the sizes, dtypes and device traced
    (a head dimension over 256 on CUDA, fp32 where the device's fused kernels want half precision):
    the grouped call is run on the fake tensors, outside the trace, and the kernel it reaches is seen.
    (torch's `_fused_sdp_choice` answers math for any fake tensor.) True where it cannot be run."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    seen = _Kernels()
    try:
        with disable_proxy_modes_tracing(), torch.no_grad(), seen:
            F.scaled_dot_product_attention(q, k, v, **{**kwargs, "enable_gqa": True})
    except Exception:
        return True
    return not any(name.startswith("_scaled_dot_product_") and "math" not in name for name in seen.names)


class _Kernels(TorchDispatchMode):
    """The aten ops a call reaches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.names.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def _tensor_of(node: fx.Node, tracer: Any, recent: collections.deque) -> torch.Tensor | None:
    """The tensor among `recent` that the trace records as `node`, unwritten since it was read there;
    None where there is none (a write in place after the repeat: the copies hold the old values)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    for t, version in reversed(recent):
        slot = get_proxy_slot(t, tracer, None)
        if slot is not None and slot.proxy.node is node:
            return t if t._version == version else None
    return None


def _decide(
    node: fx.Node, root: Any, q_len: Any, kv_len: Any, known: dict[fx.Node, Any] | None = None
) -> tuple[str, MaskCheck | None]:
    """ "causal", "all", or why the mask is kept; for a mask rewritten at symbolic sizes, its check.
    `known`: nodes whose values are given (a kind of block's inputs that its calls get from constants), or
    computed from sizes (a `MaskCheck` of them: the inputs its calls get from the program's sizes)."""
    known = known or {}
    found = _of_sizes(node, known)
    if isinstance(found, str):
        return found, None
    needed, sizes = found
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    # real tensors, outside the trace: nothing here is recorded
    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        try:
            check = MaskCheck.of(node, needed, sorted(sizes, key=_order(node.graph)), root, q_len, kv_len, known)
            kind = check.kind_at(check.traced_values())
        except Exception as e:  # an op that will not run on the host as traced: keep the mask, as eager has it
            return f"evaluating it failed: {type(e).__name__}", None
    return kind, (check if kind in ("causal", "all") and check.sizes else None)


def _of_sizes(node: fx.Node, known: dict[fx.Node, Any]) -> tuple[set[fx.Node], list[fx.Node]] | str:
    """The nodes `node` is computed from and the size reads among them; or why it is not computed from
    sizes, constants and `known` nodes alone."""
    needed, sizes, todo = set(), [], [node]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        if n in known:
            continue
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt) and _reads_a_size(n):
            sizes.append(n)  # a size of an input: a number of the program's, the mask's input here
            continue
        if n.op == "placeholder":
            return "it depends on an input of the program"
        if n.op not in ("call_function", "get_attr"):
            return f"it depends on a {n.op} node"
        todo.extend(n.all_input_nodes)
    return needed, sizes


def of_sizes(node: fx.Node, root: Any) -> MaskCheck | None:
    """A tensor of a program of symbolic sizes that is computed from the inputs' sizes alone (a mask
    built for the length), as a graph of those sizes (a `MaskCheck` that decides nothing: a kind of
    block given it computes it from the sizes it runs at, NOTE: [Stamped blocks]); None where it
    reads an input's values or cannot be copied to the host. It is not run here: a mask decided from it
    runs it, and keeps the mask where that fails (`_decide`)."""
    found = _of_sizes(node, {})
    if isinstance(found, str) or not found[1]:
        return None
    needed, sizes = found
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        try:
            return MaskCheck.of(node, needed, sorted(sizes, key=_order(node.graph)), root, None, None)
        except Exception:  # a constant it reads that will not copy to the host
            return None


def constant_value(node: fx.Node, root: Any) -> torch.Tensor | None:
    """The value of a node of a fixed-size program that derives from no input (a mask built from sizes),
    computed on the host; None where it reads an input or will not run there."""
    needed, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op not in ("call_function", "get_attr") or isinstance(n.meta.get("val"), torch.SymInt):
            return None
        todo.extend(n.all_input_nodes)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        try:
            with torch.no_grad():
                return MaskCheck.of(node, needed, [], root, 0, 0).graph()
        except Exception:  # an op that will not run on the host as traced
            return None


def _reads_a_size(n: fx.Node) -> bool:
    """A size of a program input (`sym_size`), not arithmetic on sizes, which the check recomputes."""
    return n.target is torch.ops.aten.sym_size.int


def _order(graph: fx.Graph) -> Any:
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


@dataclass
class MaskCheck:
    """An attention mask that depends on sizes alone, as a graph of its own: its inputs are the sizes it
    reads (`sizes`: each one's expression in the program's symbols), its output the mask. A program of
    symbolic sizes keeps one for each mask it rewrote, and admits a size only where the mask is still
    what it was rewritten for there (NOTE: [Causal masks])."""

    graph: fx.GraphModule
    sizes: list[Any]  # the expression of each input of `graph`, in the program's symbols
    q_len: Any  # the attention's query and key lengths, expressions or numbers
    kv_len: Any
    kind: str  # "causal" or "all", what the trace made of it
    name: str  # the mask's node in the trace, as the program's summary names it
    hints: dict[Any, int]  # each symbol's value where the trace ran

    @classmethod
    def of(
        cls,
        node: fx.Node,
        needed: set[fx.Node],
        sizes: list[fx.Node],
        root: Any,
        q_len: Any,
        kv_len: Any,
        known: dict[fx.Node, Any] | None = None,
    ) -> MaskCheck:
        g, env, owner = fx.Graph(), {}, torch.nn.Module()
        known = known or {}
        for n in sizes:
            env[n] = g.placeholder(f"size{len(env)}")
        exprs = [_expr(n.meta["val"]) for n in sizes]
        hints: dict[Any, int] = {}
        inner = {n: c for n, c in known.items() if n in needed and isinstance(c, MaskCheck)}
        reads: dict[fx.Node, list[fx.Node]] = {}  # a known graph of sizes -> its inputs, as placeholders here
        for n, check in inner.items():  # after the sizes read here: every placeholder first
            reads[n] = [g.placeholder(f"size{len(exprs) + k}") for k in range(len(check.sizes))]
            exprs += check.sizes
            hints.update(check.hints)
        for n in node.graph.nodes:  # in graph order: every input before its user
            if n not in needed or n in env:
                continue
            if n in inner:  # a tensor computed from sizes (a mask the model built): its graph, inlined
                env[n] = _inline(g, inner[n].graph, reads[n], owner)
                continue
            if n in known:
                name = f"_known{len(owner._buffers)}"
                owner.register_buffer(name, known[n].detach().to("cpu").clone())
                env[n] = g.get_attr(name)
                continue
            if n.op == "get_attr":
                owner.register_buffer(n.target, getattr(root, n.target).detach().to("cpu").clone())
                env[n] = g.get_attr(n.target)
                continue
            kwargs = {**n.kwargs, "device": torch.device("cpu")} if "device" in n.kwargs else n.kwargs
            env[n] = g.call_function(n.target, fx.map_arg(n.args, env.__getitem__), fx.map_arg(kwargs, env.__getitem__))
        g.output(env[node])
        for x in [*(n.meta["val"] for n in sizes), q_len, kv_len]:
            if isinstance(x, torch.SymInt):
                env_ = x.node.shape_env
                known = getattr(env_, "backed_var_to_val", None) or env_.var_to_val
                hints.update({sym: int(known[sym]) for sym in x.node.expr.free_symbols})
        return cls(fx.GraphModule(owner, g), exprs, _expr(q_len), _expr(kv_len), "", node.name, hints)

    def traced_values(self) -> dict[Any, int]:
        """The sizes the trace ran at (each symbol's hint)."""
        return dict(self.hints)

    def kind_at(self, values: dict[Any, int]) -> str:
        """What the mask is at these values of the program's symbols: "causal", "all", or why neither."""
        ints = [_value(e, values) for e in self.sizes]
        with torch.no_grad():
            mask = self.graph(*ints)
        kind = _classify(mask, _value(self.q_len, values), _value(self.kv_len, values))
        if not self.kind:  # made at the traced sizes: this is what the trace rewrites it for
            self.kind = kind
        return kind

    def holds(self, values: dict[Any, int]) -> bool:
        try:
            return self.kind_at(values) == self.kind
        except Exception:  # a size the mask's ops refuse: not proved, so not admitted
            return False


def _inline(g: fx.Graph, sub: fx.GraphModule, inputs: list[fx.Node], owner: torch.nn.Module) -> fx.Node:
    """Copy `sub`'s nodes into `g`, its placeholders being `inputs` and its buffers moved to `owner`;
    the copy of its output."""
    env: dict[fx.Node, fx.Node] = {}
    placeholders = iter(inputs)
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "get_attr":
            name = f"_inlined{len(owner._buffers)}"
            owner.register_buffer(name, getattr(sub, n.target))
            env[n] = g.get_attr(name)
        elif n.op == "output":
            return fx.map_arg(n.args[0], env.__getitem__)
        else:
            env[n] = g.node_copy(n, env.__getitem__)
    raise AssertionError("a graph without an output")


def _expr(x: Any) -> Any:
    """A size as a sympy expression of the program's symbols, or a number."""
    return x.node.expr if isinstance(x, torch.SymInt) else x


def _value(e: Any, values: dict[Any, int]) -> int:
    return e if isinstance(e, int) else int(e.xreplace(values))


def _classify(value: Any, q_len: int, kv_len: int) -> str:
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() < 2
        or tuple(value.shape[-2:])
        not in (
            (q_len, kv_len),
            (q_len, 1),
            (1, kv_len),
            (1, 1),
        )
    ):
        return "not a mask of the attention's shape"
    if value.dtype == torch.bool:
        attends = value
    elif value.is_floating_point():
        blocked = value <= torch.finfo(value.dtype).min / 2  # -inf, or the dtype's minimum HF uses
        if not bool((blocked | (value == 0)).all()):
            return "additive values other than 0 and -inf"
        attends = ~blocked
    else:
        return f"a mask of dtype {value.dtype}"
    attends = attends.expand(*attends.shape[:-2], q_len, kv_len)
    if bool(attends.all()):
        return "all"
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
    if bool((attends == causal).all()):
        return "causal"
    return "not causal: a padding or window pattern"
