"""Copies that leave most of the GPU to compute: the copy stream's cast and copy-in kernel.

NOTE: [Bounded copies]
The copies around a collective run on the copy stream (NOTE: [Copy stream] in collectives.py) so
that they overlap compute. torch's own copy kernels do not overlap well: a 200M-element copy launches
~10^5 thread blocks, which take every SM as the compute kernel beside it retires its blocks, so the
next compute kernel waits for the copy to finish. `copy_` instead launches a grid-stride kernel on a
bounded number of thread blocks (`programs`, default a quarter of the SMs; the environment variable
FBMT_COPY_PROGRAMS overrides it, 0 uses torch's copy), so the copy takes longer but only part of the
GPU, as NCCL's kernels do. It casts while it copies (fp32 shard to a bf16 wire buffer, bf16
gradient into an fp32 reduce-scatter buffer).

Measured (2x H200, 6.7B model, one profiled step; BENCHMARKS.md): with torch's copies the compute
stream idled 29.5 ms of the copies' 37 ms; bounded, 8 ms, but the matrix products running beside
the copies slowed by about as much (the copies still take their memory bandwidth), so throughput is
the same within noise. Overlapping these copies has little left to give: removing them does.

Written in Triton, which torch's CUDA builds ship for Inductor; where Triton is missing, or off
CUDA, `copy_` is `Tensor.copy_`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

BLOCK = 8192  # elements per thread block and iteration: 32 per thread at 8 warps


@functools.cache
def _kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def bounded_copy(src, dst, n, iters, BLOCK: tl.constexpr):
        for i in range(iters):  # grid-stride: block b of this program is program_id + i * programs
            offs = (tl.program_id(0) + i * tl.num_programs(0)) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask).to(dst.dtype.element_ty), mask=mask)

    return bounded_copy


@functools.cache
def programs(device_index: int) -> int:
    """Thread blocks a copy may use on this device (NOTE: [Bounded copies])."""
    env = os.environ.get("FBMT_COPY_PROGRAMS")
    if env is not None:
        return max(0, int(env))
    return max(1, torch.cuda.get_device_properties(device_index).multi_processor_count // 4)


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)` for contiguous 1-D tensors of equal size, casting to dst's dtype; on CUDA
    with a bounded grid (NOTE: [Bounded copies])."""
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"fbmt copy_: {n} elements into {dst.numel()}")
    kernel = _kernel() if src.is_cuda else None
    grid = programs(src.device.index if src.device.index is not None else torch.cuda.current_device()) \
        if kernel is not None else 0
    # int32 offsets: the last iteration of the grid stride reaches up to (blocks + grid) * BLOCK
    if grid == 0 or n == 0 or n + (grid + 1) * BLOCK >= 2**31 or not (src.is_contiguous() and dst.is_contiguous()):
        return dst.copy_(src)
    blocks = -(-n // BLOCK)
    grid = min(grid, blocks)
    kernel[(grid,)](src, dst, n, -(-blocks // grid), BLOCK=BLOCK, num_warps=8)
    return dst
