"""Test-wide settings. Without a GPU, numba's kernels run under its CUDA simulator (set before
numba is first imported); on a GPU machine the same kernel tests run on the GPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
