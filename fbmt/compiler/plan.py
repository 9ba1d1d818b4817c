"""`Plan`: the compile options resolved once, for a model's layout: what the pipeline gives the passes.

NOTE: [Plan]
`CompileOptions` is what the user wrote, each value checked where it is declared. A `Plan` is what it
means for one model, worked out once when the model is compiled (`Plan.of`): every block's ZeRO level
and recompute policy where a name sets one (`blocks={path: {...}}`, BMTrain's `Block`, a replayed
`Schedule`), the strategy with its keyword arguments checked against its signature (and `prefetch=`
folded in as its `depth`), the wire of the gradient reductions, and what the pipeline itself reads
(disabled passes, checks, the dump folder, the backend). The pipeline binds each pass's options from
the plan (`pipeline.passes`); nothing downstream reads `CompileOptions` again or checks a value a
second time. `remat="auto"` is resolved per program, since it prices the traced program: the search
returns a `RematChoice` and `with_choice` gives the plan the passes then run with (every block's
policy, and the prefetch depth where the search chose one).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fbmt import job
from fbmt.compiler.decisions import Schedule
from fbmt.compiler.options import CompileOptions
from fbmt.compiler.passes import REQUIRED, STRATEGIES
from fbmt.compiler.passes.remat import RematChoice
from fbmt.compiler.passes.schedule import strategy_options
from fbmt.compiler.pipeline import PASS_NAMES


@dataclass(frozen=True)
class Plan:
    """The options of one compiled model, resolved (NOTE: [Plan])."""

    world_size: int
    zero: int  # every block's ZeRO level but those named in zero_per_block
    zero_per_block: dict[str, int]  # blocks whose level is set by name
    remat: str  # every block's recompute policy but those in remat_per_block ("auto": chosen per program)
    remat_per_block: dict[str, str]  # blocks whose policy is set by name, or by a replayed Schedule
    grad_reduce: str
    reduce_dtype: torch.dtype | None
    narrow_wire: bool  # resolved: the option, else whether every rank is on one node
    offload: bool  # the shards live in host memory (NOTE: [Offload])
    strategy: str | Schedule
    strategy_options: dict[str, Any]  # its keyword arguments, checked against its signature
    depth_free: bool  # the strategy takes a depth that neither `prefetch=` nor its options set
    memory_budget: int | None
    cost_model: Any  # what remat="auto" prices programs with (None: the search's fixed default)
    disable: tuple[str, ...]
    checks: bool
    dump_dir: str | None
    backend: str
    fp8: str | None  # the products' FP8 recipe (NOTE: [FP8 products])
    chosen: RematChoice | None = field(default=None)  # remat="auto"'s choice for the program at hand

    @classmethod
    def of(cls, options: CompileOptions, world_size: int) -> Plan:
        """Resolve `options` for a model compiled for `world_size` ranks; a strategy option that
        its signature does not take is an error here, when the model is compiled."""
        o = options
        for name in o.disable:
            if name not in PASS_NAMES:
                raise ValueError(
                    f"fbmt.compile(disable={o.disable!r}): no pass named {name!r}; passes are {list(PASS_NAMES)}"
                )
            if name in REQUIRED:
                raise ValueError(f"fbmt.compile(disable=...): pass {name!r} cannot be disabled; the runtime needs it")
        named = {path: dict(policy or {}) for path, policy in o.blocks.items()} if isinstance(o.blocks, Mapping) else {}
        zero_per_block = {path: p["zero"] for path, p in named.items() if "zero" in p}
        remat_per_block = {path: p["remat"] for path, p in named.items() if "remat" in p}
        for path, p in named.items():  # a block whose policy sets one of the two takes the default for the other
            if p:
                zero_per_block.setdefault(path, o.zero)
                remat_per_block.setdefault(path, o.remat)
        strategy, given = o.schedule, {}
        if isinstance(strategy, (tuple, list)):
            strategy, given = strategy
        if isinstance(strategy, Schedule):
            remat_per_block.update(strategy.remat)  # a replayed schedule sets every block's policy
            options_, depth_free = strategy_options("prefetch", {}, prefetch=o.prefetch), False
        else:
            options_ = strategy_options(strategy, given, prefetch=o.prefetch)
            depth_free = "depth" in inspect.signature(STRATEGIES[strategy]).parameters and "depth" not in options_
        narrow = o.narrow_wire if o.narrow_wire is not None else job.ranks_per_node(world_size) >= world_size
        return cls(
            world_size=world_size,
            zero=o.zero,
            zero_per_block=zero_per_block,
            remat=o.remat,
            remat_per_block=remat_per_block,
            grad_reduce=o.grad_reduce,
            reduce_dtype=o.reduce_dtype,
            narrow_wire=narrow and not o.offload,
            offload=o.offload,
            strategy=strategy,
            strategy_options=options_,
            depth_free=depth_free,
            memory_budget=o.memory_budget,
            cost_model=o.cost_model,
            disable=tuple(o.disable),
            checks=bool(o.checks),
            dump_dir=o.dump_dir,
            backend=o.backend,
            fp8=o.fp8,
        )

    def with_depth(self, depth: int) -> Plan:
        """This plan with the strategy's prefetch `depth` set (remat="auto" tries several)."""
        return dataclasses.replace(self, strategy_options={**self.strategy_options, "depth": depth}, depth_free=False)

    def with_choice(self, choice: RematChoice) -> Plan:
        """This plan with remat="auto"'s choice: every block's policy, and the depth where it chose one."""
        plan = self.with_depth(choice.depth) if choice.depth is not None else self
        return dataclasses.replace(plan, chosen=choice)
