"""Optimizers with BMTrain's semantics (fp32 master copies, decoupled weight decay, hold_steps).

`AdamOptimizer` keeps its state on the parameters' device and updates with numba-CUDA kernels on
GPUs (fbmt/kernels); `AdamOffloadOptimizer` keeps it in host memory and updates with the native
fused CPU Adam (fbmt._C, fbmt/csrc/adam.cpp). `OptimManager` drives them with BMTrain's loss scaling."""

from fbmt.integrations.optim.adam import AdamOptimizer
from fbmt.integrations.optim.manager import OptimManager
from fbmt.integrations.optim.offload import AdamOffloadOptimizer

__all__ = ["AdamOptimizer", "AdamOffloadOptimizer", "OptimManager"]
