"""fbmt: train plain PyTorch modules on many devices by compiling them (ZeRO, remat, overlap).

Two ways in: `fbmt.compile(model)` for a plain single-device module, and BMTrain's names
(`import fbmt as bmt`: DistributedParameter, Block, TransformerBlockList, OptimManager, ...), which
lower onto the same compiler (`fbmt/integrations/bmt`, NOTE: [Lowering]).

The tree is three parts and what they share (docs/ARCHITECTURE.md): `compiler/` (trace -> program
-> passes -> runtime), `integrations/` (BMTrain's names and optimizers, Hugging Face, the torch
guards), `tools/` (the simulator, calibration, profiles, pictures, remat="auto"'s search), joined
by `api.py` (`fbmt.compile`); beside them the main job (`train.py`), checkpoints, the model zoo.
"""

import sys as _sys

from fbmt import job, logs
from fbmt.api import compile
from fbmt.compiler import CompiledModule, CompileOptions, Program, Schedule, TraceError, ops
from fbmt.compiler.passes import register_strategy
from fbmt.integrations import bmt, optim
from fbmt.integrations.bmt import distributed, global_var, inspect, loss, lr_scheduler, nn, utils
from fbmt.integrations.bmt.block import Block, BMTrainModelWrapper, CheckpointBlock, TransformerBlockList
from fbmt.integrations.bmt.distributed import (
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
from fbmt.integrations.bmt.module import DistributedModule, init_parameters
from fbmt.integrations.bmt.parameter import DistributedParameter, ParameterInitializer
from fbmt.integrations.bmt.store import load, save
from fbmt.integrations.bmt.utils import see_memory
from fbmt.tools import calibration, profiling, sim, viz
from fbmt.tools.calibration import calibrate
from fbmt.tools.profiling import Profile, profile
from fbmt.tools.sim import simulate


def _alias(name: str, module: object) -> None:
    """Make `fbmt.<name>` (and its submodules already imported) import as `module` (and its submodules):
    the paths users and BMTrain scripts import keep working where the tree moved them, as `os.path` does."""
    real = module.__name__
    for key, found in list(_sys.modules.items()):
        if key == real or key.startswith(real + "."):
            _sys.modules[f"fbmt.{name}{key[len(real) :]}"] = found


# BMTrain's module paths: `import bmtrain.lr_scheduler` (and the other five, and bmtrain.optim) has to work
# as `import fbmt.lr_scheduler` too; and the tools keep their short paths (`import fbmt.sim`).
for _module in (
    distributed,
    global_var,
    inspect,
    loss,
    lr_scheduler,
    nn,
    utils,
    optim,
    sim,
    viz,
    calibration,
    profiling,
):
    _alias(_module.__name__.rsplit(".", 1)[1], _module)

logs.from_environment()  # FBMT_LOG=info: what fbmt does, on stderr

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
    "job",
    "logs",
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


def __getattr__(name: str):
    """`fbmt.checkpoint` is imported on first use: torch.distributed.checkpoint takes most of a second
    to import, paid by every process that imports fbmt, while a process that never saves needs none of it."""
    if name == "checkpoint":
        import importlib

        return importlib.import_module("fbmt.checkpoint")
    raise AttributeError(f"module 'fbmt' has no attribute {name!r}")
