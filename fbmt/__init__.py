"""fbmt: train plain PyTorch modules on many devices by compiling them (ZeRO, remat, overlap)."""

from fbmt.distributed import init_distributed, rank, world_size
from fbmt.api import CompileOptions, compile
from fbmt.program import Program
from fbmt.runtime.module import CompiledModule
from fbmt.trace import TraceError

__all__ = ["init_distributed", "rank", "world_size", "compile", "CompileOptions", "CompiledModule",
           "Program", "TraceError"]
__version__ = "0.1.0"
