"""The one place fbmt adjusts numba and NumPy, imported before any kernel is defined.

- NumPy 2.5 removed `np.row_stack` (an alias of `np.vstack`), and numba-cuda (0.30 and older)
  registers an overload for it when it compiles its first kernel, so every kernel compile fails
  without it: the alias is restored where it is missing.
- A small tensor (a norm's 1024-element shard) gets a small grid on purpose; numba would warn at
  every such launch that the GPU is under-used, once per optimizer step per small parameter. The
  warning is turned off, in numba-cuda's own config module where it has one (its dispatcher reads
  that one) and in numba's.
"""

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config, cuda, types  # noqa: E402  (after the alias: numba-cuda may read it on import)

config.CUDA_LOW_OCCUPANCY_WARNINGS = False
try:
    from numba.cuda.core import config as _cuda_config

    _cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = False
except ImportError:
    pass

__all__ = ["config", "cuda", "types"]
