"""`CompileOptions`: every option of `fbmt.compile`, declared once and validated once.

`fbmt.compile(model, **options)` takes exactly these fields as keywords (its signature is made from
them). They are what the user wrote; `fbmt.compiler.plan.Plan` is what they mean for one model,
resolved once (NOTE: [Plan]), and the pipeline hands each pass what it reads from the plan.
docs/options.md explains them at length.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fbmt import flags
from fbmt.compiler.decisions import Schedule
from fbmt.compiler.passes import FP8_RECIPES, POLICIES

BACKENDS = ("eager", "inductor")
Blocks = Sequence[str] | Mapping[str, Mapping[str, Any]] | None


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    zero: int = 3
    """3: gather parameters again for the backward; 2: keep them gathered from forward to backward."""
    remat: str = "block"
    """"block": save only block inputs and recompute each block in the backward; "selective": save
    matmul and attention outputs, recompute the cheap ops between them; "mincut": recompute only the
    cheap ops whose recompute saves memory (a minimum cut, as torch.compile's partitioner); "none":
    save all; "auto": per block, whichever of these fits `memory_budget` at the least recompute."""
    memory_budget: int | None = None
    """With remat="auto": the most bytes the step may hold beyond its persistent state (shards,
    gradients, optimizer), per rank, as `fbmt.simulate` predicts its peak (NOTE: [Auto recompute]);
    where neither `prefetch` nor the schedule's options set a depth, auto chooses that too."""
    cost_model: Any = None
    """With remat="auto": the `fbmt.sim.Machine` (or the path of a profile `fbmt.calibrate` saved) the
    search prices candidate programs with. None: `fbmt.sim.H200`, fixed, so every rank on every host
    compiles the same program whatever profiles its cache holds."""
    schedule: str | tuple[str, Mapping[str, Any]] | Schedule = "prefetch"
    """A registered strategy by name (`fbmt.register_strategy`; built in: "prefetch", "none",
    "fsdp2", "bmtrain", "greedy", "bucket"), or `(name, {option: value})` to set its options, e.g.
    `("greedy", {"memory_bound": 2**30})`; or an `fbmt.Schedule` to replay (its blocks' recompute
    policies too)."""
    prefetch: int | None = None
    """How many blocks ahead the strategy issues parameter gathers: its option `depth` (None: the
    strategy's own default, 1 for "prefetch"; with remat="auto", the depth of the fastest simulated
    step within the budget, of 1, 2 and 3)."""
    blocks: Blocks = None
    """Module paths to use as blocks instead of the children of repeated ModuleLists; or a dict from
    path to that block's own policy, e.g. `{"layers.0": {"remat": "none", "zero": 2}, "layers.1": {}}`."""
    grad_reduce: str = "mean"
    """How gradients combine over ranks: "mean" (as one big batch) or "sum" (BMTrain's convention)."""
    param_dtype: torch.dtype | None = None
    """Mixed precision: gather and compute with floating parameters in this dtype (shards, gradients
    and the optimizer keep the stored dtype); floating inputs are cast to it."""
    reduce_dtype: torch.dtype | None = None
    """Mixed precision: reduce gradients in this dtype (default: the stored dtype, e.g. fp32)."""
    narrow_wire: bool | None = None
    """Gradients reduced in a wider dtype than their own (bf16 summed in fp32) travel in their own,
    through an all-to-all, and are summed by the receiver (NOTE: [Narrow wire]). None: where every
    rank is on one node ($FBMT_NARROW_WIRE=0/1 sets the default)."""
    backend: str = "eager"
    """"eager": run the aten graphs op by op; "inductor": compile each compute region between
    collectives with Inductor, once per distinct region (identical blocks share it)."""
    background_compile: bool | None = None
    """backend="inductor": compile the regions in worker processes while the first steps run their ops
    as traced (what backend="eager" runs), and run them compiled from the first step that begins after
    their compiles are done (NOTE: [Compiles in the background]): the first step starts seconds after
    tracing instead of after Inductor. The steps before and after the switch round differently (eager
    PyTorch's and Inductor's kernels), so a run is not bitwise repeatable; `model.wait_compiled()`
    waits for every compile. None: on for CUDA (off under cuda_graph, whose graphs would capture the
    traced ops); on a CPU the workers would take the cores the step runs on. $FBMT_COMPILE_WORKERS
    sets how many workers (0: none)."""
    fp8: str | None = None
    """The blocks' matrix products in FP8 with scales computed from each step's values (NOTE: [FP8
    products]): "tensorwise" (one scale per operand; values e4m3, gradients e5m2) or "rowwise" (a scale
    per row and column, all e4m3). Needs a GPU with FP8 products (compute capability 8.9 or later) or a
    CPU (slow, for tests). None: off."""
    offload: bool = False
    """Keep the shards, their gradients and so the optimizer's state in host memory (pinned), as
    FSDP2's CPUOffloadPolicy and ZeRO-Offload do (NOTE: [Offload]): each gather copies its group's
    shard to the device first, each reduction copies the shard's gradient back; the schedule overlaps
    the copies as it overlaps the collectives. Step the optimizer on the host:
    `fbmt.optim.AdamOffloadOptimizer(model.parameters())` updates the shards in place with fbmt's C++
    Adam. Not with cuda_graph; gradients always travel in the reduce dtype (no narrow wire)."""
    cuda_graph: bool = False
    """Replay each training step's forward and backward as CUDA graphs after two warm-up calls (CUDA
    only; NOTE: [CUDA graphs]). Needs fixed input shapes and each backward before the next forward."""
    dynamic: bool = True
    """When a call's input sizes differ from a compiled program's only in some dimensions (a new
    sequence length), compile one program with those dimensions symbolic, which then serves every
    size it admits (NOTE: [Dynamic sizes]). False: a program for every input shape. Off under
    cuda_graph, whose replays need fixed shapes."""
    disable: tuple[str, ...] = ()
    """Pass names to skip (to bisect a problem); "shard" cannot be skipped."""
    checks: bool | None = None
    """Verify the program after every pass (always on in tests). None: $FBMT_CHECKS."""
    dump_dir: str | None = None
    """Write the program after every pass to this folder, for `diff`. None: $FBMT_DUMP_DIR."""
    world_size: int | None = None
    """Compile for this many ranks (default: the process group's): one process can build and inspect
    the program of any world size with `model.trace(*inputs)`; running it needs that many ranks."""
    device: torch.device | str | None = None
    """Where the shards live and the program runs (default: this rank's device)."""
    init_fn: Callable[[nn.Module], None] | None = None
    """How to initialize a model built on the meta device, module by module (default: a Hugging Face
    model's `_init_weights`, else each module's `reset_parameters()`)."""
    weights: str = "rank0"
    """What the ranks' weights must be when the model is compiled (NOTE: [Ranks' weights]): "rank0":
    where a rank's differ from rank 0's (pretrained weights loaded on rank 0 only, ranks seeded
    apart), every rank takes rank 0's, as DDP's start-up broadcast does, and fbmt says which differed;
    "check": that is an error naming the first parameter that differs. A model built on `meta` is
    initialized alike on every rank, and is not compared."""
    cache_dir: str | os.PathLike | bool | None = None
    """Where compiled programs are kept between runs (NOTE: [Compile cache]): a later run of the same
    job loads its programs instead of tracing. None or True: $FBMT_CACHE_DIR, else
    ~/.cache/fbmt/compile; False: no cache. `python -m fbmt.cache` lists and clears it."""
    broadcast_buffers: bool = True
    """As DDP's option of that name: before each training call (grad enabled) whose program updates
    buffers (BatchNorm's running statistics), every rank takes rank 0's values of those buffers, so
    the ranks' buffers never drift apart. False: each rank keeps its own (as DDP with False)."""

    def __post_init__(self) -> None:
        blocks = self.blocks
        if isinstance(blocks, str):
            raise TypeError(f"fbmt.compile(blocks={blocks!r}): expected a list of module paths or a dict")
        if isinstance(blocks, Mapping):
            for path, policy in blocks.items():
                unknown = set(policy or {}) - {"zero", "remat"}
                if unknown:
                    raise ValueError(
                        f"fbmt.compile(blocks={{{path!r}: ...}}): unknown policy keys {sorted(unknown)}; "
                        "a block's policy may set 'zero' and 'remat'"
                    )
        strategy = self.schedule
        if isinstance(strategy, (tuple, list)):
            if len(strategy) != 2 or not isinstance(strategy[0], str) or not isinstance(strategy[1], Mapping):
                raise TypeError(
                    f"fbmt.compile(schedule={strategy!r}): expected a strategy's name, (name, {{option: value}}) "
                    "or an fbmt.Schedule"
                )
            strategy = strategy[0]
        if not isinstance(strategy, (str, Schedule)):
            raise TypeError(
                f"fbmt.compile(schedule={strategy!r}): expected a strategy's name, (name, {{option: value}}) "
                "or an fbmt.Schedule"
            )
        resolved = dict(
            blocks=dict(blocks) if isinstance(blocks, Mapping) else tuple(blocks) if blocks is not None else None,
            disable=tuple(self.disable),
            checks=flags.CHECKS.get() if self.checks is None else bool(self.checks),
            dump_dir=self.dump_dir or flags.DUMP_DIR.get() or None,
            narrow_wire=flags.NARROW_WIRE.get() if self.narrow_wire is None else self.narrow_wire,
        )
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        self._validate()

    @property
    def block_paths(self) -> list[str] | None:
        """The module paths `blocks` names (None: the layout's own rule decides the blocks)."""
        return list(self.blocks) if self.blocks is not None else None

    def _validate(self) -> None:
        named = self.blocks.items() if isinstance(self.blocks, Mapping) else ()
        policies = [(path, (p or {}).get("zero", self.zero), (p or {}).get("remat", self.remat)) for path, p in named]
        for path, zero, remat in [("", self.zero, self.remat), *policies]:
            where = f" for block '{path}'" if path else ""
            if zero not in (2, 3):
                raise ValueError(
                    f"fbmt.compile(zero={zero!r}){where}: expected 3 (re-gather for the backward) or 2 (keep gathered)"
                )
            allowed = POLICIES + ("auto",) if not path else POLICIES
            if remat not in allowed:
                raise ValueError(f"fbmt.compile(remat={remat!r}){where}: expected one of {allowed}")
        if (self.remat == "auto") != (self.memory_budget is not None):
            raise ValueError(
                f"fbmt.compile(remat={self.remat!r}, memory_budget={self.memory_budget!r}): remat='auto' chooses "
                "each block's recompute to fit memory_budget (bytes per rank); give both, or neither"
            )
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int) or self.memory_budget <= 0):
            raise ValueError(f"fbmt.compile(memory_budget={self.memory_budget!r}): expected a positive number of bytes")
        if self.prefetch is not None and (not isinstance(self.prefetch, int) or self.prefetch < 1):
            raise ValueError(f"fbmt.compile(prefetch={self.prefetch!r}): must be a whole number, at least 1")
        if self.weights not in ("rank0", "check"):
            raise ValueError(f"fbmt.compile(weights={self.weights!r}): expected 'rank0' or 'check'")
        if self.grad_reduce not in ("mean", "sum"):
            raise ValueError(f"fbmt.compile(grad_reduce={self.grad_reduce!r}): expected 'mean' or 'sum'")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fbmt.compile(fp8={self.fp8!r}): expected one of {FP8_RECIPES} or None")
        if self.backend not in BACKENDS:
            raise ValueError(f"fbmt.compile(backend={self.backend!r}): expected one of {BACKENDS}")
        if self.background_compile and self.backend != "inductor":
            raise ValueError(
                f"fbmt.compile(background_compile=True, backend={self.backend!r}): only backend='inductor' compiles "
                "anything; pass backend='inductor', or leave background_compile unset"
            )
        if self.background_compile and self.cuda_graph:
            raise ValueError(
                "fbmt.compile(background_compile=True, cuda_graph=True): the CUDA graphs would capture the regions "
                "as traced, before their compiles are done; leave background_compile unset (off under cuda_graph)"
            )
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"fbmt.compile({name}={dtype!r}): expected a floating-point torch.dtype")
        if self.offload and self.cuda_graph:
            raise ValueError(
                "fbmt.compile(offload=True, cuda_graph=True): a CUDA graph replays device memory it captured, and "
                "offloaded shards live in host memory; choose one of them"
            )
        if self.world_size is not None and (not isinstance(self.world_size, int) or self.world_size < 1):
            raise ValueError(f"fbmt.compile(world_size={self.world_size!r}): expected a positive number of ranks")

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> CompileOptions:
        """`CompileOptions(**options)`, with an unknown name as an error that lists the known ones."""
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(
                f"fbmt.compile: unknown option(s) {unknown}; the options are {known} "
                "(fbmt.CompileOptions documents each)"
            )
        return cls(**options)
