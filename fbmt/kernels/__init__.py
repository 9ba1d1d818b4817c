"""GPU helper kernels, written with numba-cuda and tested on the CPU under its simulator.

All take torch tensors (zero-copy, through `__cuda_array_interface__`) and launch on torch's current
stream, so they queue behind torch's work without a host synchronization; results stay on the device.
numba-cuda is imported on first use: `import fbmt` does not need it.
"""

import numpy as _np

if not hasattr(_np, "row_stack"):
    # numba-cuda (0.30 and older) registers an overload for np.row_stack when it compiles its first
    # kernel; NumPy 2.5 removed that alias of np.vstack, which breaks every kernel compile. Restore it.
    _np.row_stack = _np.vstack

from fbmt.kernels.kernels import cast_, fused_adam_, multi_tensor_nonfinite, multi_tensor_sum_of_squares

__all__ = ["fused_adam_", "multi_tensor_nonfinite", "multi_tensor_sum_of_squares", "cast_"]
