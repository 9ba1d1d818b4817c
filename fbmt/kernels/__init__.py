"""GPU helper kernels, written with numba-cuda and tested on the CPU under its simulator.

All take torch tensors (zero-copy, through `__cuda_array_interface__`) and launch on torch's current
stream, so they queue behind torch's work without a host synchronization; results stay on the device.
numba-cuda is imported on first use: `import fbmt` does not need it.
"""

from fbmt.kernels import _numba  # noqa: F401  (numba and NumPy adjusted before any kernel is defined)
from fbmt.kernels.kernels import cast_, fused_adam_, multi_tensor_nonfinite, multi_tensor_sum_of_squares

__all__ = ["fused_adam_", "multi_tensor_nonfinite", "multi_tensor_sum_of_squares", "cast_"]
