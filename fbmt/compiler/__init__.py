"""The compiler: a plain module in, a ZeRO-sharded, recomputing, overlapped module out.

    trace.py          the module's forward and backward, traced into one aten-level fx graph
    program.py        the IR: Program (graph + roles + layout + the passes' records), printing
    meta.py           a node's facts (phase, block, group, ...), read and written through functions
    layout.py         blocks, flat groups and shard geometry, planned from the module tree
    objects.py        objects that hold tensors in a call (a Hugging Face cache)
    collectives/      one row per collective kind: IR node, implementation, reference, cost, probe
    ops/              per-op tables (aliasing, effects, FLOPs), recording ops, graph helpers
    passes/           one file a pass, the runner, the schedule strategies
    runtime/          partition, autograd, Inductor regions, CUDA graphs, shards, the reference executor
    decisions.py      fbmt.Schedule: a program's decisions as data (print, JSON, diff, replay)
    options.py        CompileOptions; plan.py: the options resolved once (Plan)
    pipeline.py       trace -> passes -> partition -> regions
    module.py         CompiledModule: a program per input signature, the call, state dicts
    cache.py          the compile cache: programs kept on disk between runs, keyed by what decides them
    agreement.py      every call: the ranks run the same program, or fail saying where they part
    owners.py         what compile took over (placeholders, shards' groups), kept beside the objects
    api.py            compile_module

It imports nothing of fbmt's integrations or tools (tests/test_layers.py): they build on the names
below, and on the public names of `collectives`, `ops`, `passes` and `meta`. It takes what it cannot
know as arguments: remat="auto"'s search and cost model, the class of the module it returns, an
initializer for a model built on `meta`.
"""

from fbmt.compiler import cache as compile_cache
from fbmt.compiler import collectives, meta, ops, passes
from fbmt.compiler.api import compile_module
from fbmt.compiler.decisions import Schedule
from fbmt.compiler.host_calls import HostFunction
from fbmt.compiler.host_calls import register as register_host_function
from fbmt.compiler.layout import FlatGroup, Layout, ParamSlot, copy_into_shard, local_range, plan_layout
from fbmt.compiler.meta import BWD, FWD
from fbmt.compiler.module import CompiledModule
from fbmt.compiler.options import CompileOptions
from fbmt.compiler.owners import Moved, Placeholder, group_of, moved_into, moved_name, replaced
from fbmt.compiler.pipeline import PASS_NAMES, PIPELINE, Search
from fbmt.compiler.pipeline import passes as pipeline_passes
from fbmt.compiler.plan import Plan
from fbmt.compiler.program import Note, PassRecord, Program, Role
from fbmt.compiler.runtime.autograd import Routes
from fbmt.compiler.runtime.partition import Executable, take
from fbmt.compiler.runtime.unsynced import unreduced
from fbmt.compiler.trace import TraceError, register_trace_hint, tracing

__all__ = [
    "BWD",
    "FWD",
    "PASS_NAMES",
    "PIPELINE",
    "CompileOptions",
    "CompiledModule",
    "Executable",
    "FlatGroup",
    "HostFunction",
    "Layout",
    "Moved",
    "Note",
    "ParamSlot",
    "PassRecord",
    "Placeholder",
    "Plan",
    "Program",
    "Role",
    "Routes",
    "Schedule",
    "Search",
    "TraceError",
    "collectives",
    "compile_cache",
    "compile_module",
    "copy_into_shard",
    "group_of",
    "local_range",
    "meta",
    "moved_into",
    "moved_name",
    "ops",
    "passes",
    "pipeline_passes",
    "plan_layout",
    "register_host_function",
    "register_trace_hint",
    "replaced",
    "take",
    "tracing",
    "unreduced",
]
