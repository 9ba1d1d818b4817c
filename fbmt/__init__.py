"""fbmt: train plain PyTorch modules on many devices by compiling them (ZeRO, remat, overlap).

Two ways in: `fbmt.compile(model)` for a plain single-device module, and BMTrain's names
(`import fbmt as bmt`: DistributedParameter, Block, TransformerBlockList, OptimManager, ...), which
lower onto the same compiler (`fbmt/bmt`, NOTE: [Lowering]).

The tree is the pipeline (docs/ARCHITECTURE.md): `trace` -> `program` (with `layout` and the
vocabulary of `ops`) -> `passes` -> `runtime`, joined by `pipeline` and `compiled`, behind `api`.
"""

import sys as _sys

from fbmt import bmt, checkpoint, distributed, ops, optim, sim, viz
from fbmt.api import CompiledModule, CompileOptions, compile
from fbmt.bmt import global_var, inspect, loss, lr_scheduler, nn, utils
from fbmt.bmt.block import Block, BMTrainModelWrapper, CheckpointBlock, TransformerBlockList
from fbmt.bmt.module import DistributedModule, init_parameters
from fbmt.bmt.parameter import DistributedParameter, ParameterInitializer
from fbmt.bmt.store import load, save
from fbmt.bmt.utils import see_memory
from fbmt.calibration import calibrate
from fbmt.decisions import Schedule
from fbmt.distributed import (
    config,
    gather_result,
    init_distributed,
    local_part,
    print_rank,
    rank,
    sum_loss,
    synchronize,
    world_size,
)
from fbmt.passes import register_strategy
from fbmt.profiling import Profile, profile
from fbmt.program import Program
from fbmt.sim import simulate
from fbmt.trace import TraceError

# BMTrain's module paths: `import bmtrain.lr_scheduler` (and the other five) has to work as
# `import fbmt.lr_scheduler` too, so each of these names of fbmt/bmt is also registered under fbmt.
for _module in (global_var, inspect, loss, lr_scheduler, nn, utils):
    _sys.modules[f"fbmt.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = [
    # fbmt.compile
    "compile",
    "CompileOptions",
    "CompiledModule",
    "Profile",
    "Program",
    "Schedule",
    "calibrate",
    "profile",
    "TraceError",
    "register_strategy",
    "simulate",
    # BMTrain's surface
    "init_distributed",
    "rank",
    "world_size",
    "local_part",
    "config",
    "synchronize",
    "sum_loss",
    "gather_result",
    "print_rank",
    "see_memory",
    "DistributedParameter",
    "ParameterInitializer",
    "DistributedModule",
    "init_parameters",
    "Block",
    "CheckpointBlock",
    "TransformerBlockList",
    "BMTrainModelWrapper",
    "save",
    "load",
    # submodules
    "bmt",
    "checkpoint",
    "distributed",
    "global_var",
    "inspect",
    "loss",
    "lr_scheduler",
    "nn",
    "ops",
    "optim",
    "sim",
    "viz",
    "utils",
]
__version__ = "0.3.0"
