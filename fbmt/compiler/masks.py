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

A program of symbolic sizes keeps every mask: its sizes are symbols, and a mask equal to the causal one
at the traced length (a sliding window wider than it) need not be at another.
Each decision is listed in the program's summary (the `trace` pass line).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # after query, key, value


class CausalMasks(TorchFunctionMode):
    """Within (while make_fx traces): SDPA calls given a mask that is provably causal, or attends
    everywhere, run without it (NOTE: [Causal masks]). `said(decided)` lists each mask's decision."""

    def __init__(self, decided: dict[fx.Node, str]) -> None:
        super().__init__()
        self.decided = decided  # the mask's node -> "causal", "all" or why it is kept; shared by a trace's calls

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention or len(args) < 3:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        kwargs.update(zip(_SDPA_ARGS, args[3:]))
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and not kwargs.get("is_causal", False):
            kind = self._kind(mask, q.shape[-2], k.shape[-2])
            if kind in ("causal", "all"):
                kwargs.update(attn_mask=None, is_causal=kind == "causal")
        return func(q, k, v, **kwargs)

    @staticmethod
    def said(decided: dict[fx.Node, str]) -> list[str]:
        """One line per mask seen: what became of it."""
        out = []
        for node, kind in decided.items():
            if kind == "causal":
                out.append(f"attention mask {node.name} is causal: SDPA runs with is_causal=True")
            elif kind == "all":
                out.append(f"attention mask {node.name} attends everywhere: SDPA runs without it")
            else:
                out.append(f"attention mask {node.name} kept ({kind})")
        return out

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
            self.decided[node] = _decide(node, mode.tracer.root, q_len, kv_len)
        return self.decided[node]


def drop_dead(decided: dict[fx.Node, str]) -> None:
    """Erase from the traced graph the masks its SDPA calls no longer read, and the ops only they read
    (make_fx records every op, used or not)."""
    todo, erased = [n for n, kind in decided.items() if kind in ("causal", "all")], set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op not in ("call_function", "get_attr"):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        erased.add(n)
        todo.extend(inputs)


def _decide(node: fx.Node, root: Any, q_len: Any, kv_len: Any) -> str:
    """ "causal", "all", or why the mask is kept."""
    if not (isinstance(q_len, int) and isinstance(kv_len, int)):
        return "symbolic sizes"
    needed, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op == "placeholder":
            return "it depends on an input of the program"
        if n.op not in ("call_function", "get_attr"):
            return f"it depends on a {n.op} node"
        todo.extend(n.all_input_nodes)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    # real tensors, outside the trace: nothing here is recorded
    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        try:
            value = _evaluate(node, needed, root)
        except Exception as e:  # an op that will not run on the host as traced: keep the mask, as eager has it
            return f"evaluating it failed: {type(e).__name__}"
        return _classify(value, q_len, kv_len)


def _evaluate(node: fx.Node, needed: set[fx.Node], root: Any) -> torch.Tensor:
    """The value of `node`, computing the nodes of `needed` (its ancestors) on real CPU tensors."""
    env: dict[fx.Node, Any] = {}
    for n in node.graph.nodes:  # in graph order: every input before its user
        if n not in needed:
            continue
        if n.op == "get_attr":
            env[n] = getattr(root, n.target).to("cpu")
            continue
        args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        env[n] = n.target(*args, **kwargs)
    return env[node]


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
