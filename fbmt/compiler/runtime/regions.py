"""Compute regions: hand the aten code between collectives to a compiler (Inductor).

NOTE: [Regions]
After partitioning, a forward or backward GraphModule is a sequence of pure aten compute with
collective nodes (starts, waits) and effectful ops (random draws, buffer writes, recording) in
between. `split_regions` cuts it at every node that is not pure aten compute (size arithmetic of a
program of symbolic sizes, `s0 * 4`, counts as pure: a region may return such a size) and replaces
each maximal run of pure nodes that does real work (not only views) by one call of a `Region` module. A
region compiles itself on its first call, from its inputs' shapes, strides and dtypes, with
`torch._inductor.compile_fx.compile_fx` (where torch's own FX graph and AOTAutograd caches find it
again in a later run: `_cacheable`), and keeps the result in a cache shared by the whole model,
keyed by the region's structure (ops and how they connect, constants included) and its inputs'
shapes, strides and dtypes. The regions of identical blocks have the same key, so a 32-layer model
compiles one forward and a few backward regions, not 32 of each: compile time does not grow with
depth. In a program of symbolic sizes a region compiles once for all the sizes it varies in (NOTE:
[Symbolic regions]).

Collectives stay about where the schedule pass put them, so communication overlaps the compiled
compute as it overlapped the eager one. Two moves are made first, each so that a region is not cut
where nothing is gained by the cut:
- a multi-output op's unpacking (`getitem`) goes right after the op, so a collective a schedule issued
  between them does not cut the region there (a region returns flat values, not the op's tuple);
- a collective that ends a cheap run (at most CHEAP_RUN ops, no product, attention or convolution: the
  first ops of a norm before the wait for a block's weights) and does not read it moves to the run's
  start, so the run joins the region after it. The overlap lost is that run's time, a few memory-bound
  ops, and Inductor may fuse the run with what follows.
An attention kernel called without dropout is pure compute although its schema says it may draw random
numbers, so it is inside a region too: a block's forward is one region, not three. Fewer, larger
regions did not shorten Inductor's own compile: its time follows the ops it compiles more than the
number of kinds (BENCHMARKS.md, "Start time").

NOTE: [Regions of repeated blocks]
Inductor's cold compile of a kind of region costs about a constant plus a time per op, so what a model
compiles is the sum over its distinct kinds, and a kind that only one layer has (because of where the
layer stands) costs as much as the kind every layer shares. Two such differences are removed:
- A run of pure compute that holds the layers' code and the model's own (the embeddings, and the
  rotary tables before the first layer; the final norm after the last) keeps the model's code before the
  first node of a repeated block (`layers.3`: a list's member) and after the last as runs of their
  own (`_apart_from_layers`), so the first and last layers' regions are the others' kind. A node of no
  block (a view of gathered weights, a size) goes with the block of the next node that has one; one
  that does work is the model's code.
- In a layer's backward, the prefetch of an earlier layer's weights and the wait for a later layer's
  reduce-scatter stand before a few cheap ops (the norm weight's gradient, the flattening the layer's
  reduce-scatter then reads), which would be a region of their own; the first layers, with nothing
  left to prefetch, join them to their main region instead, another kind. Collectives between a region
  and a cheap run that reads none of them move to the run's end (`_join_cheap_tails`), so every layer's
  backward is one region of one kind; the prefetch starts those few ops later.
Where one region becomes three (the embeddings, the first layer and the final norm apart), a step runs
two more region calls; a model's regions are fewer in all, as every tail joins its layer.

NOTE: [Compiles in the background]
A cold start spent most of its first step in Inductor: each kind of region compiled in this process,
one after another, while the machine's other cores and the device waited. With `background_compile`
(the default on CUDA), a region met with a layout no compile serves is compiled away from the steps,
and until its compile is taken in the region runs its traced aten ops as they are, as backend="eager"
runs them:
- Cold, it is sent to a few worker processes (`background.Workers`). A worker compiles it into torch's
  own caches (the FX graph and AOTAutograd caches, which bundle the Triton kernels), and nothing else;
  this process then compiles it again from the same graph and fakes (`compile_static`: the graph
  rebuilt from plain values, `_describe`, so it has the same code; fakes made from each input's
  layout, `_spec`), which the caches answer in a fraction of the time.
- Warm, where the program's cache entry held Inductor's artifacts, it goes to no worker (starting one
  costs more than the load): this process compiles it from the caches at once. An entry saved while
  regions were still compiling (a run stopped early) lacks those: where it lacks more than a few
  (`module.LOADED_AT_MOST_MISSING`), its program's regions go to the workers, which find the others in
  the caches, so that the missing ones do not compile in full one after another here.
Both compiles here are made by a loader thread of this process (`RegionCache._load`), one at a time, and
taken in where a call of the model begins (`RegionCache.poll`): within a step every region is what it
was when the step began (unless the step meets a new layout). The loader starts where the step after the
one that met the regions begins, not beside it: importing Inductor is seconds of Python, which takes the
interpreter from the step's thread, and that first step would run several times slower. So a warm
start's first step runs traced without waiting for Inductor at all, and the next steps share the process
with the loader. A worker that failed or did not answer in `wait_limit`, or a cache that does not answer
(one turned off, another torch in the worker's environment), leaves that compile to the loader, as one
made here; a compile that fails raises where the next step begins (one that synchronized the device
under `torch.cuda.set_sync_debug_mode("error")`, which is the process's, says to wait for the compiles
before turning it on). What a step computes never depends on the workers or the loader. The values of
the traced and the compiled ops differ by their rounding (eager PyTorch's kernels and Inductor's), and
the step that changes depends on the workers' and the loader's speed: a run is not bitwise repeatable, and
`CompiledModule.wait_compiled()` takes every compile in at once. A region of symbolic sizes (NOTE: [Symbolic
regions]) goes to the workers the same way (`compile_symbolic`: its symbols made from each input's layout, which
in any process gives the same symbols, so the caches answer this process too), one compile of a structure at a
time: a layout no compile of its admits runs as traced while one is made, and is kept (`RegionCache.waiting`):
once that compile is in, the first kept layout it does not admit is sent at once, not when a length of its class
next comes (a stream of lengths may bring none for many steps). So the length that makes a program symbolic no
longer waits for its regions, nor does a length of a new class of sizes. Compiles here are made one at a time
(`COMPILING`, which a program's trace holds too: make_fx keeps its state in globals of the process); under CUDA
graphs, which would capture the traced ops, nothing compiles in the background.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import operator
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fbmt import logs
from fbmt.compiler import collectives as comm
from fbmt.compiler import meta, ops
from fbmt.compiler.runtime import background

# NOTE: [A backward across the switch]
# A region finds its compile from its inputs' layouts on its first call after compiles were taken in, and
# keeps it for the calls that follow: within a step every call of a region sees the layouts the step's
# forward made. A compiled forward is held to the strides the traced ops gave its outputs (NOTE: [Outputs
# in the traced layouts]) where they are known, which a symbolic stride left unknown at a call's sizes is
# not, so a forward may still lay an output out otherwise. So where a backward runs whose forward ran
# before the last take-in
# (forwards of several micro-batches, then their backwards in order, as a pipeline schedule runs them),
# its regions find the compile for each call's own layouts and keep none of it
# (`RegionCache.backward_of`); otherwise the newer forward's backward would be handed the compile the
# older one found, made for other layouts (Inductor's size asserts would stop it; without them it
# would read its inputs wrongly).


class RegionCache:
    """Compiled regions of one model (or more), by structure and input layout; with counts. With
    `workers`, a region's first compile is made in them while the steps run it as traced (NOTE:
    [Compiles in the background])."""

    def __init__(self, workers: Callable[[], background.Workers | None] | None = None) -> None:
        self.compiled: dict[tuple, Any] = {}
        self.graphs: dict[str, fx.GraphModule] = {}  # each structure's GraphModule, made once (`_extract`)
        self.symbolic: dict[str, list[Symbolic]] = {}  # each structure's compiles of symbolic sizes
        self.hits = self.misses = 0
        self.seconds = 0.0  # compiling (or loading what the workers compiled) in this process
        self.workers = workers  # where a compile is sent (`background.pool`: started again after a release)
        # compiles the workers are making, by the key `compiled` will have (`_SymbolicKey`: `symbolic`'s)
        self.pending: dict[tuple | _SymbolicKey, _Load] = {}
        # layouts a structure's regions met while its compile of symbolic sizes was made, none of its compiles
        # admitting them: the region, the inputs' `_spec`s and the grad mode, for the next compile to send
        self.waiting: dict[str, list[tuple[Region, list, bool]]] = {}
        self.generation = 0  # how many times compiles from the workers were taken in: regions look again
        self.sent = 0  # compiles sent to the workers, and their seconds there
        self.worker_seconds = 0.0
        self.eager_runs = 0  # region calls that ran the traced ops while their compile was made
        self.wait_limit = 600.0  # seconds the loader waits for a worker's compile before making it itself
        # backwards running whose forward ran before the last take-in (NOTE: [A backward across the switch])
        self.stale = 0
        self._queue: list[_Load] = []  # loads the loader thread has yet to make
        self._queued = threading.Condition()  # guards `_queue` and `_loader`
        self._loader: threading.Thread | None = None

    def __deepcopy__(self, memo: dict) -> RegionCache:  # a model's copy (an EMA twin) runs the same regions
        return self

    def __repr__(self) -> str:
        sent = f", {self.sent} in the background ({self.worker_seconds:.1f}s there)" if self.sent else ""
        return f"RegionCache({self.misses} compiled, {self.hits} reused, {self.seconds:.1f}s compiling{sent})"

    def start_workers(self) -> None:
        """Start the workers now, if compiles go to workers: a program is about to be traced (not
        loaded), and they take seconds to start."""
        if self.workers is not None:
            self.workers()

    def send(self, region: Region, key: tuple, args: tuple, symbolic: bool = False) -> bool:
        """Have `region` compiled for `args` (with `symbolic`, for the sizes its `dims` name, as one of
        symbolic sizes) while the steps run it as traced: by the workers and then taken in by this
        process's loader thread, or (`region.send` False: its program's cache entry holds Inductor's
        artifacts) by the loader thread alone. False where it cannot be (no background compiles, a graph
        that does not cross to another process), and the caller compiles it now."""
        return self._send(region, key, [_spec(a) for a in args], torch.is_grad_enabled(), symbolic)

    def wait(self, region: Region, args: tuple) -> None:
        """Keep `args`' layouts for the next compile of symbolic sizes of `region`'s structure: none of its
        compiles admits them, and one is being made (NOTE: [Compiles in the background])."""
        kept = self.waiting.setdefault(region.structure, [])
        specs = [_spec(a) for a in args]
        if len(kept) < MAX_SYMBOLIC and all(specs != k for _, k, _ in kept):
            kept.append((region, specs, torch.is_grad_enabled()))

    def _send_waiting(self, structure: str) -> None:
        """Send the first layout kept for `structure` that none of its compiles admits (`wait`)."""
        made = self.symbolic.get(structure, [])
        kept = [w for w in self.waiting.pop(structure, []) if not any(s.admits(_laid_out(w[1])) for s in made)]
        if not kept or len(made) >= MAX_SYMBOLIC or sum(s.pinned for s in made) >= 2:
            return
        (region, specs, grad), *rest = kept
        if self._send(region, _SymbolicKey(structure), specs, grad, symbolic=True) and rest:
            self.waiting[structure] = rest

    def _send(self, region: Region, key: tuple | _SymbolicKey, specs: list, grad: bool, symbolic: bool) -> bool:
        if self.workers is None or not background.enabled():
            return False
        description = _describe(region.gm)
        if description is None:
            return False
        # the arguments of `compile_symbolic` or `compile_static`
        made = (description, specs, region.dims, grad) if symbolic else (description, specs, grad)
        function = compile_symbolic if symbolic else compile_static
        job = None
        if region.send:
            workers = self.workers()
            if workers is None:
                return False
            try:
                job = workers.submit((__name__, "compile_symbolic" if symbolic else "compile_static"), *made)
            except (pickle.PicklingError, TypeError, AttributeError):  # an argument another process cannot receive
                return False
            self.sent += 1
            if self.sent == 1:
                logs.log.info(
                    "Inductor: compiling regions in %d worker processes; until a step finds them compiled, it "
                    "runs their ops as traced",
                    workers.count,
                )
        load = self.pending[key] = _Load(job, function, made, region)
        with self._queued:
            self._queue.append(load)
            self._queued.notify()
        return True

    @contextlib.contextmanager
    def backward_of(self, generation: int) -> Iterator[None]:
        """Where a backward runs whose forward ran at `generation`: if compiles came in since, its
        regions find the compile for each call's layouts (NOTE: [A backward across the switch])."""
        stale = int(generation != self.generation)
        self.stale += stale
        try:
            yield
        finally:
            self.stale -= stale

    def _start_loader(self) -> None:
        """Start the loader thread where loads wait and none runs. Not at `send`, within the step that
        met the regions: any Python the loader runs (importing Inductor is seconds of it) takes the
        interpreter from the step's thread, whose traced ops then run several times slower."""
        with self._queued:
            if self._queue and self._loader is None:
                _keep_the_steps_draws()
                self._loader = threading.Thread(target=self._load, daemon=True, name="fbmt-region-loader")
                _loaders.add(self._loader)
                self._loader.start()

    def _load(self) -> None:
        """The loader thread: make each queued load (`_Load.make`) once it is ready, one at a time, the
        first ready first; it ends when none is left (`poll` starts another)."""
        _in_loader.active = True
        with contextlib.suppress(Exception):  # exiting; or a broken install, which fails the compile itself
            importlib.import_module("torch._inductor.compile_fx")  # what every compile needs
        while True:
            with self._queued:
                if background.exiting.is_set():  # what is left fails, so that nothing waits for it
                    for q in self._queue:
                        q.fail(RuntimeError("fbmt: the interpreter is exiting; the region was not compiled"))
                    self._queue.clear()
                load = next((q for q in self._queue if q.ready(self.wait_limit)), None)
                if load is None and not self._queue:
                    self._loader = None  # under the lock: a load queued after this starts a new thread
                    return
                if load is None:
                    self._queued.wait(0.05)  # a worker's answer sets no condition of ours: look again soon
                    continue
                self._queue.remove(load)
            load.make(self.wait_limit)

    def poll(self, wait: bool = False) -> int:
        """Take in the compiles the loader has made (with `wait`: every one pending, waiting for them),
        so that the next region calls run them; called where a step begins. Returns how many. A
        compile that failed here raises its error."""
        self._start_loader()
        if wait:
            for load in list(self.pending.values()):
                load.done.wait()  # bounded: the loader waits `wait_limit` for a worker, then compiles itself
        ready = [key for key, load in self.pending.items() if load.done.is_set()]
        if not ready:
            return 0
        loads = [self.pending.pop(key) for key in ready]
        for key, load in zip(ready, loads):
            self.seconds += load.seconds
            if load.job is not None and load.job.seconds is not None:
                self.worker_seconds += load.job.seconds
            if load.error is None and isinstance(key, _SymbolicKey):  # its structure's (`compile_symbolic`)
                self.symbolic.setdefault(key.structure, []).append(load.fn[1])
                self.misses += 1
                self._send_waiting(key.structure)
            elif load.error is None:
                self.compiled[key] = load.fn
                self.misses += 1
        self.generation += 1
        failed = next((load.error for load in loads if load.error is not None), None)
        if failed is not None:  # the others are in; the failed one is sent again where it next runs
            raise failed
        if not self.pending:
            background.release()  # the workers' memory goes back to training until a new compile
        answered = [load.job.finished - load.job.sent for load in loads if load.job is not None and load.job.done()]
        logs.log.info(
            "Inductor: %d region kinds compiled in the background taken in (%.2fs in the loader thread%s; %d "
            "still compiling); %d region calls ran as traced so far",
            len(ready),
            sum(load.seconds for load in loads),
            f", the last from a worker {max(answered):.1f}s after it was sent" if answered else "",
            len(self.pending),
            self.eager_runs,
        )
        return len(ready)


_in_loader = threading.local()  # `active` in a loader thread


def _keep_the_steps_draws() -> None:
    """In a loader thread, the process's random generators are never set back.

    NOTE: [The loader and the random generators]
    Inductor and AOTAutograd save the generators' states around a compile they make in full (a cache
    miss: a worker that failed, a graph the cache bypasses) and set them back after, so that what the
    compile draws is never seen. The generators are the process's, not the thread's: set back from the
    loader, they would undo what the steps drew meanwhile (dropout masks, a sampler's indices), and the
    next steps would draw the same numbers again, silently. So `torch.random.set_rng_state` and
    `torch.cuda.set_rng_state`, the calls that set them back, do nothing in a loader thread (a compile's
    own draws, its benchmarks' inputs, then advance the streams as another draw of the steps would);
    every other thread calls them as before."""
    for owner in (torch.random, torch.cuda):
        original = owner.set_rng_state
        if getattr(original, "fbmt_loader_guard", False):
            continue

        @functools.wraps(original)
        def set_rng_state(*args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            if getattr(_in_loader, "active", False):
                return None
            return _original(*args, **kwargs)

        set_rng_state.fbmt_loader_guard = True  # type: ignore[attr-defined]
        owner.set_rng_state = set_rng_state


# The loader threads alive, waited for where the interpreter exits (`_finish_loaders`).
_loaders: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

# How long the interpreter's exit waits for a loader's compile under way (one region's, from the caches or
# in full); past it, the exit goes on and may abort inside that compile.
EXIT_WAIT = 120.0


def _finish_loaders() -> None:
    """Where the interpreter exits (`background.on_exit`, after `exiting` is set, before the workers stop):
    wait for each loader thread to end.

    NOTE: [Exiting while regions compile]
    A script may end while regions still compile (a short run, a test, an evaluation). Once the
    interpreter exits, a daemon thread that takes the interpreter again is stopped where it stands; in
    torch's C++ (a compile) that aborts the whole process ("terminate called without an active
    exception"), and a job that succeeded reports a failure. So where the interpreter exits, first
    `background.exiting` is set: a loader starts no compile after it (what it would make is no longer
    wanted), and those queued fail, so that nothing waits for them; then each loader thread is waited
    for, which ends at once or after the one compile it is making; and only then do the workers stop
    (before, their stop failed the jobs they had, and the loader compiled those here, in the exiting
    interpreter). What the workers had put in torch's caches stays there for the next run."""
    for thread in list(_loaders):
        thread.join(2.0)  # one that waits for a worker ends at its next look; a load from the caches soon
        if thread.is_alive():
            logs.log.warning(
                "fbmt: the script is ending while a region compiles in this process; waiting for that compile "
                "to end (at most %.0f s more)",
                EXIT_WAIT,
            )
            thread.join(EXIT_WAIT)


background.on_exit(_finish_loaders)


class _Load:
    """A region's compile made while the steps run it as traced (NOTE: [Compiles in the background]):
    by a worker (`job`) and then again here, where torch's caches answer it; or here at once (no
    job: its program's cache entry holds Inductor's artifacts). `function` (`compile_static` or
    `compile_symbolic`) makes it from `args`."""

    def __init__(self, job: background.Job | None, function: Callable[..., Any], args: tuple, region: Region) -> None:
        self.job, self.function, self.args, self.region = job, function, args, region
        self.fn: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # the loader's own compile
        self.done = threading.Event()

    def ready(self, limit: float) -> bool:
        """Its worker answered (or failed), or has not in `limit` seconds; or it has none."""
        job = self.job
        return job is None or job.done() or time.perf_counter() - job.sent > limit

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def make(self, limit: float) -> None:
        """Compile it here; done whatever happens (`wait_compiled` waits for `done`)."""
        started = time.perf_counter()
        try:
            if background.exiting.is_set():  # NOTE: [Exiting while regions compile]
                raise RuntimeError("fbmt: the interpreter is exiting; the region was not compiled")
            job = self.job
            if job is not None and not job.done():  # a worker stuck: the job is left to it, and made here
                logs.log.warning(
                    "fbmt: a compile worker has not answered in %.0fs; the region compiles in this process", limit
                )
            elif job is not None and job.error is not None:
                logs.log.warning(
                    "fbmt: a compile worker failed on a region (%s); it compiles in this process", job.error
                )
            # the same graph and fakes as the worker's: torch's caches hold what it compiled (NOTE)
            try:
                self.fn = self.function(*self.args)
            except Exception as e:
                self.error = _explained(e, self.region)
        except BaseException as e:  # raised where a step begins (`poll`), as a compile there would raise
            self.error = e
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()


def _explained(error: Exception, region: Region) -> Exception:
    """A region's compile error, said in fbmt's words: which blocks the region's ops come from and what
    to do. Inductor's own words name an op of a graph the user never wrote. A compile that synchronizes
    the device (Inductor folding a constant) under `torch.cuda.set_sync_debug_mode("error")` is the
    process's doing, not the step's that then raises it. fbmt's own errors are left as they are."""
    if str(error).startswith("fbmt:") or isinstance(error, torch.OutOfMemoryError):  # what a caller may catch
        return error
    if isinstance(error, RuntimeError) and "synchronizing CUDA operation" in str(error):
        explained = RuntimeError(
            "fbmt: a region compiling in the background synchronized the device while "
            "torch.cuda.set_sync_debug_mode('error') was on (a compile may; the steps do not): call "
            "model.wait_compiled() before turning the mode on, or compile with background_compile=False"
        )
    else:
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        ops = sum(n.op == "call_function" for n in region.gm.graph.nodes)
        explained = RuntimeError(
            f"fbmt: Inductor failed to compile a region of {ops} ops from {region.where or 'the program'} "
            f"({type(error).__name__}: {first}). backend='eager' runs the same program without Inductor; "
            "please report the model and this error to fbmt"
        )
    explained.__cause__ = error
    return explained


def _where(run: list[fx.Node]) -> str:
    """The blocks a run of nodes comes from, in words: "block h.0", "blocks h.0, h.1 ... (5 blocks)"."""
    blocks = list(dict.fromkeys(b if b else "the model's root" for n in run if (b := meta.block(n)) is not None))
    if not blocks:
        return ""
    if len(blocks) > 3:
        return f"blocks {', '.join(blocks[:3])} ... ({len(blocks)} blocks)"
    return ("block " if len(blocks) == 1 else "blocks ") + ", ".join(blocks)


@dataclass(frozen=True)
class _SymbolicKey:
    """A structure's compile of symbolic sizes, pending (`RegionCache.pending`), where other compiles have
    their structure and layout as the key: one compiles at a time, and once in it serves what it admits."""

    structure: str


# At most this many compiles of symbolic sizes per region structure: a layout none of them admits
# then compiles for its exact sizes (NOTE: [Symbolic regions] says why so many).
MAX_SYMBOLIC = 8


class Region(nn.Module):
    """A run of pure aten nodes, compiled on first call (see NOTE: [Regions]).

    `dims` gives, for each input of a region in a program of symbolic sizes, the dimensions whose
    size varies between calls (for an int input: `(0,)`, its value varies); such a region is
    compiled once with those sizes symbolic and runs every layout whose sizes Inductor's
    assumptions admit (NOTE: [Symbolic regions])."""

    def __init__(
        self,
        gm: fx.GraphModule,
        structure: str,
        cache: RegionCache,
        dims: list[tuple[int, ...]] | None = None,
        recheck: bool = False,
        send: bool = True,
        where: str = "",
    ):
        super().__init__()
        self.where = where  # the blocks its ops come from, for an error (`_where`)
        self.send = send  # its compiles may be made in the workers (not where torch's caches hold them)
        self.gm, self.structure, self.cache = gm, structure, cache
        self.dims = dims if dims and any(dims) else None
        self.recheck = recheck  # an input's strides may change between calls: find its compile each call
        self.fn: Any = None
        self.generation = -1  # the cache's generation when `fn` was found; a newer one may hold its compile
        self.eager = False  # `fn` runs the traced ops: the compile is being made in the workers

    def forward(self, *args: Any) -> Any:
        if self.cache.stale:  # a backward of an older step's forward: these layouts alone, kept nowhere
            fn, eager = self._find(args)
        else:
            if self.fn is None or self.dims is not None or self.recheck or self.generation != self.cache.generation:
                self.generation = self.cache.generation
                self.fn, self.eager = self._find(args)
            fn, eager = self.fn, self.eager
        if eager:
            self.cache.eager_runs += 1
        return fn(*args)

    def _find(self, args: tuple) -> tuple[Any, bool]:
        """What runs this region for `args`' layouts: their compile (found, or made now), or the traced
        ops while it is made in the background (then True)."""
        layout = tuple(
            (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device)
            if isinstance(a, torch.Tensor)
            else repr(a)
            for a in args
        )
        key = (self.structure, layout)
        fn = self.cache.compiled.get(key)
        if fn is None and key in self.cache.pending:  # compiling in the workers
            return self.gm.forward, True
        if fn is None:
            found = self._symbolic(args) if self.dims is not None else None
            if found is not None and found[1]:  # a compile of symbolic sizes is being made in the background
                return found
            fn = found[0] if found is not None else None
            if fn is None and self.cache.send(self, key, args):
                return self.gm.forward, True
            if fn is None:
                fn, _ = self._inductor(args, symbolic=False)
            self.cache.compiled[key] = fn
        elif self.fn is None:  # the same region of another block, compiled already
            self.cache.hits += 1
        return fn, False

    def _symbolic(self, args: tuple) -> tuple[Any, bool] | None:
        """A compile of symbolic sizes that admits `args` (and False): one made before, or a new one; or the
        traced ops while one is made in the background (and True); None once MAX_SYMBOLIC are made or two are
        pinned (NOTE: [Symbolic regions]), and none admits them."""
        made = self.cache.symbolic.setdefault(self.structure, [])
        for s in made:
            if s.admits(args):
                self.cache.hits += 1
                return s.fn, False
        if len(made) >= MAX_SYMBOLIC or sum(s.pinned for s in made) >= 2:
            return None
        key = _SymbolicKey(self.structure)
        if key in self.cache.pending:  # the one compiling may admit these sizes too: asked once it is in
            self.cache.wait(self, args)
            return self.gm.forward, True
        if self.cache.send(self, key, args, symbolic=True):
            return self.gm.forward, True
        fn, fakes = self._inductor(args, symbolic=True)
        made.append(Symbolic.of(fn, fakes, args))
        if not made[-1].admits(args):  # never: its guards were made at these sizes
            raise AssertionError(f"fbmt: a region's symbolic compile rejects the sizes it was made at: {made[-1].code}")
        return fn, False

    def _inductor(self, args: tuple, symbolic: bool) -> tuple[Any, list]:
        """Inductor's compile of this region for `args`: for their exact sizes, or with the sizes
        `dims` names symbolic; and the fakes it was compiled from."""
        started = time.perf_counter()
        description = None if symbolic else _describe(self.gm)
        try:
            if description is not None:  # as a worker compiles it (`compile_static`)
                fn, fakes = compile_static(description, [_spec(a) for a in args], torch.is_grad_enabled()), []
            else:
                sizes = _for_every_size() if symbolic else contextlib.nullcontext()
                with COMPILING, cat_guard(), sizes, _cacheable(static=not symbolic) as mode:
                    if symbolic:
                        fakes = _symbolic_fakes(mode, [_spec(a) for a in args], self.dims)
                        fn = _compiled_symbolic(self.gm, mode, fakes)
                    else:
                        fakes = [_static(mode, a) for a in args]
                        gm, _, _ = _for_inductor(self.gm, mode, fakes, lift=False)
                        fn = _in_traced_layouts(gm, fakes)
        except Exception as e:
            explained = _explained(e, self)
            if explained is e:
                raise
            raise explained from e
        seconds = time.perf_counter() - started
        self.cache.seconds += seconds
        self.cache.misses += 1
        logs.log.info(
            "Inductor: a region of %d ops compiled for %s in %.2fs (%d kinds compiled, %d reused, %.1fs in all)",
            sum(n.op == "call_function" for n in self.gm.graph.nodes),
            "symbolic sizes" if symbolic else "its exact sizes",
            seconds,
            self.cache.misses,
            self.cache.hits,
            self.cache.seconds,
        )
        return fn, fakes


@dataclass
class Symbolic:
    """One compile of a region with symbolic sizes, and what it assumes of its inputs.

    NOTE: [Symbolic regions]
    In a program of symbolic sizes (NOTE: [Dynamic sizes]) a region's inputs vary between calls in
    the dimensions the program traced as symbols, and in the sizes it passes as ints. Such a region
    is compiled by Inductor once, from fakes whose varying sizes are symbols of a shape environment
    of its own; the kernels then compute every size from the inputs. While it compiles, Inductor may
    assume things of those symbols (that one is at least 2, that two are equal, that a stride is
    what it was); the shape environment keeps them as guards. A call's layout runs this compile only
    if, at the call's sizes, every guard holds, every dimension compiled as a constant has its size,
    and every input has the dtype and device compiled for (`admits`); the answer is kept per layout,
    so a layout is checked once. A layout no compile admits gets a new one, never a wrong kernel.
    On CUDA, Inductor's assumptions split the sizes into a few classes: ranges its heuristics choose by (whether
    to fuse a row and a column reduction: `640 <= s <= 1023`) times residues its alignments need (flash
    attention's backward reads the logsumexp, whose stride is the length, aligned to 8 or copied: `s % 8 != 0`),
    so a stream of lengths met about six, and a compile for each serves all of its class. The ranges are gone
    (`_for_every_size`); the residues stay, two classes. Once compiles run out (MAX_SYMBOLIC per structure), a
    layout compiles for its exact sizes, and a class left without a compile would compile for every length in
    it. A compile whose guards made a varying size one number (`pinned`) serves that size alone, as an exact
    compile would. One such can come of a degenerate layout (a size of 1 that fixes another), two say the
    region's code specializes: the structure's later layouts then compile for their exact sizes, each at once,
    where compiles of symbolic sizes are made one at a time for a structure (NOTE: [Compiles in the
    background])."""

    fn: Any
    code: str | None  # the guards as a Python expression over the inputs (torch's ShapeEnv writes it)
    positions: list[int]  # the inputs the guards read: tensors and symbolic ints
    fixed: dict[int, Any]  # the other inputs: what each must equal
    kinds: dict[int, tuple]  # tensor inputs: (dtype, device)
    env: Any
    pinned: bool  # a size made a symbol is one number in its guards: it admits that size alone

    @classmethod
    def of(cls, fn: Any, fakes: list, args: tuple) -> Symbolic:
        positions = [k for k, f in enumerate(fakes) if isinstance(f, (torch.Tensor, torch.SymInt))]
        env = next((_env(fakes[k]) for k in positions), None)  # none: every size was made a constant
        code = env.produce_guards_expression([fakes[k] for k in positions], ignore_static=False) if env else None
        fixed = {k: a for k, a in enumerate(args) if k not in positions}
        kinds = {k: (a.dtype, a.device) for k, a in enumerate(args) if isinstance(a, (torch.Tensor, _TensorSpec))}
        # a symbol the compile's guards replaced by a number (a size of 0 or 1 never was a symbol)
        pinned = env is not None and any(getattr(v, "is_number", False) for v in env.replacements.values())
        return cls(fn, code, positions, fixed, kinds, env, pinned)

    def admits(self, args: tuple) -> bool:
        if any(args[k] != v for k, v in self.fixed.items()):
            return False
        if any((args[k].dtype, args[k].device) != kind for k, kind in self.kinds.items()):
            return False
        return self.code is None or bool(
            self.env.evaluate_guards_expression(self.code, [args[k] for k in self.positions])
        )


def _env(fake: Any) -> Any:
    if isinstance(fake, torch.SymInt):
        return fake.node.shape_env
    return fake.fake_mode.shape_env


def _static(mode: FakeTensorMode, a: Any) -> Any:
    return mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a


@dataclass(frozen=True)
class _TensorSpec:
    """What a compile of exact sizes reads of a tensor input, without its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def _spec(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return _TensorSpec(tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device, a.requires_grad)
    return a


class _Layout:
    """A tensor's layout as a compile's guards read it (`Symbolic.admits`), from its `_TensorSpec`."""

    def __init__(self, spec: _TensorSpec):
        self.spec, self.dtype, self.device = spec, spec.dtype, spec.device

    def size(self, d: int | None = None) -> Any:
        return self.spec.shape if d is None else self.spec.shape[d]

    def stride(self, d: int | None = None) -> Any:
        return self.spec.stride if d is None else self.spec.stride[d]

    def storage_offset(self) -> int:
        return self.spec.offset


def _laid_out(specs: list) -> tuple:
    """What `Symbolic.admits` reads of inputs of `specs`' layouts."""
    return tuple(_Layout(s) if isinstance(s, _TensorSpec) else s for s in specs)


def _fake(mode: FakeTensorMode, spec: Any) -> Any:
    """A fake tensor of `spec`'s layout in `mode` (another value as it is)."""
    if not isinstance(spec, _TensorSpec):
        return spec
    with mode:
        if spec.offset == 0:
            t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device)
        else:  # a view at that offset into a storage that holds it
            extent = 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride)) if all(spec.shape) else 0
            base = torch.empty((spec.offset + extent,), dtype=spec.dtype, device=spec.device)
            t = base.as_strided(spec.shape, spec.stride, spec.offset)
    return t.requires_grad_(spec.requires_grad) if spec.requires_grad else t


def _describe(gm: fx.GraphModule) -> list | None:
    """`gm`'s nodes as plain values another process rebuilds (`_rebuild`) into the same graph, names
    and all (Inductor's caches key a graph by its code); None where a node's target or argument is
    not such a value (an op that is neither an OpOverload nor arithmetic on sizes, a tensor argument)."""
    out = []
    for n in gm.graph.nodes:
        target = n.target
        if n.op not in ("placeholder", "call_function", "output"):
            return None
        if isinstance(target, torch._ops.OpOverload):
            namespace, _, name = target._schema.name.partition("::")
            target = ("op", namespace, name, target._overloadname)
        elif n.op == "call_function" and not _of_sizes(target):
            return None
        bad = []
        args = fx.node.map_aggregate(
            (n.args, n.kwargs),
            lambda a: _Ref(a.name) if isinstance(a, fx.Node) else (bad.append(a) if isinstance(a, torch.Tensor) else a),
        )
        if bad:
            return None
        out.append((n.op, n.name, target, args))
    return out


def _of_sizes(target: Any) -> bool:
    """Whether `target` is a function of Python's `operator` module or torch's `sym_*` (what a program of
    symbolic sizes computes its sizes with, and `getitem`), which another process finds by its name."""
    name = getattr(target, "__name__", "")
    return getattr(operator, name, None) is target or (name.startswith("sym_") and getattr(torch, name, None) is target)


@dataclass(frozen=True)
class _Ref:
    name: str  # a node of the described graph


def _rebuild(description: list) -> fx.GraphModule:
    g = fx.Graph()
    made: dict[str, fx.Node] = {}

    def node(a: Any) -> Any:
        return made[a.name] if isinstance(a, _Ref) else a

    for op, name, target, (args, kwargs) in description:
        if isinstance(target, tuple) and target[:1] == ("op",):
            _, namespace, packet, overload = target
            target = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        args, kwargs = fx.node.map_aggregate((args, kwargs), node)
        if op == "placeholder":
            made[name] = g.placeholder(name)
        elif op == "output":
            g.output(args[0])
        else:
            made[name] = g.create_node(op, target, args, kwargs, name=name)
    return fx.GraphModule(nn.Module(), g)


def warm_up(device: str) -> None:
    """A compile worker's first compile, a tiny one on `device` (NOTE: [Compiles in the background]):
    imports, the device's initialization and Inductor's first run, paid while the model is traced."""
    description = [
        ("placeholder", "x", "x", ((), {})),
        ("call_function", "add", ("op", "aten", "add", "Tensor"), ((_Ref("x"), 1), {})),
        ("output", "output", "output", (((_Ref("add"),),), {})),
    ]
    compile_static(description, [_TensorSpec((8,), (1,), 0, torch.float32, torch.device(device), False)], False)


# One Inductor compile at a time in this process: the loader thread's and the steps' own (a new layout,
# a symbolic region) would otherwise interleave, and `cat_guard` swaps an entry of Inductor's global
# lowering table for the length of one. A program's trace holds it too (`CompiledModule._build`).
COMPILING = threading.RLock()


def compile_static(description: list, specs: list, grad: bool) -> Any:
    """Inductor's compile of a region (`_describe`'s `description`) for inputs of `specs`' exact
    layouts: what `Region` runs, and what a compile worker makes for torch's caches (NOTE: [Compiles in
    the background]): both build the same graph and the same fakes, so the caches key them alike."""
    ops.fake_kernels()  # in a worker, which traced nothing
    gm = _rebuild(description)
    cuda = next((s.device for s in specs if isinstance(s, _TensorSpec) and s.device.type == "cuda"), None)
    # a new thread's current device is device 0, not the one the caller set (the loader is one)
    device = torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext()
    with COMPILING, device, torch.set_grad_enabled(grad), cat_guard(), _cacheable(static=True) as mode:
        fakes = [_fake(mode, s) for s in specs]
        gm, _, _ = _for_inductor(gm, mode, fakes, lift=False)
        return _in_traced_layouts(gm, fakes)


def compile_symbolic(description: list, specs: list, dims: list[tuple[int, ...]], grad: bool) -> tuple[Any, Symbolic]:
    """Inductor's compile of a region (`_describe`'s `description`) with the sizes `dims` names symbolic,
    from fakes of `specs`' layouts (`_symbolic_fakes`), and what it assumes: what `Region` runs, and
    what a compile worker makes for torch's caches, both from the same graph and fakes (NOTE: [Compiles in
    the background])."""
    ops.fake_kernels()  # in a worker, which traced nothing
    gm = _rebuild(description)
    cuda = next((s.device for s in specs if isinstance(s, _TensorSpec) and s.device.type == "cuda"), None)
    # a new thread's current device is device 0, not the one the caller set (the loader is one)
    device = torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext()
    with (
        COMPILING,
        device,
        torch.set_grad_enabled(grad),
        cat_guard(),
        _for_every_size(),
        _cacheable(static=False) as mode,
    ):
        fakes = _symbolic_fakes(mode, specs, dims)
        fn = _compiled_symbolic(gm, mode, fakes)
    return fn, Symbolic.of(fn, fakes, specs)


def _for_every_size() -> contextlib.AbstractContextManager:
    """Inductor's options for a compile of symbolic sizes: none of its choices made by the size of a
    workload, so that one compile serves every size (NOTE: [Symbolic regions]).

    Inductor fuses a reduction along rows with one along columns of the same tensor (RMSNorm's backward:
    the input's gradient and the weight's) into one kernel, "mix-order reduction", but only above a size
    where it found the fused kernel faster, and with more rows than columns; asked at symbolic sizes,
    each check is a guard, and the two split a stream of lengths into three compiles. Its non-strict
    mode skips them: the fused kernel wherever the fusion applies, where Inductor would have kept the two
    apart on a small workload (under 5 Mi elements, which sits in L2) or one of fewer rows than twice
    its columns."""
    from torch._inductor import config

    if not hasattr(config.triton, "mix_order_reduction_non_strict_mode"):  # an Inductor without the fusion
        return contextlib.nullcontext()
    return config.patch({"triton.mix_order_reduction_non_strict_mode": True})


def _compiled_symbolic(gm: fx.GraphModule, mode: FakeTensorMode, fakes: list) -> Callable[..., Any]:
    """Inductor's compile of `gm` for `fakes` of symbolic sizes, called with the region's inputs, its
    outputs in the traced layouts at each call's sizes."""
    from torch._inductor.compile_fx import compile_fx

    gm, reads, sizes = _for_inductor(gm, mode, fakes, lift=True)
    hold = _held_to_traced_strides(gm, fakes, sizes, reads)  # reads gm, before Inductor rewrites it
    return hold(_reading_sizes(compile_fx(gm, fakes + sizes), reads))


def _in_traced_layouts(gm: fx.GraphModule, fakes: list) -> Callable[..., Any]:
    """Inductor's compile of `gm` for `fakes` of exact sizes, whose outputs have the strides the trace
    gave them.

    NOTE: [Outputs in the traced layouts]
    Inductor may lay out a graph's output otherwise than eager PyTorch and the trace did. It did so for
    a `cat` one of whose operands is empty, whose result it returned in the other operand's layout
    (Hugging Face's DynamicCache, written by a training forward, is `cat([empty, key.transpose(1, 2)])`:
    contiguous in eager, transposed compiled); such cats are now copies in eager's layout before
    Inductor sees them (NOTE: [Cats onto empty tensors]), but an output's layout stays Inductor's
    choice, and what follows holds it to the trace's. What reads an output laid out otherwise meets a
    layout its trace never saw: the region reading it compiles a second time for it, and with compiles in the background
    every step between the forward's compile and that second one ran the layer's backward as traced
    (HF's Llama called as HF documents it, each layer's backward); a model output
    so laid out differs from eager's (`.view` fails where eager's works), and an `as_strided` of it
    would read other elements. So the first call of a compile compares its outputs' strides with the
    trace's (the graph's values, exact here) and, where one differs, every call copies that output into
    the traced layout, which is the copy eager makes; the others cost nothing. A compile of symbolic sizes
    does the same at each new set of sizes it is called at: the traced strides are expressions in the
    sizes (`_held_to_traced_strides`), evaluated there."""
    from torch._inductor.compile_fx import compile_fx

    (results,) = (n.args[0] for n in gm.graph.nodes if n.op == "output")
    traced = _output_strides(results)  # read before Inductor, whose passes rewrite the graph in place
    return compile_fx(gm, fakes) if traced is None else _TracedLayouts(compile_fx(gm, fakes), traced)


def _output_strides(results: Any) -> list[tuple | None] | None:
    """The strides of a region graph's outputs as the trace laid them out (None: not a tensor); None for a
    graph of one output, not a region's (`_extract` makes tuples)."""
    if not isinstance(results, (tuple, list)):
        return None
    return [
        r.meta["val"].stride() if isinstance(r, fx.Node) and isinstance(r.meta.get("val"), torch.Tensor) else None
        for r in results
    ]


def _held_to_traced_strides(
    gm: fx.GraphModule, fakes: list, sizes: list, reads: list[tuple[int, str, int]]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """What holds Inductor's compile of `gm` (the copy `_for_inductor` made, its values in the compile's
    shape environment) from symbolic `fakes` to the traced strides at each call's sizes (NOTE: [Outputs in
    the traced layouts]): each stride is an expression in the symbols that the int inputs and the lifted
    `sizes` (read as `reads` says) give."""
    (results,) = (n.args[0] for n in gm.graph.nodes if n.op == "output")
    traced = _output_strides(results)
    if traced is None:
        return lambda fn: fn
    symbols = [(f.node.expr, k, "int", 0) for k, f in enumerate(fakes) if isinstance(f, torch.SymInt)]
    symbols += [(v.node.expr, *read) for v, read in zip(sizes, reads)]
    exprs = [None if t is None else tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in t) for t in traced]
    return lambda fn: _TracedLayouts(fn, exprs, symbols)


def _laid_apart(t: torch.Tensor, traced: tuple[int, ...] | None) -> bool:
    """Whether `t`'s elements lie otherwise in memory than strides `traced` put them (the stride of a
    dimension of size 1 places nothing; an empty tensor has nothing to place)."""
    if traced is None or t.numel() == 0 or len(traced) != t.dim():
        return False
    return any(n > 1 and a != b for n, a, b in zip(t.shape, t.stride(), traced))


class _TracedLayouts:
    """A compiled region whose outputs are copied into the traced strides where its own differ (NOTE:
    [Outputs in the traced layouts]). Of a compile of symbolic sizes the traced strides are expressions
    in `symbols` (each: the symbol, and the input, "int"/"size"/"stride"/"offset" and dimension it is
    read from), evaluated at each new set of sizes."""

    def __init__(self, fn: Callable[..., Any], traced: list[tuple | None], symbols: list[tuple] = ()) -> None:
        self.fn, self.traced, self.symbols = fn, traced, list(symbols)
        self.laid_apart: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}  # sizes -> copies to make

    @property
    def copied(self) -> list[int] | None:
        """The outputs laid out otherwise at the sizes met first (None: not yet called)."""
        first = next(iter(self.laid_apart.values()), None)
        return None if first is None else [k for k, _ in first]

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        at = tuple(args[k] if kind == "int" else _read(args[k], kind, d) for _, k, kind, d in self.symbols)
        copies = self.laid_apart.get(at)
        if copies is None:
            copies = self.laid_apart[at] = self._laid_apart(out, at)
        if not copies:
            return out
        out = list(out)
        for k, strides in copies:
            o = out[k]
            out[k] = torch.empty_strided(o.shape, strides, dtype=o.dtype, device=o.device).copy_(o)
        return out

    def _laid_apart(self, out: Any, at: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
        values = {symbol: v for (symbol, *_), v in zip(self.symbols, at)}
        copies = []
        for k, (o, traced) in enumerate(zip(out, self.traced)):
            strides = _evaluated(traced, values)
            if isinstance(o, torch.Tensor) and _laid_apart(o, strides):
                copies.append((k, strides))
        if copies:
            logs.log.info(
                "Inductor laid out %d outputs of a region otherwise than the trace (%s); each call copies them "
                "into the traced layout (NOTE: [Outputs in the traced layouts])",
                len(copies),
                ", ".join(f"strides {out[k].stride()} for {s}" for k, s in copies[:3]),
            )
        return copies


def _read(a: torch.Tensor, kind: str, d: int) -> int:
    return a.shape[d] if kind == "size" else a.stride(d) if kind == "stride" else a.storage_offset()


def _evaluated(strides: tuple | None, values: dict) -> tuple[int, ...] | None:
    """`strides` at the sizes `values` gives the symbols; None where one stays unknown."""
    if strides is None:
        return None
    out = []
    for d in strides:
        v = d.xreplace(values) if hasattr(d, "xreplace") else d
        if not (isinstance(v, int) or getattr(v, "is_Integer", False)):
            return None
        out.append(int(v))
    return tuple(out)


def _for_inductor(
    gm: fx.GraphModule, mode: FakeTensorMode, fakes: list, lift: bool
) -> tuple[fx.GraphModule, list[tuple[int, str, int]], list]:
    """A copy of `gm` for Inductor to compile from `fakes`, with every node's value (`meta["val"]`)
    computed anew in the compile's fake mode; with `lift`, taking after its inputs each symbol of its
    tensor inputs' sizes and strides that no int input gives, as an int; where each is read (input,
    "size"/"stride"/"offset", dimension); and those symbols.

    The values a region's nodes carry from the program belong to the program's shape environment:
    any pass of Inductor that read one and compared its size with a number would add that comparison
    to the program's guards (and could fix a symbolic program to one length), so none is handed over.

    The symbols are lifted because torch.compile hands Inductor its graphs that way, and
    Inductor's FX graph cache relies on it: it writes a compiled graph's guards in terms of its int
    inputs alone."""
    given = {f.node.expr for f in fakes if isinstance(f, torch.SymInt)}
    reads, sizes = [], []
    for k, f in enumerate(fakes):
        if lift and isinstance(f, torch.Tensor):
            for kind, values in (("size", f.shape), ("stride", f.stride()), ("offset", (f.storage_offset(),))):
                for d, v in enumerate(values):
                    if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol and v.node.expr not in given:
                        given.add(v.node.expr)
                        reads.append((k, kind, d))
                        sizes.append(v)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = g.placeholder(n.name)
    for j in range(len(sizes)):
        g.placeholder(f"size{j}")
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, env.__getitem__)
            env[n].meta = {}
    copy = fx.GraphModule(gm, g)
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(copy, mode).propagate_dont_convert_inputs(*fakes, *sizes)
    if _cats_onto_empty_as_copies(copy):
        FakeTensorProp(copy, mode).propagate_dont_convert_inputs(*fakes, *sizes)
    return copy, reads, sizes


def _cats_onto_empty_as_copies(gm: fx.GraphModule) -> bool:
    """Each `cat` of one operand and empty ones whose value (eager's) is contiguous and the operand is
    not: a contiguous copy of the operand instead. Whether any was.

    NOTE: [Cats onto empty tensors]
    Inductor drops a `cat`'s empty operands and, where one operand is left, returns a copy of it in
    its own layout (`clone()`), where eager PyTorch lays the result out contiguously. A writing cache
    (Hugging Face's DynamicCache: `cat([empty, key.transpose(1, 2)])`) then comes out transposed, and
    a `.view` of it in the same region, which eager runs, fails inside Inductor's compile ("Cannot view
    a tensor with shape ..."), plain `torch.compile` alike. The copy made here is the one Inductor
    would make, in eager's layout. Sizes are compared as the compile's fakes give them: a symbolic
    size is never empty here (the shape environment makes 0 and 1 constants)."""
    rewritten = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.cat.default:
            continue
        tensors, dim = n.args[0], (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
        vals = [t.meta.get("val") for t in tensors]
        out = n.meta.get("val")
        if not isinstance(out, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in vals):
            continue
        dim = dim % out.dim() if out.dim() else 0

        def empty(v: torch.Tensor) -> bool:
            size = v.shape[0] if v.dim() == 1 else (v.shape[dim] if dim < v.dim() else None)
            return isinstance(size, int) and size == 0

        left = [t for t, v in zip(tensors, vals) if not empty(v)]
        if len(left) != 1:
            continue
        kept = left[0].meta["val"]
        if _same_sizes(kept.stride(), out.stride()) or not _same_sizes(out.stride(), _contiguous_strides(out.shape)):
            continue  # already eager's layout, or a layout other than contiguous (left to Inductor)
        with gm.graph.inserting_before(n):
            copied = gm.graph.call_function(
                torch.ops.aten._to_copy.default,
                (left[0],),
                {"dtype": out.dtype, "memory_format": torch.contiguous_format},
            )
        n.replace_all_uses_with(copied)
        gm.graph.erase_node(n)
        rewritten = True
    if rewritten:
        gm.recompile()
    return rewritten


def _contiguous_strides(shape: Any) -> list:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * (1 if isinstance(size, int) and size == 0 else size)
    return strides[::-1]


def _same_sizes(a: Any, b: Any) -> bool:
    """Sizes or strides equal as written (symbolic ones as expressions): no guard is added."""

    def expr(v: Any) -> Any:
        return v.node.expr if isinstance(v, torch.SymInt) else v

    return len(a) == len(b) and all(expr(x) == expr(y) for x, y in zip(a, b))


def _reading_sizes(fn: Any, reads: list[tuple[int, str, int]]) -> Callable[..., Any]:
    """`fn`, called with the region's inputs and then the sizes `reads` names (`_for_inductor`)."""
    if not reads:
        return fn

    def call(*args: Any) -> Any:
        return fn(*args, *(_read(args[k], kind, d) for k, kind, d in reads))

    return call


def _symbolic_fakes(mode: FakeTensorMode, specs: list, dims: list[tuple[int, ...]]) -> list:
    """Fakes of inputs of `specs`' layouts (`_spec`) in `mode`: dimension d of tensor input k a symbol where
    `dims[k]` holds d, its strides and offset symbols where they are not the sizes' products, an int input
    whose `dims` is not empty a symbolic int. Equal sizes get one symbol (the way torch.compile makes them),
    which the guards then check. Made from layouts, which a worker has, they are the same in any process
    (torch names a symbol by its source)."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    env = mode.shape_env
    out = []
    for k, (spec, varying) in enumerate(zip(specs, dims)):
        source = LocalSource(f"in{k}")
        if isinstance(spec, _TensorSpec):
            kinds = [DimDynamic.DUCK if d in varying else DimDynamic.STATIC for d in range(len(spec.shape))]
            extent = 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride)) if all(spec.shape) else 0
            storage = torch.empty((spec.offset + extent,), dtype=spec.dtype, device="meta")
            layout = storage.as_strided(spec.shape, spec.stride, spec.offset)
            context = StatelessSymbolicContext(dynamic_sizes=kinds)
            sizes, strides, offset = env.create_symbolic_sizes_strides_storage_offset(
                layout, source, symbolic_context=context
            )
            with mode:
                fake = torch.empty_strided(sizes, strides, dtype=spec.dtype, device=spec.device)
                if spec.offset:  # a view at that offset into a storage that holds it, as `_fake` makes one
                    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides)) if all(spec.shape) else 0
                    base = torch.empty((offset + extent,), dtype=spec.dtype, device=spec.device)
                    fake = base.as_strided(sizes, strides, offset)
            out.append(fake.requires_grad_(spec.requires_grad) if spec.requires_grad else fake)
        elif varying and isinstance(spec, int):
            out.append(
                env.create_symintnode(env.create_symbol(spec, source, DimDynamic.DUCK), hint=spec, source=source)
            )
        else:
            out.append(spec)
    return out


def in_background(option: bool | None, device: torch.device, cuda_graph: bool) -> bool:
    """Whether regions compile in worker processes (`CompileOptions.background_compile`, resolved)."""
    return option if option is not None else device.type == "cuda" and not cuda_graph


def workers_for(device: torch.device) -> Callable[[], background.Workers | None]:
    """What finds the workers that compile regions for `device` (NOTE: [Compiles in the background]),
    starting them where none run; each warms up with a compile on that device."""
    return functools.partial(background.pool, warm_up=(__name__, "warm_up", (str(device),)))


def start_compile_workers(device: torch.device) -> None:
    """Start Inductor's pool of compile workers now, in the background, for regions compiled in this
    process later.

    Inductor compiles a region's kernels in a pool of worker processes, but uses the pool only once it
    has started; until then each kernel compiles in this process, one after another. torch.compile
    starts the pool as soon as a model is first compiled; regions call Inductor directly, so fbmt
    starts it while it traces. Only kernels for CUDA (Triton) use the pool; Inductor itself declines
    where the pool cannot serve (no Triton, compile threads set to 1, TORCH_WARM_POOL=0)."""
    if device.type == "cuda":
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()


@contextlib.contextmanager
def _cacheable(static: bool = True) -> Iterator[FakeTensorMode]:
    """Where a region compiles: a tracing context whose fake mode has a shape environment, which
    torch's FX graph and AOTAutograd caches need to key a graph (without one they bypass the cache and
    every run compiles every region again). Its fakes are made by the caller: of static shapes for
    a region compiled for exact sizes (given real inputs, the mode would make their sizes symbolic)."""
    from torch._guards import TracingContext, tracing
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=static)
    with tracing(TracingContext(mode)):
        yield mode


# The torch releases (major, minor), first and last, whose Inductor the cat guard below was written
# and tested against: it replaces an entry of Inductor's private lowering table and reads its IR
# classes, which change between releases. Outside the range it does nothing, and says so once.
CAT_GUARD_TORCH = ((2, 11), (2, 15))
# Added to the key of torch's FX graph and AOTAutograd caches while the guard lowers: they key a region by
# its graph and Inductor's options, not by a lowering patched in, so kernels compiled by another version of
# the guard (or without it) would be loaded as if they were its own. Change it whenever the guard changes.
CAT_GUARD_TAG = "fbmt-cat-guard-2"


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
    with two stores. A cat that one pointwise op reads (a rotary embedding's) keeps Inductor's
    choice: inlined into its reader, it is never written at all. But a cat that two or more ops
    read (through views) is a ConcatKernel even where they are pointwise: with FP8 products
    (NOTE: [FP8 products]) the merged gradient is read by its amax and by a cast per layout, and
    inlined into each of those kernels its expressions, and the reads they share, were computed
    once per reader. Inductor's own lowering is called for every other cat, and whenever this
    check cannot tell (with a warning, once)."""
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

    def readers(node: fx.Node) -> int:
        """The ops that read a value, through its views."""
        return sum(
            readers(u) if isinstance(u.target, torch._ops.OpOverload) and lowering.is_view(u.target) else 1
            for u in node.users
        )

    def cat(inputs: Any, dim: int = 0) -> Any:
        try:
            node = V.current_node
            materialized = node is not None and (
                not any(lowering.is_pointwise_use(u) for u in node.users) or readers(node) > 1
            )
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
        with _tagged(CAT_GUARD_TAG):
            yield
    finally:
        lowering.lowerings[torch.ops.aten.cat.default] = original


def _tagged(tag: str) -> contextlib.AbstractContextManager:
    """torch's compile caches keyed with `tag` too, after the user's own tag (where this torch has one)."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return contextlib.nullcontext()
    return config.patch(cache_key_tag=f"{config.cache_key_tag}|{tag}" if config.cache_key_tag else tag)


def _pure(n: fx.Node, current: set[fx.Node]) -> bool:
    if n.target is operator.getitem:
        return n.args[0] in current  # unpacking a multi-output op of the same region
    if _size_arithmetic(n):  # a program of symbolic sizes: no cut between an op and the size it reads
        return True
    return isinstance(n.target, torch._ops.OpOverload) and (ops.pure(n) or _attention_without_dropout(n))


def _attention_without_dropout(n: fx.Node) -> bool:
    """An attention kernel whose dropout is 0: its schema says random (it may draw a dropout mask), but
    this call draws nothing, so it belongs to the region around it (Inductor calls the same kernel)."""
    if ops.op_name(n.target) not in ops.ATTENTION_FORWARD:
        return False
    arguments = n.target._schema.arguments
    at = next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None)
    if at is None:
        return False
    if at < len(n.args):
        return n.args[at] == 0
    if "dropout_p" in n.kwargs:
        return n.kwargs["dropout_p"] == 0
    return arguments[at].has_default_value() and arguments[at].default_value == 0


def _size_arithmetic(n: fx.Node) -> bool:
    """A size computed from sizes (`sym_size`, `s0 * 4`): pure, and no work of its own."""
    return ops.pure(n) and isinstance(n.meta.get("val"), torch.SymInt)


def split_regions(
    gm: fx.GraphModule, cache: RegionCache, varying: set[fx.Node] = frozenset(), send: bool = True
) -> fx.GraphModule:
    """`gm` with each run of pure compute replaced by a Region (see NOTE: [Regions]). `varying`: inputs of
    `gm` whose strides may differ between calls (a tangent given as one expanded zero, NOTE: [Unused
    outputs' gradients]; a call's tensor): a region reading one, or a view of one, checks its inputs' layout
    every call."""
    g = gm.graph
    order = ops.node_order(g)
    for n in list(g.nodes):  # unpacking stays next to its op, in its region, wherever a schedule put a collective
        if isinstance(n.meta.get("val"), (tuple, list)):
            at = n
            for u in sorted((u for u in n.users if u.target is operator.getitem), key=order.__getitem__):
                at.append(u)
                at = u
    _join_cheap_runs(g)
    _join_cheap_tails(g)
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
    owner = _owners(g)
    runs = [part for run in runs for part in _apart_from_layers(run, owner)]
    # views and size arithmetic alone cost nothing eagerly
    runs = [r for r in runs if not all(ops.costs_nothing(n) or _size_arithmetic(n) for n in r)]

    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    start_of = {r[0]: r for r in runs}
    inside = {n for r in runs for n in r}
    laid_out = set(varying)  # those inputs, and the views of them made outside a region
    for n in g.nodes:
        if n not in inside and ops.is_view(n) and n.args[0] in laid_out:
            laid_out.add(n)
    root = nn.Module()
    for n in g.nodes:
        if n in start_of:
            run = start_of[n]
            ins, outs, sub, structure = _extract(run, cache)
            name = f"region{len(root._modules)}"
            dims = [_varying(i) for i in ins]
            root.add_module(
                name,
                Region(
                    sub,
                    structure,
                    cache,
                    dims,
                    recheck=any(i in laid_out for i in ins),
                    send=send,
                    where=_where(run),
                ),
            )
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


# A run this short, with no matrix product, attention or convolution, is worth no cut of its own.
CHEAP_RUN = 24


def _join_cheap_runs(g: fx.Graph) -> None:
    """Move each collective (a start or a wait) that ends a cheap run of pure compute to the run's start,
    where it does not read the run, so the run joins the region after it (NOTE: [Regions])."""
    run: list[fx.Node] = []  # the pure nodes since the last cut
    members: set[fx.Node] = set()
    for n in list(g.nodes):
        if _pure(n, members):
            run.append(n)
            members.add(n)
        elif (
            run
            and comm.lowered(n.target) is not None
            and not any(a in members for a in n.all_input_nodes)
            and _cheap(run)
        ):
            run[0].prepend(n)  # the run stays open: the next collective may move over it too
        else:
            run, members = [], set()


def _join_cheap_tails(g: fx.Graph) -> None:
    """Move the collectives that stand between a region and a cheap run after it (where the run reads
    none of them) to the run's end, so the run joins the region before it (NOTE: [Regions of repeated
    blocks]): a layer's backward ends in a few cheap ops (its norm weight's gradient, the flattening for
    the reduce-scatter, which then cuts) after the prefetch of an earlier layer's weights and the wait for
    a later layer's reduce-scatter, which the first layers' backwards have no reason to issue."""
    nodes = list(g.nodes)
    at = 0
    while at < len(nodes):
        if not (comm.lowered(nodes[at].target) is not None and at > 0 and _pure(nodes[at - 1], set())):
            at += 1
            continue
        lead = []  # the collectives after a region
        while at < len(nodes) and comm.lowered(nodes[at].target) is not None:
            lead.append(nodes[at])
            at += 1
        run: list[fx.Node] = []
        members: set[fx.Node] = set()
        while at < len(nodes) and _pure(nodes[at], members):
            run.append(nodes[at])
            members.add(nodes[at])
            at += 1
        led = set(lead)
        if run and _cheap(run) and not any(a in led for n in run for a in n.all_input_nodes):
            for n in reversed(lead):  # in their order, right after the run
                run[-1].append(n)


def _apart_from_layers(run: list[fx.Node], owner: dict[fx.Node, str | None]) -> list[list[fx.Node]]:
    """The run, with the work before its first node of a repeated block and after its last (a model's
    prologue before its first layer, its final norm after the last) as runs of their own (NOTE: [Regions
    of repeated blocks]); an op and its unpacking stay together."""
    marks = [i for i, n in enumerate(run) if _repeated(owner[n])]
    # a node of no block that does work is the model's own code (the embeddings' sum before the first layer)
    marks = [i for i in marks if meta.block(run[i]) or ops.costs_nothing(run[i]) or _size_arithmetic(run[i])]
    if not marks:
        return [run]
    first, last = marks[0], marks[-1] + 1
    while 0 < first and run[first].target is operator.getitem:
        first -= 1
    while last < len(run) and run[last].target is operator.getitem:
        last += 1
    return [part for part in (run[:first], run[first:last], run[last:]) if part]


def _owners(g: fx.Graph) -> dict[fx.Node, str | None]:
    """Each node's block, or for a node of no block (a view of gathered weights, a size) that of the next
    node that has one: what it is computed for."""
    owner: dict[fx.Node, str | None] = {}
    following = None
    for n in reversed(g.nodes):
        following = meta.block(n) or following if n.op == "call_function" else following
        owner[n] = following
    return owner


def _repeated(block: str | None) -> bool:
    """A block of a list of layers (`layers.3`), whose region each copy shares."""
    return block is not None and block.rpartition(".")[2].isdigit()


def _cheap(run: list[fx.Node]) -> bool:
    work = [n for n in run if not (ops.costs_nothing(n) or _size_arithmetic(n))]
    return len(work) <= CHEAP_RUN and not any(ops.flops(n) for n in work)  # products, attention, convolution


def _varying(n: fx.Node) -> tuple[int, ...]:
    """The dimensions of a region input whose size varies between calls (a program of symbolic
    sizes); for an int input `(0,)` if its value does."""
    v = n.meta.get("val")
    if isinstance(v, torch.SymInt):
        return () if v.node.expr.is_number else (0,)
    if isinstance(v, torch.Tensor):
        return tuple(d for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt) and not s.node.expr.is_number)
    return ()


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
