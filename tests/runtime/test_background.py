"""Regions compiled in worker processes while the steps run them as traced (NOTE: [Compiles in the
background])."""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import operator
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils
import torch._inductor.compile_fx

import fbmt
from fbmt.compiler import pipeline
from fbmt.compiler.runtime import background, regions
from fbmt.compiler.runtime.regions import Region
from tests.models.reference import gpt
from tests.workers import gradients_match, lm_step_matches


def _traced(description, specs, grad):
    """`compile_static` stood in for: its result runs the region's graph as it is."""
    return regions._rebuild(description).forward


def _loaded_exp(cache: regions.RegionCache) -> Region:
    """A region of one op whose program's cache entry holds Inductor's artifacts: the loader alone
    compiles it (`send=False`)."""
    return Region(torch.fx.symbolic_trace(lambda x: (torch.ops.aten.exp.default(x),)), "exp", cache, send=False)


def _regions(model) -> list[Region]:
    (exe,) = model.executables()
    return [m for gm in (exe.forward, exe.backward) for m in gm.modules() if isinstance(m, Region)]


def gpt_twin():
    torch.manual_seed(0)
    return gpt(n_layer=1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """Inductor's cache folder, shared by this file's tests that compile for real: a later one finds
    the regions compiled (what they check holds either way) and takes seconds, not half a minute."""
    return str(tmp_path_factory.mktemp("inductor"))


def test_steps_run_the_traced_ops_until_the_workers_compiles_are_taken_in(tmp_path, monkeypatch, inductor_cache):
    """The first step runs every region as traced while one worker compiles them; once they are in,
    this process finds each in torch's caches (a hit, not a compile of its own) and the next step
    runs them compiled; both steps and the SGD step between match eager PyTorch."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)  # this process does not compile: the worker does
    workers = background.Workers(1, threads=1)
    try:
        torch.manual_seed(0)
        ref = gpt(n_layer=1)
        torch.manual_seed(0)
        compiled = dict(backend="inductor", background_compile=False, checks=True, cache_dir=tmp_path / "fbmt")
        model = fbmt.compile(gpt(n_layer=1), **compiled)
        model.regions.workers = lambda: workers  # a pool of its own, started after the cache folder was set
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

        hits = counters["inductor"]["fxgraph_cache_hit"]  # read first: the loader thread may take them in at once
        lm_step_matches(model, ref, *_batch(0))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        cache, kinds = model.regions, {r.structure for r in _regions(model)}
        assert cache.misses == 0 and cache.sent == len(cache.pending) == len(kinds), cache
        assert all(r.eager for r in _regions(model)) and cache.eager_runs >= len(_regions(model))

        model.wait_compiled()
        assert not cache.pending and cache.misses == len(kinds), cache
        assert counters["inductor"]["fxgraph_cache_hit"] - hits == len(kinds)  # what the worker compiled
        ran_traced = cache.eager_runs
        lm_step_matches(model, ref, *_batch(1))
        assert cache.eager_runs == ran_traced and not any(r.eager for r in _regions(model))

        # a second run: its program comes from the compile cache, its regions from torch's, loaded here
        # by a thread of this process (no worker) while the first step runs them as traced
        torch.manual_seed(0)
        again = fbmt.compile(gpt(n_layer=1), **compiled)
        again.regions.workers = lambda: workers
        twin = gpt_twin()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        lm_step_matches(again, twin, *_batch(0))
        assert again.program.origin.startswith("loaded") and again.regions.sent == 0, again.regions
        assert again.regions.misses == 0 and all(r.eager for r in _regions(again)), again.regions
        again.wait_compiled()
        assert again.regions.misses == len(kinds) and counters["inductor"]["fxgraph_cache_hit"] - hits == len(kinds)
        lm_step_matches(again, twin, *_batch(1))
        assert not any(r.eager for r in _regions(again))
    finally:
        workers.close()


class CachesItsKeys(torch.nn.Module):
    """Attention that writes its keys and values to a cache as Hugging Face's DynamicCache does in a
    training forward (`cat` onto an empty tensor) and returns the keys, as HF returns the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, s, 3, 4, 8).unbind(2))
        empty = k.new_empty(b, 4, 0, 8)
        k, v = torch.cat([empty, k], -2), torch.cat([empty, v], -2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, 32)), k


@contextlib.contextmanager
def _caches_its_keys_on_one_worker(monkeypatch, inductor_cache):
    """`CachesItsKeys` and its compile with Inductor, whose regions compile in one worker of its own, started
    after Inductor's cache folder was set."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    workers = background.Workers(1, threads=1)
    try:
        torch.manual_seed(0)
        ref = CachesItsKeys()
        model = fbmt.compile(copy.deepcopy(ref), backend="inductor", background_compile=False, cache_dir=False)
        model.regions.workers = lambda: workers
        yield ref, model
    finally:
        workers.close()


def test_compiled_regions_give_their_outputs_the_traced_layouts(monkeypatch, inductor_cache):
    """NOTE: [Outputs in the traced layouts]: Inductor returns `cat([empty, k])` laid out as `k`, where
    eager and the trace made it contiguous. The model's output keeps eager's layout, and the backward's
    region, first met while the forward ran as traced, needs no second compile once the forward runs
    compiled (before, it did, and the steps until it came in ran the backward as traced)."""
    with _caches_its_keys_on_one_worker(monkeypatch, inductor_cache) as (ref, model):
        x = torch.randn(2, 6, 32)
        for step in range(2):  # traced, then compiled
            (y, k), (ref_y, ref_k) = model(x), ref(x)
            assert k.stride() == ref_k.stride(), (step, k.stride(), ref_k.stride())
            torch.testing.assert_close(k, ref_k)
            (y.square().sum() + k.sum()).backward()
            (ref_y.square().sum() + ref_k.sum()).backward()
            gradients_match(model, ref, rtol=1e-4, atol=1e-5)
            model.zero_grad(), ref.zero_grad()
            model.wait_compiled()
        assert model.regions.sent == len({r.structure for r in _regions(model)}), model.regions


@pytest.mark.parametrize("routed", [False, True])
def test_symbolic_regions_give_their_outputs_the_traced_layouts_at_every_length(inductor_cache, monkeypatch, routed):
    """NOTE: [Outputs in the traced layouts] in a program of symbolic sizes: the model's cached keys came
    out transposed at every length after the second (strides (224, 8, 32, 1) where eager's are (224, 56, 8,
    1)), so a `.view` of them failed where eager's worked; they have eager's strides at each length now.
    `routed`: the attention as the ops torch 2.11 traces it with (NOTE: [Matmul on symbolic sizes]), in
    the region of the `cat` whose layout Inductor chooses: the products' views of the keys failed there."""
    from fbmt.compiler import sizes

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    if routed:
        monkeypatch.setattr(sizes, "_matmul_fixes_sizes", lambda: True)
    torch.manual_seed(0)
    ref = CachesItsKeys()
    model = fbmt.compile(copy.deepcopy(ref), backend="inductor", background_compile=False, cache_dir=False)
    for length in (6, 7, 9):  # the second length makes the program symbolic, the third reuses it
        x = torch.randn(2, length, 32)
        (y, k), (ref_y, ref_k) = model(x), ref(x)
        assert k.stride() == ref_k.stride(), (length, k.stride(), ref_k.stride())
        torch.testing.assert_close(k.view(2, -1), ref_k.view(2, -1))
        (y.square().sum() + k.sum()).backward()
        (ref_y.square().sum() + ref_k.sum()).backward()
        gradients_match(model, ref, rtol=1e-4, atol=1e-5)
        model.zero_grad(), ref.zero_grad()
    assert len(model.programs) == 2, list(model.programs)  # length 6, then one of symbolic sizes


def test_a_symbolic_programs_regions_compile_in_the_workers_while_its_steps_run_traced(monkeypatch, inductor_cache):
    """NOTE: [Compiles in the background] for regions of symbolic sizes (NOTE: [Symbolic regions]): the
    length that makes the program symbolic runs its regions as traced while a worker compiles each kind
    once (before, the step waited for the compiles), a length that comes while they compile runs traced
    too, and once they are in this process finds each in torch's caches (a hit, not a compile of its
    own); every step equals eager, and those compiles serve the later lengths."""
    from torch._dynamo.utils import counters

    with _caches_its_keys_on_one_worker(monkeypatch, inductor_cache) as (ref, model):
        cache = model.regions

        def step(length: int) -> None:
            x = torch.randn(2, length, 32)
            (y, k), (ref_y, ref_k) = model(x), ref(x)
            torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-5)
            (y.square().sum() + k.sum()).backward()
            (ref_y.square().sum() + ref_k.sum()).backward()
            gradients_match(model, ref, rtol=1e-4, atol=1e-5)
            model.zero_grad(), ref.zero_grad()

        step(6)  # the program of exact sizes
        model.wait_compiled()
        compiled, hits = cache.misses, counters["inductor"]["fxgraph_cache_hit"]
        step(7)  # the program of symbolic sizes: its regions go to the worker
        sent = [key for key in cache.pending if isinstance(key, regions._SymbolicKey)]
        assert sent and not any(cache.symbolic.values()), cache
        ran_traced = cache.eager_runs
        step(9)  # while they compile
        assert cache.eager_runs > ran_traced and cache.misses == compiled, cache

        model.wait_compiled()
        made = [s for kind in cache.symbolic.values() for s in kind]
        assert len(made) == len(sent) and cache.misses == compiled + len(sent), cache
        assert counters["inductor"]["fxgraph_cache_hit"] - hits == len(sent)  # what the worker compiled
        ran_traced = cache.eager_runs
        for length in (11, 9, 14):
            step(length)
        assert cache.eager_runs == ran_traced and cache.misses == compiled + len(sent), cache
        assert len(model.programs) == 2, list(model.programs)


def test_micro_batches_accumulated_across_the_switch_to_compiled_regions(monkeypatch, inductor_cache):
    """Regions switch from traced to compiled where a call begins, so under gradient accumulation one
    backward may read what a traced forward saved and another what a compiled forward saved (NOTE:
    [Compiles in the background]). Two forwards, the first traced and the second compiled, then one
    backward of both: the losses and the summed gradients match eager PyTorch."""
    import torch.nn.functional as F

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    workers = background.Workers(1, threads=1)
    try:
        torch.manual_seed(0)
        ref = gpt(n_layer=1)
        torch.manual_seed(0)
        model = fbmt.compile(gpt(n_layer=1), backend="inductor", background_compile=False, cache_dir=False)
        model.regions.workers = lambda: workers
        cache = model.regions
        lm_step_matches(model, ref, *_batch(0))  # every region met, and sent to the worker
        model.zero_grad(), ref.zero_grad()
        batches = [_batch(1), _batch(2)]

        taken_in = cache.poll
        monkeypatch.setattr(cache, "poll", lambda wait=False: 0)  # the first micro-batch runs as traced
        traced = model(batches[0][0])
        assert all(r.eager for r in _regions(model))
        monkeypatch.setattr(cache, "poll", taken_in)
        model.wait_compiled()
        compiled = model(batches[1][0])
        forward_regions = [m for m in model.executables()[0].forward.modules() if isinstance(m, Region)]
        assert forward_regions and not any(r.eager for r in forward_regions)

        def loss(outs, targets):
            return sum(F.cross_entropy(o.flatten(0, 1), y.flatten()) for o, (_, y) in zip(outs, targets))

        got = loss([traced, compiled], batches)
        want = loss([ref(x) for x, _ in batches], batches)
        got.backward(), want.backward()
        assert not any(r.eager for r in _regions(model))  # both backwards ran the compiled regions
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        grads = model.full_gradients()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        workers.close()


class _Answered:
    """Workers that answer every job at once: the loader then makes each compile here."""

    count = 1

    def submit(self, function, *args):
        job = background.Job(function, args)
        job._finish(0.0, None)
        return job


def _strict(description, specs, grad):
    """`compile_static` stood in for by a compile that holds to the layouts it was made for, as
    Inductor's code does, and lays its outputs out otherwise than the traced ops (a storage offset of
    one), as Inductor may."""
    gm = regions._rebuild(description)
    made = [(s.stride, s.offset) if isinstance(s, regions._TensorSpec) else None for s in specs]

    def moved(t):  # the same strides, one element further on
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or 0 in t.stride():
            return t
        extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return torch.empty(extent + 1, dtype=t.dtype).as_strided(t.shape, t.stride(), 1).copy_(t)

    def fn(*args):
        for a, want in zip(args, made):
            if want is not None and (a.stride(), a.storage_offset()) != want:
                raise AssertionError(
                    f"a region compiled for (strides, offset) {want} is given {a.stride(), a.storage_offset()}"
                )
        return tuple(moved(o) for o in gm(*args))

    return fn


def test_backwards_in_order_across_the_switch_each_find_their_own_layouts(monkeypatch):
    """A compiled forward may lay its outputs out otherwise than the traced one, and a region keeps the
    compile it found for a step's layouts. Two forwards across the switch, then their backwards in the
    order of the forwards (as a pipeline schedule runs them): the older forward's backward is given the
    compile of its own layouts, and the newer one's is not handed it (NOTE: [A backward across the
    switch]); the losses and the summed gradients match eager PyTorch."""
    import torch.nn.functional as F

    monkeypatch.setattr(regions, "compile_static", _strict)
    torch.manual_seed(0)
    ref = gpt(n_layer=1)
    torch.manual_seed(0)
    model = fbmt.compile(gpt(n_layer=1), backend="inductor", background_compile=False, cache_dir=False)
    cache = model.regions
    cache.workers = lambda: _Answered()
    lm_step_matches(model, ref, *_batch(0))  # every region met, and sent
    model.zero_grad(), ref.zero_grad()
    (x1, y1), (x2, y2) = _batch(1), _batch(2)

    taken_in = cache.poll
    monkeypatch.setattr(cache, "poll", lambda wait=False: 0)  # the first micro-batch runs as traced
    traced = model(x1)
    monkeypatch.setattr(cache, "poll", taken_in)
    model.wait_compiled()
    compiled = model(x2)
    assert cache.generation >= 1 and any(not r.eager for r in _regions(model))

    for out, want, y in ((traced, ref(x1), y1), (compiled, ref(x2), y2)):  # backwards in the forwards' order
        loss, ref_loss = (
            F.cross_entropy(out.flatten(0, 1), y.flatten()),
            F.cross_entropy(want.flatten(0, 1), y.flatten()),
        )
        loss.backward(), ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_compile_the_workers_could_not_make_is_made_here_with_a_warning(monkeypatch, caplog):
    """A worker that stopped fails its jobs: the region keeps running as traced until the step's
    start takes the compile in, which then compiles here, saying why."""
    made = []

    def compile_here(description, specs, grad):  # Inductor's compile, stood in for: its result runs the graph
        made.append(len(description))
        return _traced(description, specs, grad)

    monkeypatch.setattr(regions, "compile_static", compile_here)
    workers = background.Workers(1, threads=1)
    workers.close()  # stopped before its first job
    cache = regions.RegionCache(lambda: workers)

    def f(x):
        return (torch.ops.aten.mul.Tensor(torch.ops.aten.cos.default(x), 2),)

    region = Region(torch.fx.symbolic_trace(f), "cos-mul", cache)
    x = torch.randn(5)
    torch.testing.assert_close(region(x)[0], x.cos() * 2)
    assert region.eager and cache.sent == 1  # the loader may have made it already, from the failed job
    with caplog.at_level(logging.WARNING, logger="fbmt"):
        assert cache.poll(wait=True) == 1
    assert "compile worker failed" in caplog.text and "stopped" in caplog.text, caplog.text
    torch.testing.assert_close(region(x)[0], x.cos() * 2)
    assert not region.eager and made == [4] and cache.misses == 1


def test_waiting_for_a_worker_that_does_not_answer_ends_and_compiles_here(monkeypatch, caplog):
    """`wait_compiled` on a stuck worker (a job that never finishes) gives up after the cache's limit
    and compiles the region here, saying so; it does not wait forever."""
    monkeypatch.setattr(regions, "compile_static", _traced)
    workers = background.Workers(1, threads=1)
    try:
        workers.submit(("time", "sleep"), 60)  # the one worker is busy for a minute
        cache = regions.RegionCache(lambda: workers)
        cache.wait_limit = 0.5

        def f(x):
            return (torch.ops.aten.sin.default(x),)

        region = Region(torch.fx.symbolic_trace(f), "sin", cache)
        x = torch.randn(3)
        region(x)
        with caplog.at_level(logging.WARNING, logger="fbmt"):
            assert cache.poll(wait=True) == 1
        assert "has not answered" in caplog.text, caplog.text
        torch.testing.assert_close(region(x)[0], x.sin())
        assert not region.eager and cache.misses == 1
    finally:
        workers.close()


def test_a_graph_that_cannot_cross_to_a_worker_compiles_here():
    """A region whose ops are not all aten overloads or arithmetic on sizes (a Python function of its own)
    is not sent; one that computes a size with `operator` (as a program of symbolic sizes does) is."""
    cache = regions.RegionCache(lambda: background.Workers(0, threads=1))

    def twice(t):
        return t * 2

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(twice, (g.call_function(torch.ops.aten.cos.default, (x,)),)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert regions._describe(gm) is None
    assert not cache.send(Region(gm, "cos-twice", cache), ("k",), (torch.randn(2),))
    assert cache.sent == 0

    def sized(x, n):
        return (torch.ops.aten.view.default(torch.ops.aten.cos.default(x), [n * 2]),)  # `*`: operator.mul

    description = regions._describe(torch.fx.symbolic_trace(sized))
    assert description is not None and any(target is operator.mul for _, _, target, _ in description)
    assert regions._rebuild(description).code == torch.fx.symbolic_trace(sized).code


AS_A_WORKER = """
import torch
from fbmt.compiler.runtime import regions
def grouped(a, b, offs):
    return (torch.ops.aten._grouped_mm.default(a, b, offs),)
args = torch.randn(6, 8), torch.randn(2, 8, 4), torch.tensor([2, 6], dtype=torch.int32)
gm = torch.fx.symbolic_trace(grouped)
fn = regions.compile_static(regions._describe(gm), [regions._spec(a) for a in args], False)
torch.testing.assert_close(fn(*args)[0], grouped(*args)[0])
print("compiled")
"""


def test_a_worker_compiles_a_region_whose_op_has_fbmts_fake_kernel(tmp_path):
    """A worker traces nothing, so fbmt's fake kernels (`ops.fake_kernels`: `_grouped_mm` in float32, a
    triangular solve at symbolic sizes) were missing from its torch: its compile of such a region failed,
    and the loader compiled it again. A fresh interpreter compiles one as a worker does."""
    root = str(Path(fbmt.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", AS_A_WORKER], env=env, capture_output=True, text=True, timeout=300, cwd=root
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_a_graph_whose_arguments_do_not_pickle_compiles_here(monkeypatch):
    """An argument another process cannot receive fails the sending, not a worker's thread: the
    region compiles here at once."""
    made = []
    monkeypatch.setattr(regions, "compile_static", lambda *args: made.append(args) or (lambda x: (x.cos(),)))
    monkeypatch.setattr(regions, "_describe", lambda gm: [("call_function", "f", lambda: 0, ((), {}))])
    workers = background.Workers(0, threads=1)
    cache = regions.RegionCache(lambda: workers)
    region = Region(torch.fx.symbolic_trace(lambda x: (torch.ops.aten.cos.default(x),)), "cos", cache)
    x = torch.randn(3)
    torch.testing.assert_close(region(x)[0], x.cos())
    assert cache.sent == 0 and not cache.pending and not region.eager and len(made) == 1


def test_a_loaded_programs_regions_load_in_a_thread_that_starts_after_the_step(monkeypatch):
    """A region whose program's cache entry holds Inductor's artifacts (`send=False`) is loaded here by
    the loader thread, with no worker; the thread starts where the next step begins, not within the
    step that met the region (its Python would slow that step's traced ops)."""
    monkeypatch.setattr(regions, "compile_static", _traced)
    cache = regions.RegionCache(lambda: pytest.fail("no worker is needed"))
    region = _loaded_exp(cache)
    x = torch.randn(4)
    torch.testing.assert_close(region(x)[0], x.exp())
    assert region.eager and len(cache.pending) == 1 and cache._loader is None
    cache.poll()  # the next step begins: the loader starts (and may have made it already)
    cache.poll(wait=True)
    assert not cache.pending and cache.misses == 1 and cache.sent == 0
    torch.testing.assert_close(region(x)[0], x.exp())
    assert not region.eager and cache.misses == 1


@pytest.mark.parametrize("symbolic", [False, True])
def test_a_compile_that_fails_in_the_loader_raises_where_a_step_begins(monkeypatch, symbolic):
    """Inductor's error in the loader thread is not lost: the steps ran the traced ops meanwhile, and
    the next step's start raises it, as a compile in the step would have; a region of symbolic sizes alike,
    and it is sent again where it next runs."""

    def broken(*args):
        raise RuntimeError("Inductor cannot lower this")

    monkeypatch.setattr(regions, "compile_symbolic" if symbolic else "compile_static", broken)
    cache = regions.RegionCache(lambda: None)
    region = _loaded_exp(cache)
    region.dims = [(0,)] if symbolic else None
    x = torch.randn(4)
    torch.testing.assert_close(region(x)[0], x.exp())
    assert [isinstance(key, regions._SymbolicKey) for key in cache.pending] == [symbolic]
    with pytest.raises(RuntimeError, match="cannot lower"):
        cache.poll(wait=True)
    assert not cache.pending and not cache.compiled and not any(cache.symbolic.values())
    torch.testing.assert_close(region(x)[0], x.exp())
    assert len(cache.pending) == 1  # sent again


def test_artifacts_are_saved_between_the_loaders_compiles(tmp_path, monkeypatch):
    """torch records a compile's artifacts while it makes it: a model saves them where a call begins only
    while no compile runs (the save reads what the loader writes), and never waits for one."""
    from fbmt.compiler import cache

    monkeypatch.setattr(regions, "compile_static", _traced)
    saves = []
    monkeypatch.setattr(cache, "save_artifacts", lambda path, compiling: saves.append(compiling))
    model = fbmt.compile(gpt(n_layer=1), backend="inductor", background_compile=False, cache_dir=tmp_path)
    x = torch.randint(0, 64, (2, 8))
    model(x)  # its regions compile in the step (no workers): the next call saves them
    held, release = threading.Event(), threading.Event()

    def compiling():
        with regions.COMPILING:
            held.set()
            release.wait(30)

    loader = threading.Thread(target=compiling)
    loader.start()
    assert held.wait(30)
    started = time.perf_counter()
    model(x)
    waited = time.perf_counter() - started
    release.set()
    loader.join()
    assert saves == [] and waited < 10
    model(x)
    assert saves == [0]


def test_a_load_ends_whatever_fails_in_it(monkeypatch):
    """A load is done however it fails, even before its compile (here the warning about a failed worker
    cannot be written): waiting for the compiles ends, with the error, and never hangs."""

    class Failed(_Answered):
        def submit(self, function, *args):
            job = background.Job(function, args)
            job._finish(None, "the worker process stopped")
            return job

    def no_log(*args, **kwargs):
        raise OSError("the log's stream is closed")

    monkeypatch.setattr(regions, "compile_static", _traced)
    monkeypatch.setattr(regions.logs.log, "warning", no_log)
    cache = regions.RegionCache(lambda: Failed())
    Region(torch.fx.symbolic_trace(lambda x: (torch.ops.aten.cos.default(x),)), "cos", cache)(torch.randn(3))
    raised = []
    waiting = threading.Thread(target=lambda: raised.append(pytest.raises(OSError, cache.poll, wait=True)), daemon=True)
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive() and raised


def test_a_compile_that_synchronizes_under_the_sync_debug_mode_says_what_to_do(monkeypatch):
    """Inductor may synchronize the device while compiling; under torch.cuda.set_sync_debug_mode("error")
    (the process's, not the loader's own) the next step would raise torch's error as if it had synced
    itself: fbmt says what happened and what to do."""

    def folding(description, specs, grad):
        raise RuntimeError("called a synchronizing CUDA operation")

    monkeypatch.setattr(regions, "compile_static", folding)
    cache = regions.RegionCache(lambda: None)
    _loaded_exp(cache)(torch.randn(4))
    with pytest.raises(RuntimeError, match="wait_compiled") as raised:
        cache.poll(wait=True)
    assert "synchronizing CUDA operation" in str(raised.value.__cause__)


def test_a_region_that_fails_to_compile_in_the_loader_says_so_where_the_step_begins(monkeypatch):
    """A compile the loader makes fails where the next step begins, in fbmt's words, Inductor's error kept
    as the cause; the next poll finds nothing left to raise."""

    def failing(description, specs, grad):
        raise ValueError("Cannot view a tensor with shape torch.Size([4])")

    monkeypatch.setattr(regions, "compile_static", failing)
    cache = regions.RegionCache(lambda: None)
    _loaded_exp(cache)(torch.randn(4))
    with pytest.raises(RuntimeError, match=r"Inductor failed to compile a region of 1 ops .*backend='eager'") as raised:
        cache.poll(wait=True)
    assert isinstance(raised.value.__cause__, ValueError)
    assert cache.poll(wait=True) == 0


def test_a_program_is_not_traced_while_the_loader_compiles(monkeypatch):
    """make_fx keeps its tracer and node metadata in globals of the process, and Inductor runs make_fx:
    a model's trace waits for the loader's compile in hand (and the loader for the trace)."""

    importlib.import_module("torch._inductor.compile_fx")  # the loader's first step, done: it compiles at once
    spans, compiling = {}, threading.Event()

    def slow(description, specs, grad):  # holds the lock a real compile holds, for a second
        with regions.COMPILING:
            compiling.set()
            started = time.perf_counter()
            time.sleep(1.0)
            spans["load"] = (started, time.perf_counter())
        return _traced(description, specs, grad)

    def traced(*args, **kwargs):
        spans["trace"] = time.perf_counter()
        return compile_program(*args, **kwargs)

    compile_program = pipeline.compile_program
    monkeypatch.setattr(regions, "compile_static", slow)
    monkeypatch.setattr(pipeline, "compile_program", traced)
    cache = regions.RegionCache(lambda: None)
    region = _loaded_exp(cache)
    region(torch.randn(4))
    model = fbmt.compile(gpt(n_layer=1))
    cache.poll()  # the loader starts
    assert compiling.wait(30)
    model(torch.randint(0, 64, (2, 8)))  # a program traced while the loader compiles
    cache.poll(wait=True)
    assert spans["trace"] >= spans["load"][1], spans  # the trace began once the compile had ended


def test_a_compile_in_the_loader_does_not_rewind_the_steps_random_numbers(monkeypatch):
    """Inductor sets the random generators back after a compile it makes in full; from the loader
    thread that would undo the draws the steps made meanwhile, and they would be drawn again (NOTE:
    [The loader and the random generators]). The steps' stream is what it is without a loader."""

    started, drawn = threading.Event(), threading.Event()

    def full_compile(gm, fakes):  # as Inductor's codegen: the generators saved, then set back
        with torch._dynamo.utils.preserve_rng_state():
            started.set()
            drawn.wait(30)
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", full_compile)
    torch.manual_seed(0)
    expected = torch.rand(1), torch.rand(2)
    cache = regions.RegionCache(lambda: None)
    region = _loaded_exp(cache)
    x = torch.ones(4)
    region(x)
    torch.manual_seed(0)
    cache.poll()  # the loader starts its compile
    assert started.wait(30)
    first = torch.rand(1)  # a step's draw while the loader compiles
    drawn.set()
    cache.poll(wait=True)
    assert torch.equal(first, expected[0]) and torch.equal(torch.rand(2), expected[1])
    torch.testing.assert_close(region(x)[0], x.exp())
    state, again = torch.get_rng_state(), torch.rand(1)
    torch.random.set_rng_state(state)  # this thread's calls set the generator as ever
    assert torch.equal(torch.rand(1), again)


def test_waiting_for_compiles_while_the_interpreter_exits_ends(monkeypatch):
    """Once the interpreter exits the loader compiles nothing more, and what is left fails rather than
    being waited for (an exit handler that waits would hang)."""

    exiting = threading.Event()
    exiting.set()
    monkeypatch.setattr(background, "exiting", exiting)
    cache = regions.RegionCache(lambda: None)
    region = _loaded_exp(cache)
    region(torch.randn(3))
    with pytest.raises(RuntimeError, match="exiting"):
        cache.poll(wait=True)


EXITS_WHILE_COMPILING = """
import atexit, time
import torch, fbmt
# an exit handler that takes a while, registered after fbmt is imported and before its workers start (as
# Inductor's own pool registers its): the workers stopped, it gave the loader time to compile what they had
atexit.register(time.sleep, 3)
import torch.nn.functional as F
from tests.models.reference import gpt
torch.manual_seed(0)
model = fbmt.compile(gpt(n_layer=1), backend="inductor", background_compile=True, cache_dir=False)
x = torch.randint(0, 64, (2, 8))
for _ in range(2):  # the second step starts the loader, which waits for the workers' first answers
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
assert model.regions.pending, model.regions  # the regions still compile as the script ends
print("steps done", flush=True)
"""


def test_a_script_that_ends_while_its_regions_compile_exits_cleanly(tmp_path):
    """NOTE: [Exiting while regions compile]: a script that ends before the workers answered exits with
    status 0, and its loader compiles nothing in the exiting interpreter (before, the workers' stop failed
    their jobs, the loader compiled them here, and the process could abort inside torch's C++)."""
    root = str(Path(fbmt.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "FBMT_LOG": "info"}
    done = subprocess.run(
        [sys.executable, "-c", EXITS_WHILE_COMPILING], env=env, capture_output=True, text=True, timeout=300, cwd=root
    )
    assert done.returncode == 0 and "steps done" in done.stdout, done.stderr[-3000:]
    assert "compiles in this process" not in done.stderr, done.stderr[-3000:]


INTERRUPTED = """
import atexit, signal, time, torch, fbmt
# Ctrl-C as a terminal's foreground job has it: a suite started in the background by a shell without job
# control hands its processes SIGINT ignored, and this script would sleep on through the test's signal
signal.signal(signal.SIGINT, signal.default_int_handler)
atexit.register(time.sleep, 2)  # an exit handler that takes a while (a logger's upload), run before fbmt's
import torch.nn.functional as F
from fbmt.compiler.runtime import background
from tests.models.reference import gpt
model = fbmt.compile(gpt(n_layer=1), backend="inductor", background_compile=True, cache_dir=False)
x = torch.randint(0, 64, (2, 8))
F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
print(*[p.pid for p in background._pool._processes], flush=True)
time.sleep(120)
"""


def test_ctrl_c_interrupts_the_script_not_its_compile_workers(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the foreground process group) while the workers compile: the script
    stops with its own KeyboardInterrupt, the workers print no traceback of theirs, and they are stopped."""
    root = str(Path(fbmt.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    script = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED],
        env=env,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal's foreground job
    )
    pids = [int(p) for p in script.stdout.readline().split()]
    assert pids, script.communicate(timeout=60)[1][-3000:]
    os.killpg(script.pid, signal.SIGINT)
    _, err = script.communicate(timeout=60)
    # the script's own traceback alone: an interrupted worker would end with one of its own
    assert script.returncode != 0 and err.count("KeyboardInterrupt") == 1, err[-3000:]
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "a compile worker outlived the script"


def test_a_program_whose_entry_lacks_many_of_its_regions_sends_them_to_the_workers(tmp_path, monkeypatch):
    """An entry saved while regions were still compiling (a run stopped early) lacks them: where it lacks
    more than a few, the next run sends its regions to the workers, which find the others in torch's
    caches, rather than have the loader compile the missing ones in full one after another; where it
    lacks a few or none, the loader makes them all and no worker starts."""
    from fbmt.compiler import cache, module

    monkeypatch.setattr(regions, "compile_static", _traced)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"the regions compiled", None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: None)
    options = dict(backend="inductor", background_compile=False, cache_dir=tmp_path)
    x = torch.randint(0, 64, (2, 8))

    def sent_regions() -> list[bool]:  # whether each region of a new run's program may go to a worker
        cache.load_artifacts.cache_clear()
        model = fbmt.compile(gpt(n_layer=1), **options)
        model(x)
        assert model.program.origin.startswith("loaded")
        return [r.send for r in _regions(model)]

    first = fbmt.compile(gpt(n_layer=1), **options)
    first(x)
    (entry,) = first._entries
    (entry / "inductor.bin").unlink(missing_ok=True)  # as saved by a run that stopped early
    cache.save_artifacts(entry, compiling=module.LOADED_AT_MOST_MISSING + 1)
    assert all(sent_regions())
    cache.save_artifacts(entry, compiling=module.LOADED_AT_MOST_MISSING)  # a later run compiled more
    sent = sent_regions()
    assert sent and not any(sent)


@pytest.mark.parametrize("option", [dict(backend="eager"), dict(backend="inductor", cuda_graph=True)])
def test_background_compile_is_refused_where_nothing_compiles_in_the_background(option):
    with pytest.raises(ValueError, match="background_compile=True"):
        fbmt.compile(gpt(), background_compile=True, **option)


def test_a_layout_met_while_its_structures_symbolic_compile_is_made_is_sent_once_that_is_in(monkeypatch):
    """Inductor's guards split the sizes into classes (NOTE: [Symbolic regions]; here even and odd), and a
    structure's compiles of symbolic sizes are made one at a time. A layout of another class met while the
    first is made runs as traced and is kept: once the first is in, it is sent at once (NOTE: [Compiles in
    the background]), not when a size of its class next comes; one of the first's class is not."""
    from tests.runtime.test_regions import _cos_region, _guarding

    _guarding(monkeypatch, lambda n: bool(n % 2 == 0))
    cache = regions.RegionCache(lambda: _Answered())
    region = _cos_region(cache)
    for n in (9, 10, 11):  # 9's compile is sent; 10 and 11 are met while it is made
        x = torch.randn(3, n)
        torch.testing.assert_close(region(x)[0], x.cos())
    assert cache.eager_runs == 3
    cache.poll(wait=True)  # 9's compile in: it admits 11, not 10, whose compile is sent now
    assert len(cache.symbolic["cos"]) == 1 and len(cache.pending) == 1
    cache.poll(wait=True)
    assert len(cache.symbolic["cos"]) == 2 and not cache.pending and not cache.waiting
    for n in (12, 13):  # both classes compiled
        x = torch.randn(3, n)
        torch.testing.assert_close(region(x)[0], x.cos())
    assert cache.eager_runs == 3
