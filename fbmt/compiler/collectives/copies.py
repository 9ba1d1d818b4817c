"""Copies that leave most of the GPU to compute: the copy stream's cast and copy-in kernel.

NOTE: [Bounded copies]
The copies around a collective run on the copy stream (NOTE: [Copy stream] in torch_impl.py) so
that they overlap compute. torch's own copy kernels do not overlap well: a 200M-element copy launches
~10^5 thread blocks, which take every SM as the compute kernel beside it retires its blocks, so the
next compute kernel waits for the copy to finish. `copy_` instead launches a grid-stride kernel on a
bounded number of thread blocks (`programs`, default a quarter of the SMs; $FBMT_COPY_PROGRAMS
overrides it, 0 uses torch's copy), so the copy takes longer but only part of the GPU, as NCCL's
kernels do. It casts while it copies (fp32 shard to a bf16 wire buffer, bf16 gradient into an fp32
reduce-scatter buffer).

Each program copies a tile of elements per iteration: with 64 elements per thread there are enough
loads in flight for a quarter of the SMs to copy nearly as fast as torch's copy on all of them, so
the copy holds its SMs briefly; a smaller tile holds them far longer and slows the matrix products
beside it (benchmarks/copy_sweep.py times tiles alone and beside products; BENCHMARKS.md). The sum
kernel, which loads two values and stores a wider one per element, has its own tile, with 32
elements per thread (benchmarks/sum_sweep.py).

Written in Triton, which torch's CUDA builds ship for Inductor; where Triton is missing, or off
CUDA, `copy_` is `Tensor.copy_`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fbmt import flags


@functools.cache
def _kernels() -> Any:
    """(copy, sum) Triton kernels, or None without Triton."""
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

    @triton.jit
    def bounded_sum(a, b, dst, n, iters, scale, BLOCK: tl.constexpr):
        for i in range(iters):
            offs = (tl.program_id(0) + i * tl.num_programs(0)) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(a + offs, mask=mask).to(tl.float32) + tl.load(b + offs, mask=mask).to(tl.float32)
            tl.store(dst + offs, (x * scale).to(dst.dtype.element_ty), mask=mask)

    return bounded_copy, bounded_sum


@functools.cache
def tiling() -> tuple[int, int]:
    """(elements per program and iteration, warps per program) of the copy kernel: $FBMT_COPY_BLOCK
    and $FBMT_COPY_WARPS (powers of two; see fbmt/flags.py for the defaults), for tuning on a new GPU
    (benchmarks/copy_sweep.py)."""
    return flags.COPY_BLOCK.get(), flags.COPY_WARPS.get()


@functools.cache
def sum_tiling() -> tuple[int, int]:
    """`tiling()` of the sum kernel: $FBMT_SUM_BLOCK and $FBMT_SUM_WARPS (benchmarks/sum_sweep.py)."""
    return flags.SUM_BLOCK.get(), flags.SUM_WARPS.get()


@functools.cache
def programs(device_index: int) -> int:
    """Thread blocks a copy may use on this device (NOTE: [Bounded copies])."""
    count = flags.COPY_PROGRAMS.get()
    if count is not None:
        return count
    return max(1, torch.cuda.get_device_properties(device_index).multi_processor_count // 4)


def _launch(which: int, dst: torch.Tensor, *srcs: torch.Tensor, extra: tuple = ()) -> bool:
    """Run kernel `which` of `_kernels()` over dst and srcs (contiguous, 1-D, equal sizes) on a
    bounded grid; False where it cannot (no Triton, off CUDA, FBMT_COPY_PROGRAMS=0, int32 overflow)."""
    n = dst.numel()
    for src in srcs:
        if src.numel() != n:
            raise ValueError(f"fbmt copies: {src.numel()} elements into {n}")
    kernels = _kernels() if dst.is_cuda else None
    grid = (
        programs(dst.device.index if dst.device.index is not None else torch.cuda.current_device())
        if kernels is not None
        else 0
    )
    block, warps = tiling() if which == 0 else sum_tiling()
    # int32 offsets: the last iteration of the grid stride reaches up to (blocks + grid) * block
    if grid == 0 or n == 0 or n + (grid + 1) * block >= 2**31 or not all(t.is_contiguous() for t in (dst, *srcs)):
        return False
    blocks = -(-n // block)
    grid = min(grid, blocks)
    kernels[which][(grid,)](*srcs, dst, n, -(-blocks // grid), *extra, BLOCK=block, num_warps=warps)
    return True


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)` for contiguous 1-D tensors of equal size, casting to dst's dtype; on CUDA
    with a bounded grid (NOTE: [Bounded copies])."""
    if not _launch(0, dst, src):
        dst.copy_(src)
    return dst


def sum_(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`dst = (a + b) * scale`, computed in fp32 (exact for bf16 a and b into fp32, and for a scale
    of 1/2), on CUDA with a bounded grid: the reduce stream's half of `all_to_all_reduce`."""
    if not _launch(1, dst, a, b, extra=(scale,)):
        torch.add(a.to(torch.float32), b.to(torch.float32), out=dst)
        if scale != 1.0:
            dst.mul_(scale)
    return dst
