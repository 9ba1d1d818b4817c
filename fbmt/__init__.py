"""fbmt: train plain PyTorch modules on many devices by compiling them (ZeRO, remat, overlap)."""

from fbmt import checkpoint, distributed, lr_scheduler, optim
from fbmt.distributed import (gather_result, init_distributed, print_rank, rank, sum_loss, synchronize,
                              world_size)
from fbmt.api import CompileOptions, compile
from fbmt.program import Program
from fbmt.runtime.module import CompiledModule
from fbmt.trace import TraceError

__all__ = ["init_distributed", "rank", "world_size", "compile", "CompileOptions", "CompiledModule",
           "Program", "TraceError", "checkpoint", "distributed", "lr_scheduler", "optim", "sum_loss", "gather_result", "synchronize",
           "print_rank"]
__version__ = "0.1.0"
