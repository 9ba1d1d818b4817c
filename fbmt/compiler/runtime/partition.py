"""Partition a joint Program into a forward and a backward GraphModule.

The split is by phase (NOTE: [Phases]). The forward graph takes the Program's non-tangent inputs
and returns the user's outputs followed by the *saved* values: every forward node or input that a
backward node reads (of a multi-output op, the elements it unpacks, never the tuple). The backward
graph takes the saved values (one list, see `take`) and the tangents and returns the gradient slots
(shard gradients, input gradients) in the Program's output order. After the passes, what is saved is
exactly what remat and shard chose: block boundaries, random masks and (ZeRO-2) gathered buffers.
Dead pure nodes are dropped; effectful ones (collectives, random ops, buffer updates) are kept.

NOTE: [Lowering the IR]
A Program's collective nodes call the functions of `fbmt.compiler.collectives`, which say what a node
means and do not run. The graphs built here call their kinds' implementations instead (the table's
`implementation`, and `torch_impl.wait`), and
leave out the `release` markers: the generated code drops every value after its last use, so once
a buffer's last reader ran nothing references it and the caching allocator gets it back (`verify`
proved no view of it is read later). So the IR is the same for the simulator, the passes and the
runtime, and only this module knows how it runs. The starts of one bucket (NOTE: [Buckets] in
fbmt/compiler/collectives) become one call of their kind's `bucketed` implementation, and each
member the handle it returns for that member.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fbmt.compiler import collectives as comm
from fbmt.compiler import meta, ops
from fbmt.compiler.collectives import torch_impl
from fbmt.compiler.ops import host_call, record
from fbmt.compiler.program import BWD, FWD, Program, Role
from fbmt.compiler.runtime import unsynced

aten = torch.ops.aten

try:  # a GraphModule that writes its Python code at its first call: backend="inductor" replaces these
    # graphs by their regions (`split_regions` reads the graph only), so their code would be written for
    # nothing, on the way to the first step
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # torch moved it: the same module, its code written at once
    _GraphModule = fx.GraphModule


@dataclass
class Executable:
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    fwd_inputs: list[Role]  # what to feed the forward graph, in order
    n_outputs: int  # the forward graph's first n_outputs results are the user's tensor outputs
    output_keys: list[int]  # leaf index in the user's output of each of those
    diff_outputs: list[int]  # positions (among the n_outputs) that receive a tangent, in tangent order
    grad_roles: list[Role]  # what each backward result is
    grad_slots: list[tuple[int, int]]  # (forward argument index, backward result index) of each gradient
    signature: str  # digest of the collective sequence, compared across ranks before the first run
    # its graphs run Python on the host at every call, which a replayed CUDA graph would not: recording ops
    # (NOTE in fbmt/compiler/ops/record.py) and host calls (NOTE: [Host calls] in fbmt/compiler/host_calls.py)
    on_host: bool
    constants: dict[str, torch.Tensor]  # what to feed the inputs of kind "constant", by name
    updated_buffers: list[str]  # the buffers the forward writes (BatchNorm's running statistics)
    # the CUDA device whose copies to and from host memory must be done when a graph returns (NOTE:
    # [Offload] in passes/shard.py); None: the program copies nothing across, or its host is its device
    host_copies: torch.device | None = None
    # per tangent: the backward reads it only as values (views, then pointwise ops), so an output the
    # caller did not use may be given one zero, expanded (NOTE: [Unused outputs' gradients])
    zero_tangents: list[bool] | None = None
    # with backend="inductor", the RegionCache its regions compile in (a backward reads its generation:
    # NOTE: [A backward across the switch] in runtime/regions.py)
    regions: Any = None

    def run_forward(self, *args: torch.Tensor) -> tuple[list[torch.Tensor], list[Any]]:
        """The user's outputs, and the values saved for the backward."""
        results = self.forward(*args)
        if self.host_copies is not None:  # the host may write the shards next (the optimizer)
            torch.cuda.synchronize(self.host_copies)
        return list(results[: self.n_outputs]), list(results[self.n_outputs :])

    def run_backward(self, saved: list[Any], *tangents: torch.Tensor) -> list[torch.Tensor | None]:
        """The gradients (`grad_roles`); takes the saved values out of `saved` as it goes (`take`)."""
        assert self.backward is not None
        results = list(self.backward(saved, *tangents))
        if self.host_copies is not None:  # autograd reads the host gradients next
            torch.cuda.synchronize(self.host_copies)
        return results


def partition(program: Program, casts_where_read: bool = False) -> Executable:
    """`program` as a forward and a backward GraphModule whose collectives run on torch.distributed;
    `casts_where_read`: a one-rank gather that only casts becomes a cast of each parameter where it is
    read (NOTE: [One rank's gathers], for graphs whose compute Inductor compiles)."""
    g = program.graph
    roles = dict(zip(program.placeholders(), program.inputs))
    tangents = [n for n in program.placeholders() if roles[n].kind == "tangent"]
    out_pairs = list(zip(program.outputs, program.output_values()))
    user_out = [(r, v) for r, v in out_pairs if r.kind == "output"]
    grad_out = [(r, v) for r, v in out_pairs if r.kind != "output"]
    bwd_nodes = [n for n in g.nodes if meta.phase(n) == BWD]
    bwd_set = set(bwd_nodes)
    saved = _saved(bwd_nodes, bwd_set, set(tangents))
    mutated = {n.args[0] for n in g.nodes if n.target is aten.copy_.default and meta.phase(n) == FWD}

    # ---- forward ----
    fg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    fwd_inputs = []
    for n in program.placeholders():
        if roles[n].kind != "tangent":
            env[n] = fg.node_copy(n)
            fwd_inputs.append(roles[n])
    saved_values: dict[Any, fx.Node] = {}
    for n in saved:  # a buffer the forward overwrites must be saved as it was read, not as it ends
        if n in mutated:
            saved_values[n] = fg.call_function(aten.clone.default, (env[n],))
    for n in g.nodes:
        if meta.phase(n) == FWD:
            env[n] = fg.node_copy(n, env.__getitem__)
    for key in saved:  # one element of a multi-output op: unpacked in the forward
        if isinstance(key, tuple):
            op, k = key
            saved_values[key] = fg.call_function(operator.getitem, (env[op], k))
            saved_values[key].meta["val"] = op.meta["val"][k]
    fg.output(
        tuple(
            [env[v] if isinstance(v, fx.Node) else v for _, v in user_out]
            + [saved_values.get(n) or env[n] for n in saved]
        )
    )
    device = _device(program)
    _lower(fg, device, casts_where_read)

    # ---- backward ----
    backward = None
    if program.needs_grad:
        bg = fx.Graph()
        benv: dict[fx.Node, fx.Node] = {}
        box = bg.placeholder("saved")  # one list, emptied as it is read: see `take`
        for i, key in enumerate(saved):
            benv[key] = bg.call_function(take, (box, i))
            op, k = key if isinstance(key, tuple) else (key, None)
            benv[key].meta = dict(op.meta) if k is None else {**op.meta, "val": op.meta["val"][k]}
        for n in tangents:
            benv[n] = bg.node_copy(n)
        for n in bwd_nodes:
            key = _element(n, bwd_set)
            benv[n] = benv[key] if key is not None else bg.node_copy(n, benv.__getitem__)
        bg.output(tuple(benv[v] if isinstance(v, fx.Node) else v for _, v in grad_out))
        _lower(bg, device, casts_where_read)
        backward = _GraphModule(torch.nn.Module(), bg, class_name="FbmtBackward")

    diff_keys = [roles[t].key for t in tangents]
    zero_tangents = [_reads_values_only(benv[t]) for t in tangents] if program.needs_grad else []
    result_of = {r: i for i, (r, _) in enumerate(grad_out)}
    wants = {"shard": "shard_grad", "input": "input_grad"}
    grad_slots = [
        (i, result_of[Role(wants[r.kind], r.key)])
        for i, r in enumerate(fwd_inputs)
        if r.kind in wants and Role(wants[r.kind], r.key) in result_of
    ]
    output_keys = [r.key for r, _ in user_out]
    return Executable(
        forward=_GraphModule(torch.nn.Module(), fg, class_name="FbmtForward"),
        backward=backward,
        fwd_inputs=fwd_inputs,
        n_outputs=len(user_out),
        output_keys=output_keys,
        diff_outputs=[output_keys.index(k) for k in diff_keys],
        zero_tangents=zero_tangents,
        grad_roles=[r for r, _ in grad_out],
        grad_slots=grad_slots,
        signature=program.collective_signature(),
        on_host=record.holds_records(g) or any(n.target is host_call.host_call._opoverload for n in g.nodes),
        constants=program.constants,
        updated_buffers=[roles[n].key for n in program.placeholders() if n in mutated and roles[n].kind == "buffer"],
        host_copies=(
            device if device.type == "cuda" and any(comm.kind_of(n).host for n in program.collectives()) else None
        ),
    )


# Views whose result is a view of any strided input, one of stride 0 included, and ops that read any
# strides: what the backward may do with an expanded zero (NOTE: [Unused outputs' gradients]).
_STRIDE_FREE_VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.expand.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.alias.default,
        aten.detach.default,
    }
)
_READ_ANY_STRIDES = frozenset({aten._to_copy.default, aten.clone.default})


def _reads_values_only(tangent: fx.Node) -> bool:
    """Whether the backward reads this tangent only through views of any strides and then pointwise ops.

    NOTE: [Unused outputs' gradients]
    Autograd gives an output the caller did not differentiate (the logits a Hugging Face model returns
    beside its loss) a gradient of zeros, allocated and filled: 0.5 GiB for a 32k vocabulary at 8k
    tokens, 2 GiB at 128k, at the start of the backward, where the step's memory peaks. Such a tangent
    is given instead as one zero expanded to the output's shape (stride 0), which costs nothing, where
    the backward reads it only as values: views that give a view of any strides (never `as_strided`,
    which would read past the one element) and pointwise ops, which read any strides. Anywhere else
    (a product, an attention's backward, the output itself), and in CUDA graphs (whose inputs are
    copied into fixed buffers), it gets autograd's zeros as before. The same output may get the caller's
    dense gradient in another call, so an Inductor region reading it finds its compile by the inputs'
    layout on every call (`split_regions`' `varying`)."""
    todo = [tangent]
    while todo:
        n = todo.pop()
        for u in n.users:
            target = u.target
            if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
                return False
            if target in _STRIDE_FREE_VIEWS and u.args[0] is n:
                todo.append(u)
            elif not (torch.Tag.pointwise in target.tags or target in _READ_ANY_STRIDES):
                return False
    return True


def _saved(bwd_nodes: list[fx.Node], bwd_set: set[fx.Node], tangents: set[fx.Node]) -> list[Any]:
    """What the backward reads of the forward, in first-read order: nodes, and `(op, k)` for the k-th
    element of a multi-output op the backward unpacks (its elements are saved, never its tuple: a
    compiled region returns flat values, and the elements the backward never reads are not kept)."""
    saved: dict[Any, None] = {}
    for n in bwd_nodes:
        key = _element(n, bwd_set)
        if key is not None:
            saved[key] = None
            continue
        for a in n.all_input_nodes:
            if a not in bwd_set and a not in tangents:
                saved[a] = None
    return list(saved)


def _element(n: fx.Node, bwd_set: set[fx.Node]) -> tuple[fx.Node, int] | None:
    """`(op, k)` where backward node `n` unpacks element k of a forward op's tuple; None otherwise."""
    if n.target is not operator.getitem or not isinstance(n.args[0], fx.Node) or n.args[0] in bwd_set:
        return None
    op = n.args[0]
    return (op, n.args[1]) if op.op != "placeholder" and isinstance(op.meta.get("val"), (tuple, list)) else None


def _device(program: Program) -> torch.device:
    """The device the program computes on: its parameters' (the fakes it was traced with)."""
    fake = program.fake((0,), torch.float32)
    return fake.device if fake is not None else torch.device("cpu")


def take(box: list, i: int) -> Any:
    """Hand over `box[i]` and forget it there.

    The backward graph receives the forward's saved values as one list and takes each out, so the
    list holds no reference and each value is freed at its last use in the backward, as eager
    autograd frees saved tensors (a tuple of arguments would keep them all until the end).
    """
    value, box[i] = box[i], None
    return value


# NOTE: [Ops that need grad mode]
# Both graphs run with autograd off (inside an autograd.Function, and inside autograd's backward),
# and one kernel reads the mode rather than its arguments: oneDNN's LSTM layer on CPU
# (`mkldnn_rnn_layer`) returns no workspace under no_grad even with train=True, and its backward
# then fails on the missing workspace. Such an op runs with autograd on; its inputs require no
# gradient, so nothing is recorded.
def _with_grad_mode(op: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.enable_grad():
            return op(*args, **kwargs)

    run.__name__ = f"{op.overloadpacket.__name__}_with_grad_mode"
    return run


_NEEDS_GRAD_MODE = {aten.mkldnn_rnn_layer.default: _with_grad_mode(aten.mkldnn_rnn_layer.default)}


def _fuse_buckets(g: fx.Graph, device: torch.device) -> None:
    """Each run of one bucket's adjacent starts that agree on what one call needs (`verify` checked
    that a bucket is one such run; this holds without it) becomes one call of the bucket's
    implementation, each member a `getitem` of its handle."""
    runs: list[list[fx.Node]] = []
    for n in g.nodes:
        kind = comm.kind_of(n) if n.op == "call_function" else None
        bucket = meta.bucket(n) if kind is not None and kind.bucketable else None
        if bucket is None:
            continue
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and meta.bucket(last) == bucket
            and last.next is n
            and comm.bucket_key(last) == comm.bucket_key(n)
        ):
            runs[-1].append(n)
        else:
            runs.append([n])
    for members in runs:
        if len(members) < 2:
            continue
        args = [tuple(comm.gather_args(m)) if comm.is_gather(m) else tuple(m.args) for m in members]
        bucketed = comm.kind_of(members[0]).bucketed
        groups = [meta.group(m) for m in members]
        if comm.is_reduction(members[0]) and None not in groups:  # NOTE: [Accumulation without sync]
            bucketed = unsynced.DeferrableBucket(bucketed, groups, on_host=comm.kind_of(members[0]).host)
        kwargs = {"device": device} if comm.kind_of(members[0]).host and comm.is_gather(members[0]) else {}
        with g.inserting_before(members[0]):
            fused = g.call_function(bucketed, (args,), kwargs)
        fused.meta = {k: v for k, v in members[0].meta.items() if k != "val"}
        for i, m in enumerate(members):
            m.target, m.args, m.kwargs = operator.getitem, (fused, i), {}


def _lower(g: fx.Graph, device: torch.device, casts_where_read: bool = False) -> None:
    """Drop dead pure nodes and the `release` markers; collective nodes call their implementations
    (NOTE: [Lowering the IR]), a reducing start through its group's sync switch (NOTE: [Accumulation without
    sync]), a gather of a host kind with the `device` it copies to (NOTE: [Offload] in passes/shard.py),
    and the ops of NOTE: [Ops that need grad mode] run with autograd on; with `casts_where_read`, NOTE:
    [One rank's gathers]."""
    for n in reversed(list(g.nodes)):
        if n.op == "call_function" and (comm.is_release(n) or not n.users and not ops.effectful(n.target)):
            g.erase_node(n)
    if casts_where_read:
        _casts_where_read(g)
    _fuse_buckets(g, device)
    for n in g.nodes:
        kind = comm.kind_of(n) if n.op == "call_function" else None
        if kind is not None:
            reducing = comm.is_reduction(n) and meta.group(n) is not None
            if reducing:
                n.target = unsynced.Deferrable(kind.implementation, meta.group(n), on_host=kind.host)
            else:
                if kind.host:  # a gather from host memory: the device it copies to (its only keyword)
                    n.kwargs = {"device": device}
                n.target = kind.implementation
        elif comm.is_wait(n):
            n.target = torch_impl.wait
        elif n.op == "call_function" and n.target in _NEEDS_GRAD_MODE:
            n.target = _NEEDS_GRAD_MODE[n.target]
        elif n.op == "call_function" and n.target in _VIEWS_OF_TRACED_STRIDES:  # NOTE: [Strides a trace may not know]
            n.target = aten.reshape.default
    g.lint()


# NOTE: [Strides a trace may not know]
# The trace computes each value's strides with torch's fake kernels, and for some ops they are not the
# real kernel's: `softplus_backward(grad, x)` of a transposed `grad` is laid out like `grad` on the CPU
# and the GPU and contiguous on fakes (its meta is a decomposition), and so are `hardtanh_backward`,
# `elu_backward`, `hardswish_backward`, `copysign` and others, in every torch release fbmt runs on. A
# `view` the trace recorded for the strides it knew then failed on the real value (Doge's dynamic mask,
# whose backward views the softplus gradient: "view size is not compatible with input tensor's size and
# stride"). The values are what they are in any layout; only a view needs one. So the graphs that run
# reshape where the trace viewed: the same view where the layout allows it, as the trace assumed, and a
# contiguous copy where it does not, which is the layout the trace gave the view's result.
_VIEWS_OF_TRACED_STRIDES = frozenset({aten.view.default, aten._unsafe_view.default})


# NOTE: [One rank's gathers]
# On one rank a gather with a cast (fp32 shards, bf16 compute) gathers nothing: it is a copy of the whole
# flat shard in the compute dtype, a kernel of its own between regions that writes every weight in bf16
# for the regions to read back. With FP8 products (the pipeline asks for this only then, and only where
# Inductor compiles the compute) the gather returns the shard itself and each parameter's view is cast
# right before its first reader, so the cast lands in the region that reads the parameter and Inductor
# fuses it into what reads it: a weight's FP8 scale and cast read the fp32 weight, with no bf16 copy
# written and read in between, which counts where a step's weights outweigh its activations (a big model
# on few tokens). A bf16 product gains nothing from it (it reads a bf16 copy, which the region writes
# instead), so a bf16 program keeps the gather's copy. The values are the cast's, as Inductor computes a
# cast inside a fused kernel (its `emulate_precision_casts`, off by default, decides whether the bf16
# rounding of an intermediate is kept there). A gather whose parameters leave the graph (a ZeRO-2 forward
# saves them for the backward) or that a bucket holds keeps its copy.


def _casts_where_read(g: fx.Graph) -> None:
    """NOTE: [One rank's gathers], on a lowered graph before its starts call their implementations."""
    order = ops.node_order(g)
    for start in [n for n in g.nodes if comm.is_gather(n)]:
        shard, world, dtype = comm.gather_args(start)
        value = shard.meta.get("val") if isinstance(shard, fx.Node) else None
        waits = list(start.users)
        if (
            world != 1
            or comm.kind_of(start).host
            or meta.bucket(start) is not None
            or not isinstance(value, torch.Tensor)
            or dtype is None
            or dtype == value.dtype
            or len(waits) != 1
            or not comm.is_wait(waits[0])
        ):
            continue
        (buffer,) = waits
        slices = list(buffer.users)
        views = [v for s in slices for v in s.users]
        if not all(s.target is aten.slice.Tensor for s in slices) or not all(
            v.target is aten.view.default and v.users and all(u.op != "output" for u in v.users) for v in views
        ):
            continue
        start.args, start.kwargs = (shard, world, None), {}
        buffer.meta["val"] = value
        for s in slices:
            s.meta["val"] = aten.slice.Tensor(value, *s.args[1:])
        for v in views:
            cast_value = v.meta["val"]
            v.meta["val"] = aten.view.default(v.args[0].meta["val"], *v.args[1:])
            with g.inserting_before(min(v.users, key=order.__getitem__)):
                cast = g.call_function(aten._to_copy.default, (v,), {"dtype": dtype})
            cast.meta = {**v.meta, "val": cast_value}
            v.replace_all_uses_with(cast, delete_user_cb=lambda u, cast=cast: u is not cast)
