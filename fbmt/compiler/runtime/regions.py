"""Compute regions: hand the aten code between collectives to a compiler (Inductor).

NOTE: [Regions]
After partitioning, a forward or backward GraphModule is a sequence of pure aten compute with
collective nodes (starts, waits) and effectful ops (random draws, buffer writes, recording) in
between. `split_regions` cuts it at every node that is not pure aten compute and replaces each
maximal run of pure nodes that does real work (not only views) by one call of a `Region` module. A
region compiles itself on its first call, from its inputs' shapes, strides and dtypes, with
`torch._inductor.compile_fx.compile_fx` (where torch's own FX graph and AOTAutograd caches find it
again in a later run: `_cacheable`), and keeps the result in a cache shared by the whole model,
keyed by the region's structure (ops and how they connect, constants included) and its inputs'
shapes, strides and dtypes. The regions of identical blocks have the same key, so a 32-layer model
compiles one forward and a few backward regions, not 32 of each: compile time does not grow with
depth.

Collectives stay where the schedule pass put them, so communication overlaps the compiled compute
exactly as it overlapped the eager one. The one move made first: a multi-output op's unpacking
(`getitem`) goes right after the op, so a collective a schedule issued between them does not cut the
region there (a region returns flat tensors, not the op's tuple).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fbmt import logs
from fbmt.compiler import ops


class RegionCache:
    """Compiled regions of one model (or more), by structure and input layout; with counts."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, Any] = {}
        self.graphs: dict[str, fx.GraphModule] = {}  # each structure's GraphModule, made once (`_extract`)
        self.hits = self.misses = 0
        self.seconds = 0.0

    def __repr__(self) -> str:
        return f"RegionCache({self.misses} compiled, {self.hits} reused, {self.seconds:.1f}s compiling)"


class Region(nn.Module):
    """A run of pure aten nodes, compiled on first call (see NOTE: [Regions])."""

    def __init__(self, gm: fx.GraphModule, structure: str, cache: RegionCache, varying: bool = False):
        super().__init__()
        self.gm, self.structure, self.cache = gm, structure, cache
        self.varying = varying  # in a program of symbolic sizes: compiled for each layout it meets
        self.fn: Any = None

    def forward(self, *args: Any) -> Any:
        if self.fn is None or self.varying:
            self._compile(args)
        return self.fn(*args)

    def _compile(self, args: tuple) -> None:
        layout = tuple(
            (tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else repr(a) for a in args
        )
        key = (self.structure, layout)
        if self.varying and key in self.cache.compiled:  # a layout met before: no count, no log
            self.fn = self.cache.compiled[key]
            return
        fn = self.cache.compiled.get(key)
        if fn is None:
            from torch._inductor.compile_fx import compile_fx

            started = time.perf_counter()
            with cat_guard(), _cacheable() as fake:
                fn = compile_fx(self.gm, [fake(a) for a in args])
            seconds = time.perf_counter() - started
            self.cache.seconds += seconds
            self.cache.compiled[key] = fn
            self.cache.misses += 1
            logs.log.info(
                "Inductor: a region of %d ops compiled in %.2fs (%d kinds compiled, %d reused, %.1fs in all)",
                sum(n.op == "call_function" for n in self.gm.graph.nodes),
                seconds,
                self.cache.misses,
                self.cache.hits,
                self.cache.seconds,
            )
        else:
            self.cache.hits += 1
        self.fn = fn


def start_compile_workers(device: torch.device) -> None:
    """Start Inductor's pool of compile workers now, in the background, for regions that compile later.

    Inductor compiles a region's kernels in a pool of worker processes, but uses the pool only once it
    has started; until then each kernel compiles in this process, one after another. torch.compile
    starts the pool as soon as a model is first compiled; regions call Inductor directly, so fbmt
    starts it while it traces. Only kernels for CUDA (Triton) use the pool; Inductor itself declines
    where the pool cannot serve (no Triton, compile threads set to 1, TORCH_WARM_POOL=0)."""
    if device.type != "cuda":
        return
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


@contextlib.contextmanager
def _cacheable() -> Iterator[Callable[[Any], Any]]:
    """Where a region compiles: a tracing context whose fake mode has a shape environment, which
    torch's FX graph and AOTAutograd caches need to key a graph (without one they bypass the cache and
    every run compiles every region again), and the region's inputs as fakes of static shapes in
    that mode (given real inputs, the mode would make their sizes symbolic)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    with tracing(TracingContext(mode)):
        yield lambda a: mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a


# The torch releases (major, minor), first and last, whose Inductor the cat guard below was written
# and tested against: it replaces an entry of Inductor's private lowering table and reads its IR
# classes, which change between releases. Outside the range it does nothing, and says so once.
CAT_GUARD_TORCH = ((2, 11), (2, 14))


@functools.cache
def _decline(why: str) -> None:
    """Warn, once per reason, that the cat guard leaves cats to Inductor's own lowering."""
    warnings.warn(
        f"fbmt: backend='inductor' compiles without its cat guard (NOTE: [Cats of shared reads] in "
        f"fbmt/compiler/runtime/regions.py): {why}. The results are the same; the merged products' gradients "
        "may run slower (disable=('merge',) avoids those cats)",
        stacklevel=3,
    )


@contextlib.contextmanager
def cat_guard() -> Iterator[None]:
    """While Inductor compiles a region: a `cat` that is materialized anyway (no pointwise reader)
    of computations that read a common buffer is lowered as a ConcatKernel.

    NOTE: [Cats of shared reads]
    The merge pass concatenates a merged product's output gradients (NOTE: [Merged products]), e.g.
    SwiGLU's gate and up gradients, both computed from one upstream gradient and the saved gate/up
    values. Inductor (2.11) lowers a cat of unrealized pointwise inputs on CUDA as one "pointwise
    cat" kernel that computes every element of the output from its own input's expression, so the
    reads the two expressions share are made twice, under masks: that kernel took twice as long as
    the two-output kernel before the merge (BENCHMARKS.md). As a ConcatKernel, each input is
    computed straight into its slice of the output and the scheduler fuses the two into one kernel
    with two stores. A cat that a pointwise op reads (a rotary embedding's) keeps Inductor's
    choice: inlined into its reader, it is never written at all. Inductor's own lowering is called
    for every other cat, and whenever this check cannot tell (with a warning, once)."""
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    first, last = CAT_GUARD_TORCH
    if not first <= version <= last:
        _decline(
            f"it was tested on torch {first[0]}.{first[1]} to {last[0]}.{last[1]}, and this is torch "
            f"{torch.__version__}"
        )
        yield
        return
    try:
        from torch._inductor import ir, lowering
        from torch._inductor.virtualized import V

        original = lowering.lowerings[torch.ops.aten.cat.default]
    except (ImportError, AttributeError, KeyError) as e:
        _decline(f"Inductor's lowering table is not where it looks ({type(e).__name__}: {e})")
        yield
        return

    def reads(x: Any) -> set[str] | None:
        while True:
            if isinstance(x, (ir.TensorBox, ir.StorageBox)):
                x = x.data
            elif isinstance(x, ir.BaseView):
                x = x.unwrap_view()
            else:
                break
        return set(x.get_read_names()) if isinstance(x, ir.Pointwise) else None

    def cat(inputs: Any, dim: int = 0) -> Any:
        try:
            node = V.current_node
            materialized = node is not None and not any(lowering.is_pointwise_use(u) for u in node.users)
            if (
                materialized
                and isinstance(inputs, (list, tuple))
                and len(inputs) > 1
                and dim >= 0
                and len({x.get_dtype() for x in inputs}) == 1
            ):
                sets = [reads(x) for x in inputs]
                if all(r is not None for r in sets) and any(a & b for i, a in enumerate(sets) for b in sets[i + 1 :]):
                    return ir.TensorBox(ir.ConcatKernel.create(inputs, dim))
        except (AttributeError, TypeError, NotImplementedError) as e:
            _decline(f"it could not read a cat's inputs ({type(e).__name__}: {e})")
        return original(inputs, dim)

    lowering.lowerings[torch.ops.aten.cat.default] = cat
    try:
        yield
    finally:
        lowering.lowerings[torch.ops.aten.cat.default] = original


def _pure(n: fx.Node, current: set[fx.Node]) -> bool:
    if n.target is operator.getitem:
        return n.args[0] in current  # unpacking a multi-output op of the same region
    return ops.pure(n) and isinstance(n.target, torch._ops.OpOverload)


def split_regions(gm: fx.GraphModule, cache: RegionCache) -> fx.GraphModule:
    """`gm` with each run of pure compute replaced by a Region (see NOTE: [Regions])."""
    g = gm.graph
    order = ops.node_order(g)
    for n in list(g.nodes):  # unpacking stays next to its op, in its region, wherever a schedule put a collective
        if isinstance(n.meta.get("val"), (tuple, list)):
            at = n
            for u in sorted((u for u in n.users if u.target is operator.getitem), key=order.__getitem__):
                at.append(u)
                at = u
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    members: set[fx.Node] = set()
    for n in g.nodes:
        if _pure(n, members):
            current.append(n)
            members.add(n)
        elif current:
            runs.append(current)
            current, members = [], set()
    if current:
        runs.append(current)
    runs = [r for r in runs if not all(map(ops.costs_nothing, r))]  # views alone cost nothing eagerly

    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    start_of = {r[0]: r for r in runs}
    inside = {n for r in runs for n in r}
    root = nn.Module()
    for n in g.nodes:
        if n in start_of:
            run = start_of[n]
            ins, outs, sub, structure = _extract(run, cache)
            name = f"region{len(root._modules)}"
            root.add_module(name, Region(sub, structure, cache, varying=any(map(_symbolic, ins))))
            call = out.call_module(name, tuple(env[i] for i in ins))
            for k, o in enumerate(outs):
                env[o] = out.call_function(operator.getitem, (call, k))
                env[o].meta = dict(o.meta)
        elif n in inside:
            continue
        else:
            env[n] = out.node_copy(n, env.__getitem__)
    out.lint()
    return fx.GraphModule(root, out, class_name=type(gm).__name__)


def _symbolic(n: fx.Node) -> bool:
    """Whether a region input's size varies between calls (a program of symbolic sizes)."""
    v = n.meta.get("val")
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride()))


def _extract(run: list[fx.Node], cache: RegionCache) -> tuple[list[fx.Node], list[fx.Node], fx.GraphModule, str]:
    """The run's inputs, outputs, as a standalone GraphModule, and its structural key.

    Runs of one structure (the same region of every layer) share one GraphModule: making one
    generates and compiles its Python code, which would otherwise be most of lowering's time."""
    members = set(run)
    ins: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in members and a not in ins:
                ins.append(a)
    outs = [n for n in run if any(u not in members for u in n.users)]
    local = {a: f"i{k}" for k, a in enumerate(ins)}
    parts = []
    for j, n in enumerate(run):
        local[n] = f"n{j}"
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: local[a])
        parts.append(f"{n.target}{args}")
    parts.append("->" + ",".join(local[o] for o in outs))
    structure = hashlib.sha1("\n".join(parts).encode()).hexdigest()
    gm = cache.graphs.get(structure)
    if gm is None:
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for k, a in enumerate(ins):
            env[a] = sub.placeholder(f"in{k}")
            env[a].meta = dict(a.meta)
        for n in run:
            env[n] = sub.node_copy(n, env.__getitem__)
        sub.output(tuple(env[o] for o in outs))
        gm = cache.graphs[structure] = fx.GraphModule(nn.Module(), sub)
    return ins, outs, gm, structure
