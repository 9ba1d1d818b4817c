"""fbmt: train plain PyTorch modules on many devices by compiling them (ZeRO, remat, overlap).

Two ways in: `fbmt.compile(model)` for a plain single-device module, and BMTrain's names
(`import fbmt as bmt`: DistributedParameter, Block, TransformerBlockList, OptimManager, ...), which
lower onto the same compiler (fbmt/modules, NOTE: [Lowering]).
"""

from fbmt import checkpoint, distributed, global_var, inspect, loss, lr_scheduler, nn, optim, sim, utils
from fbmt.api import CompileOptions, compile
from fbmt.checkpoint import load, save
from fbmt.distributed import (gather_result, init_distributed, print_rank, rank, sum_loss, synchronize,
                              world_size)
from fbmt.global_var import config
from fbmt.modules.block import BMTrainModelWrapper, Block, CheckpointBlock, TransformerBlockList
from fbmt.modules.module import DistributedModule, init_parameters
from fbmt.modules.parameter import DistributedParameter, ParameterInitializer
from fbmt.program import Program
from fbmt.runtime.module import CompiledModule
from fbmt.sim import simulate
from fbmt.trace import TraceError
from fbmt.utils import see_memory

__all__ = [
    # fbmt.compile
    "compile", "CompileOptions", "CompiledModule", "Program", "TraceError", "simulate",
    # BMTrain's surface
    "init_distributed", "rank", "world_size", "config", "synchronize", "sum_loss", "gather_result", "print_rank",
    "see_memory", "DistributedParameter", "ParameterInitializer", "DistributedModule", "init_parameters", "Block",
    "CheckpointBlock", "TransformerBlockList", "BMTrainModelWrapper", "save", "load",
    # submodules
    "checkpoint", "distributed", "global_var", "inspect", "loss", "lr_scheduler", "nn", "optim", "sim", "utils",
]
__version__ = "0.2.0"
