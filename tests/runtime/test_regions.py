"""backend="inductor": compute regions between collectives compiled by Inductor (NOTE: [Regions])."""

from __future__ import annotations

import copy

import pytest
import torch

import fbmt
from fbmt.compiler import meta
from fbmt.compiler.collectives import GATHER, torch_impl
from fbmt.compiler.runtime import regions
from fbmt.compiler.runtime.regions import Region
from tests.models.reference import gpt
from tests.workers import lm_step_matches


def test_inductor_regions_match_eager_and_identical_blocks_share_one_compile():
    torch.manual_seed(0)
    ref = gpt(n_layer=3)
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=3), backend="inductor", checks=True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
        lm_step_matches(model, ref, x, y)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    (exe,) = model.executables()
    regions = [m for gm in (exe.forward, exe.backward) for m in gm.modules() if isinstance(m, Region)]
    assert model.regions.hits > 0, model.regions  # the three identical blocks reuse compiled regions
    assert len(model.regions.compiled) < len(regions)
    # regions of one structure share one GraphModule: each is made (its code generated) once
    assert len({id(r.gm) for r in regions}) == len({r.structure for r in regions}) < len(regions)
    kinds = [n.target for n in exe.forward.graph.nodes if n.op == "call_function"]
    assert torch_impl.all_gather in kinds and torch_impl.wait in kinds  # communication stays outside regions


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        fbmt.compile(gpt(), backend="tvm")


def test_the_cat_guard_takes_materialized_cats_of_shared_reads_only(monkeypatch):
    """NOTE: [Cats of shared reads]: a cat that products read, or two pointwise ops (an FP8 cast's amax
    and its cast), of two expressions that read one buffer, is a ConcatKernel; a cat that one pointwise
    op reads is left to Inductor's own lowering."""
    from torch._inductor import lowering

    real = lowering.lowerings[torch.ops.aten.cat.default]
    left_to_inductor = []

    def inductors(inputs, dim=0):
        left_to_inductor.append(len(inputs))
        return real(inputs, dim)

    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.cat.default, inductors)

    def merged_gradient(g, u, w):  # SwiGLU's gate and up gradients, both from g and u, read by a product
        return torch.cat([g * u.sigmoid(), g * u], 1) @ w

    def cast_for_fp8(g, u):  # the merged gradient of FP8 products: its amax and its cast read it
        c = torch.cat([g * u.sigmoid(), g * u], 1)
        return c.abs().amax(), (c.t() * 2.0).to(torch.float64)

    def rotary(a, b):  # read by one pointwise op
        return torch.cat([a * b, a - b], 1).to(torch.float64)

    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    g, u, w = torch.randn(4, 3), torch.randn(4, 3), torch.randn(6, 5)
    cases = ((merged_gradient, (g, u, w), True), (cast_for_fp8, (g, u), True), (rotary, (g, u), False))
    for fn, args, guarded in cases:
        left_to_inductor.clear()
        gm = make_fx(fn)(*args)
        with regions.cat_guard():
            compiled = compile_fx(gm, list(args))
        out, want = compiled(*args), fn(*args)
        torch.testing.assert_close(tuple(out) if isinstance(out, (list, tuple)) else out, want)
        assert left_to_inductor == ([] if guarded else [2]), (fn.__name__, left_to_inductor)


def test_the_cat_guard_keys_torchs_compile_caches_with_its_tag():
    """Kernels another version of the guard lowered are not loaded from torch's caches as its own."""
    before = torch.compiler.config.cache_key_tag
    with regions.cat_guard():
        assert regions.CAT_GUARD_TAG in torch.compiler.config.cache_key_tag
    assert torch.compiler.config.cache_key_tag == before


def test_the_cat_guard_declines_with_one_warning_outside_the_torch_releases_it_knows(monkeypatch):
    monkeypatch.setattr(regions, "CAT_GUARD_TORCH", ((1, 0), (1, 1)))
    regions._decline.cache_clear()
    with pytest.warns(UserWarning, match="without its cat guard.*tested on torch 1.0 to 1.1"):
        with regions.cat_guard():
            pass
    with regions.cat_guard():  # said once
        pass
    regions._decline.cache_clear()


def test_a_collective_between_an_op_and_its_unpacking_keeps_them_in_one_region():
    """A strategy may issue a collective right after a multi-output op (a layer norm's backward),
    before its outputs are unpacked: the region still takes the op with its unpacking (Inductor's
    regions return flat tensors), and the step matches eager."""
    from fbmt.compiler import ops
    from fbmt.compiler.passes.schedule import collectives, issue_before

    @fbmt.register_strategy("between-an-op-and-its-outputs")
    def between(program: fbmt.Program) -> str:
        g = program.graph
        op = next(n for n in g.nodes if meta.phase(n) == "bwd" and isinstance(n.meta.get("val"), tuple))
        unpack = next(iter(op.users))
        order = ops.node_order(g)
        late = [c for c in collectives(program, "bwd", GATHER) if order[c.start] > order[unpack]]
        issue_before(late[0], unpack)
        return f"a gather between %{op.name} and its outputs"

    torch.manual_seed(0)
    ref = gpt(n_layer=2)
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=2), backend="inductor", checks=True, schedule="between-an-op-and-its-outputs")
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    lm_step_matches(model, ref, x, y)
    assert "a gather between" in model.program.stats("schedule").detail  # the strategy's own line


def test_a_region_of_symbolic_sizes_runs_only_the_layouts_its_guards_admit():
    """NOTE: [Symbolic regions]: one compile serves every size it admits; a layout it does not
    (another stride order, a size of 1, another dtype) compiles anew and still computes right."""
    import torch.fx as fx

    def f(x, n):  # an int input, as a program of symbolic sizes passes a size
        return torch.ops.aten.reshape.default(torch.ops.aten.cos.default(x), [n, -1])

    cache = regions.RegionCache()
    region = Region(fx.symbolic_trace(f), "cos-reshape", cache, dims=[(1,), (0,)])
    compiled = []
    for x in (
        torch.randn(4, 10),
        torch.randn(4, 13),  # another length: the same compile
        torch.randn(13, 4).t(),  # transposed: its guards assume a contiguous row
        torch.randn(4, 1),  # a size of 1: they assume at least 2
        torch.randn(4, 6, dtype=torch.float64),  # none of the three compiles is for float64
        torch.randn(4, 7),
    ):
        torch.testing.assert_close(region(x, 4 * x.shape[1]), x.cos().reshape(4 * x.shape[1], -1))
        compiled.append(cache.misses)
    assert compiled == [1, 1, 2, 3, 4, 4], compiled
    assert len(cache.symbolic["cos-reshape"]) == 4
    assert [s.pinned for s in cache.symbolic["cos-reshape"]] == [False, False, True, False]  # n == 4 at (4, 1)


def test_a_region_of_symbolic_sizes_over_views_at_offsets_compiles_from_their_layouts():
    """A region's input may be a view into a larger tensor (targets sliced from the tokens): its compile of
    symbolic sizes is made from the layout alone (as a worker makes it), with the offset and the row stride
    symbols, and serves other views of other sizes at other offsets."""
    cache = regions.RegionCache()
    region = _cos_region(cache)
    for width, start, stop in ((30, 5, 20), (50, 7, 30), (60, 12, 40), (9, 0, 9)):
        x = torch.randn(3, width)[:, start:stop]
        torch.testing.assert_close(region(x)[0], x.cos())
    assert cache.misses == 2, cache  # the views, then a whole tensor (its row stride is its size)
    view = torch.randn(3, 40)[:, 5:12]
    fn, made = regions.compile_symbolic(regions._describe(region.gm), [regions._spec(view)], [(1,)], False)
    other = torch.randn(3, 70)[:, 9:40]
    assert made.admits((other,)) and not made.admits((torch.randn(3, 9),))
    torch.testing.assert_close(fn(other)[0], other.cos())


def test_a_programs_regions_read_each_call_of_its_tensors_in_its_layout():
    """A call of the same shapes as one before, in another layout (a transposed view), runs the regions
    compiled for its own layout: the program's key, made of shapes, does not tell layouts apart."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False, backend="inductor")
    for x in (torch.randn(3, 4), torch.randn(4, 3).t(), torch.randn(3, 4)):
        torch.testing.assert_close(model(x), ref(x))
    assert len(model.programs) == 1


def _guarding(monkeypatch, guard):
    """Inductor's compile, after `guard(size)` is asked of the first symbolic size of its inputs (as Inductor's
    heuristics ask on CUDA: whether to fuse two reductions by range, an alignment by residue)."""
    from torch._inductor import compile_fx as module

    real = module.compile_fx

    def compile_fx(gm, inputs, *args, **kwargs):
        sizes = [d for x in inputs if isinstance(x, torch.Tensor) for d in x.shape if isinstance(d, torch.SymInt)]
        if sizes:
            guard(sizes[0])
        return real(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(module, "compile_fx", compile_fx)


def _cos_region(cache):
    import torch.fx as fx

    return Region(fx.symbolic_trace(lambda x: (torch.ops.aten.cos.default(x),)), "cos", cache, dims=[(1,)])


def test_a_symbolic_region_compiles_once_for_each_class_of_sizes_inductor_tells_apart(monkeypatch):
    """NOTE: [Symbolic regions]: where Inductor's guards split the sizes by range and by residue (four classes
    here, two on CUDA), each class gets one compile of symbolic sizes, which serves every size in it: no
    class is left to compile per size."""
    _guarding(monkeypatch, lambda n: (bool(n % 2 == 0), bool(n >= 16)))
    cache = regions.RegionCache()
    region = _cos_region(cache)
    for n in (9, 20, 10, 21, 12, 30, 13, 5, 31, 22, 11, 17):
        x = torch.randn(3, n)
        torch.testing.assert_close(region(x)[0], x.cos())
    assert cache.misses == 4, cache
    assert len(cache.symbolic["cos"]) == 4


def test_a_symbolic_region_compiles_with_inductors_size_checks_off_an_exact_one_with_its_defaults(monkeypatch):
    """Inductor's mix-order reduction (RMSNorm's backward, on CUDA) checks the workload's size before it fuses;
    at symbolic sizes each check is a guard, and the two split a stream of lengths into three compiles on
    the GPU. A compile of symbolic sizes skips them (`_for_every_size`); one of exact sizes keeps Inductor's
    own choice."""
    from torch._inductor import compile_fx as module
    from torch._inductor import config

    if not hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        pytest.skip("this Inductor has no mix-order reduction")
    real, seen = module.compile_fx, []

    def compile_fx(gm, inputs, *args, **kwargs):
        seen.append(config.triton.mix_order_reduction_non_strict_mode)
        return real(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(module, "compile_fx", compile_fx)
    region = _cos_region(regions.RegionCache())
    description, x = regions._describe(region.gm), torch.randn(3, 7)
    regions.compile_symbolic(description, [regions._spec(x)], [(1,)], False)
    regions.compile_static(description, [regions._spec(x)], False)
    region(x)  # a compile in this process, not a worker's
    assert seen == [True, False, True]
    assert config.triton.mix_order_reduction_non_strict_mode is False  # as it was


def test_a_symbolic_region_whose_guards_fix_its_size_compiles_the_rest_for_their_sizes(monkeypatch):
    """A compile whose guards make the size one number serves that size alone; after two such, a third compile
    of symbolic sizes would too, so the later sizes compile for their exact sizes (in the workers, where there
    are)."""
    _guarding(monkeypatch, lambda n: bool(n == n.node.hint))
    cache = regions.RegionCache()
    region = _cos_region(cache)
    for n in (9, 20, 9, 10, 20, 11):
        x = torch.randn(3, n)
        torch.testing.assert_close(region(x)[0], x.cos())
    assert cache.misses == 4, cache
    assert [s.pinned for s in cache.symbolic["cos"]] == [True, True]


def test_a_symbolic_region_of_int_inputs_first_met_at_size_one_stays_exact_there():
    """A size of 1 is made a constant: that compile has no symbol at all, holds for 1 alone, and the
    next size compiles one of symbolic sizes that serves the rest."""
    import torch.fx as fx

    def f(n):
        return (torch.ops.aten.arange.default(n, dtype=torch.float32) * 2,)

    cache = regions.RegionCache()
    region = Region(fx.symbolic_trace(f), "arange", cache, dims=[(0,)])
    for n in (1, 5, 9, 1):
        torch.testing.assert_close(region(n)[0], torch.arange(n, dtype=torch.float32) * 2)
    assert cache.misses == 2, cache


def _forward_attention_cuts(model) -> list[str]:
    """The attention ops of the forward outside its regions."""
    from fbmt.compiler import ops

    (exe,) = model.executables()
    return [
        n.name
        for n in exe.forward.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and ops.op_name(n.target) in ops.ATTENTION_FORWARD
    ]


def test_a_block_forward_is_one_region_attention_and_a_norm_before_its_wait_included():
    """A dropout-free attention belongs to the region around it, and the few cheap ops of a norm
    before the wait for a block's parameters join the region after the wait: each block's forward
    is one region, of one kind for every block (the embeddings before the first apart: NOTE: [Regions
    of repeated blocks]), and the step equals eager. The backward unpacks the attention's saved outputs
    one by one (the partition saves elements, not tuples)."""
    torch.manual_seed(0)
    ref = gpt(n_layer=3)
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=3), backend="inductor", remat="block", checks=True)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    lm_step_matches(model, ref, x, y)
    assert _forward_attention_cuts(model) == []
    (exe,) = model.executables()
    fwd = [r for r in exe.forward.modules() if isinstance(r, Region)]
    assert len(fwd) == 5, exe.forward.graph  # the embeddings', one a block, and the head's
    assert len({r.structure for r in fwd[1:4]}) == 1, exe.forward.graph


def test_every_layer_runs_the_regions_of_one_kind(monkeypatch):
    """NOTE: [Regions of repeated blocks]: the first layer's forward is the others' kind (the embeddings
    apart), and the first layers' backwards, which prefetch no earlier layer's weights, are the kind of
    the middle layers' (whose norm-weight gradient, after that prefetch and a later layer's wait, joins
    the layer's region), so the kinds Inductor compiles do not depend on where a layer stands. The
    regions run as traced here (no compile); the last layer, whose backward the turnaround begins, is its
    own kind."""
    from collections import Counter

    from fbmt.models.llama import Llama, LlamaConfig

    monkeypatch.setattr(Region, "_inductor", lambda self, args, symbolic: (self.gm, []))
    layers = 6
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = fbmt.compile(Llama(config), backend="inductor", remat="block", cache_dir=False)
    # tokens enough that every block recomputes: fewer, and the last blocks save their activations instead
    # (NOTE: [Trailing blocks]), regions of another kind
    x = torch.randint(0, 64, (4, 64))
    model(x, labels=x).loss.backward()
    (exe,) = model.executables()
    for gm, alike in ((exe.forward, layers), (exe.backward, layers - 1)):
        kinds = Counter(r.structure for r in gm.modules() if isinstance(r, Region))
        assert max(kinds.values()) == alike, (sorted(kinds.values()), gm.graph)


def test_attention_with_dropout_stays_between_regions():
    """Attention dropout draws random numbers: that attention is never inside a region; without
    dropout it is, and the region computes what the graph does."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    for p, outside in ((0.1, 1), (0.0, 0)):

        def f(q, k, v):
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.cos(), k, v, p, True)  # noqa: B023
            return (out.sin(),)

        gm = regions.split_regions(make_fx(f, tracing_mode="fake")(q, k, v), regions.RegionCache())
        attention = [n for n in gm.graph.nodes if "flash_attention" in str(n.target)]
        assert len(attention) == outside, gm.graph
        assert sum(isinstance(m, Region) for m in gm.modules()) == 1 + outside
        if not p:
            torch.testing.assert_close(gm(q, k, v)[0], f(q, k, v)[0])


def test_a_compile_laid_out_otherwise_is_copied_into_the_traced_strides_only_where_they_place_elements():
    """NOTE: [Outputs in the traced layouts], on a stand-in compile: an output whose elements lie otherwise
    is copied into the traced strides at every call; one that differs only in the stride of a dimension of
    size 1 (which places nothing) is handed over as it is."""
    x = torch.randn(4, 3)
    transposed, column = x.t(), torch.randn(1, 5)  # a (3, 4) of strides (1, 3); a (1, 5) of strides (5, 1)
    compiled = regions._TracedLayouts(lambda: (transposed, column), [(4, 1), (1, 1)])
    for _ in range(2):
        out, same = compiled()
        assert out.stride() == (4, 1) and torch.equal(out, transposed)
        assert same is column
    assert compiled.copied == [0]


@pytest.mark.parametrize("symbolic", [False, True])
def test_a_cat_onto_an_empty_tensor_is_laid_out_as_eager_for_the_view_after_it(symbolic):
    """NOTE: [Cats onto empty tensors]: a cache written by `cat([empty, keys.transpose(1, 2)])` and viewed
    in the same region. Inductor's own compile returns the keys transposed and fails on the `.view`
    ("Cannot view a tensor ..."); the region computes eager's values, at exact sizes and at symbolic ones."""
    import torch.fx as fx

    aten = torch.ops.aten

    def f(k, n):
        empty = aten.new_empty.default(k, [2, 4, 0, 8])
        cached = aten.cat.default([empty, aten.transpose.int(k, 1, 2)], -2)
        return (aten.view.default(aten.mul.Tensor(cached, 2), [2, 4 * n, 8]),)

    cache = regions.RegionCache()
    region = Region(fx.symbolic_trace(f), "cat-onto-empty", cache, dims=[(1,), (0,)] if symbolic else None)
    lengths = (5, 6, 9) if symbolic else (5,)  # a region of exact sizes is called at those alone
    for length in lengths:
        k = torch.randn(2, length, 4, 8)
        (out,) = region(k, length)
        torch.testing.assert_close(out, (k.transpose(1, 2) * 2).reshape(2, 4 * length, 8))
    assert cache.misses == 1, cache


def test_a_region_inductor_fails_to_compile_names_its_blocks_and_what_to_do(monkeypatch):
    """Inductor's own error names an op of a graph the user never wrote: fbmt's names the blocks the
    region's ops come from and backend='eager', and keeps Inductor's error as its cause."""
    import torch._inductor.compile_fx

    def fails(gm, inputs, **kwargs):
        raise ValueError("Cannot view a tensor with shape torch.Size([2, 4, 5, 8])\n\nWhile executing %view_3")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fails)
    model = fbmt.compile(gpt(n_layer=2), backend="inductor", background_compile=False, cache_dir=False)
    with pytest.raises(RuntimeError, match=r"Inductor failed to compile a region of \d+ ops from block") as raised:
        model(torch.randint(0, 64, (2, 8)))
    message = str(raised.value)
    assert "backend='eager'" in message and "(ValueError: Cannot view a tensor" in message, message
    assert "While executing" not in message and isinstance(raised.value.__cause__, ValueError)
