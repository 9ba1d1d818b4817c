"""Optimizers. `AdamOffloadOptimizer` keeps Adam's state in host memory and updates it with the
native fused CPU Adam (`fbmt._C`, see fbmt/csrc/adam.cpp)."""

from fbmt.optim.offload import AdamOffloadOptimizer

__all__ = ["AdamOffloadOptimizer"]
