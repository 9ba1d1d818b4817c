"""numba-CUDA kernels: fused Adam over a flat buffer, multi-tensor inf/nan check and sum of squares,
fp32 -> bf16/fp16 cast. Launched on torch's current stream; results stay on the device."""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda

from fbmt.kernels._device import (KIND, SIM, array, bf16_to_f32, f32_to_bf16, launch_size, load_f16, load_u16,
                                  load_u32, f32_of_bits, stream)

# ---- element access per dtype: (load, store) device functions, chosen when a kernel is built ----


@cuda.jit(device=True)
def _load_f32(a, i):
    return np.float32(a[i])


@cuda.jit(device=True)
def _load_bf16(a, i):
    return bf16_to_f32(a[i])


@cuda.jit(device=True)
def _store_f32(a, i, x):
    a[i] = x


@cuda.jit(device=True)
def _store_bf16(a, i, x):
    a[i] = f32_to_bf16(x)


@cuda.jit(device=True)
def _store_f16(a, i, x):
    a[i] = np.float16(x)


@cuda.jit(device=True)
def _store_none(a, i, x):
    pass


_LOADS = {torch.float32: _load_f32, torch.bfloat16: _load_bf16, torch.float16: _load_f32}
_STORES = {torch.float32: _store_f32, torch.bfloat16: _store_bf16, torch.float16: _store_f16, None: _store_none}


# ---- fused Adam ----

def _make_adam(load_g, store_p):
    @cuda.jit
    def adam(master, m, v, g, out, n, one_b1, b2, one_b2, eps, wd, decay, step_size, bc2_sqrt, inv_scale,
             decoupled, skip):
        if skip[0] != 0:  # an overflowed step (flag set on the device by the inf/nan check) changes nothing
            return
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            gi = load_g(g, i) * inv_scale
            p = master[i]
            if not decoupled:
                gi = gi + wd * p
            mi = m[i] + one_b1 * (gi - m[i])
            vi = b2 * v[i] + one_b2 * gi * gi
            m[i] = mi
            v[i] = vi
            if decoupled:
                p = p * decay
            p = p - step_size * (mi / (math.sqrt(vi) / bc2_sqrt + eps))
            master[i] = p
            store_p(out, i, p)
    return adam


_ADAM: dict = {}
_CONSTANTS: dict = {}


def _constant(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A cached one-element zero tensor (the "never skip" flag, the unused output)."""
    key = (device, dtype)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _CONSTANTS[key]


def fused_adam_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                out: torch.Tensor | None = None, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, inv_scale: float = 1.0, decoupled: bool = True,
                skip: torch.Tensor | None = None) -> None:
    """One Adam(W) step over flat fp32 `master`, `exp_avg`, `exp_avg_sq` in one pass (see fbmt.optim).

    `grad` is fp32/bf16/fp16, multiplied by `inv_scale`; `out` (bf16/fp16/fp32) receives the updated
    parameter rounded to nearest even. `skip`: an int32 device tensor; if it holds a nonzero value
    when the kernel runs, nothing is written (so a device-side overflow check needs no host sync).
    """
    n = master.numel()
    for t in (exp_avg, exp_avg_sq, grad) + ((out,) if out is not None else ()):
        if t.numel() != n:
            raise ValueError(f"fbmt.kernels.fused_adam_: sizes differ ({t.numel()} vs {n} elements)")
    if master.dtype != torch.float32 or exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise ValueError("fbmt.kernels.fused_adam_: master and moments must be float32")
    key = (grad.dtype, None if out is None else out.dtype)
    if key not in _ADAM:
        _ADAM[key] = _make_adam(_LOADS[grad.dtype], _STORES[key[1]])
    if skip is None:
        skip = _constant(master.device, torch.int32)
    if out is None:  # the no-output kernel never touches this; never alias `master` (the simulator copies back)
        out = _constant(master.device, torch.float32)
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    blocks, threads = launch_size(n)
    _ADAM[key][blocks, threads, stream(master)](
        array(master), array(exp_avg), array(exp_avg_sq), array(grad), array(out),
        n, np.float32(1 - beta1), np.float32(beta2), np.float32(1 - beta2), np.float32(eps),
        np.float32(weight_decay), np.float32(1 - lr * weight_decay), np.float32(lr / bc1),
        np.float32(math.sqrt(bc2)), np.float32(inv_scale), decoupled, array(skip))


# ---- multi-tensor kernels: one launch, one block per chunk of one tensor ----

CHUNK = 4096


def _chunk_table(tensors: list[torch.Tensor], device: torch.device):
    """Per chunk: (tensor index, start, length); per tensor: data pointer and dtype kind."""
    sizes = np.array([t.numel() for t in tensors], dtype=np.int64)
    per = -(-sizes // CHUNK)
    owner = np.repeat(np.arange(len(tensors), dtype=np.int32), per)
    first = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
    start = (np.arange(len(owner), dtype=np.int64) - np.repeat(first, per)) * CHUNK
    length = np.minimum(CHUNK, sizes[owner] - start).astype(np.int32)
    addrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    kinds = np.array([KIND[t.dtype] for t in tensors], dtype=np.int32)
    # Copied on torch's current stream, where the kernel that reads them runs: ordered, no sync needed.
    return [torch.from_numpy(a) if SIM else torch.from_numpy(a).to(device) for a in (addrs, kinds, owner, start, length)]


@cuda.jit(device=True)
def _value(addr, kind, idx):
    if kind == 0:
        return f32_of_bits(load_u32(addr, idx))
    if kind == 1:
        return bf16_to_f32(load_u16(addr, idx))
    return load_f16(addr, idx)


@cuda.jit
def _nonfinite_kernel(addrs, kinds, owner, start, length, flag):
    c = cuda.blockIdx.x
    t = owner[c]
    addr, kind, first = addrs[t], kinds[t], start[c]
    for j in range(cuda.threadIdx.x, length[c], cuda.blockDim.x):
        if kind == 0:
            bad = (np.int64(load_u32(addr, first + j)) & 0x7F800000) == 0x7F800000
        elif kind == 1:
            bad = (load_u16(addr, first + j) & 0x7F80) == 0x7F80
        else:
            bad = (load_u16(addr, first + j) & 0x7C00) == 0x7C00
        if bad:
            flag[0] = 1  # every writer writes 1: no atomic needed


@cuda.jit
def _sum_of_squares_kernel(addrs, kinds, owner, start, length, partials):
    buf = cuda.shared.array(256, dtype=np.float32)
    c, tid = cuda.blockIdx.x, cuda.threadIdx.x
    t = owner[c]
    addr, kind, first = addrs[t], kinds[t], start[c]
    acc = np.float32(0.0)
    for j in range(tid, length[c], cuda.blockDim.x):
        x = _value(addr, kind, first + j)
        acc += x * x
    buf[tid] = acc
    cuda.syncthreads()
    width = cuda.blockDim.x // 2
    while width > 0:
        if tid < width:
            buf[tid] += buf[tid + width]
        cuda.syncthreads()
        width //= 2
    if tid == 0:
        partials[c] = buf[0]


def _check_many(tensors: list[torch.Tensor], what: str) -> torch.device:
    if not tensors:
        raise ValueError(f"fbmt.kernels.{what}: no tensors")
    device = tensors[0].device
    for t in tensors:
        if t.dtype not in KIND or not t.is_contiguous() or t.device != device:
            raise ValueError(f"fbmt.kernels.{what}: tensors must be contiguous fp32/bf16/fp16 on one device; "
                             f"got {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")
    return device


def _threads() -> int:
    return 32 if SIM else 256


def multi_tensor_nonfinite(tensors: list[torch.Tensor], flag: torch.Tensor | None = None) -> torch.Tensor:
    """An int32 device tensor [1]: 1 if any element of any tensor is inf/nan (OR-ed into `flag` if given)."""
    device = _check_many(tensors, "multi_tensor_nonfinite")
    flag = torch.zeros(1, dtype=torch.int32, device=device) if flag is None else flag
    table = _chunk_table(tensors, device)
    if len(table[2]):
        _nonfinite_kernel[len(table[2]), _threads(), stream(flag)](*[array(a) for a in table], array(flag))
    return flag


def multi_tensor_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element of every tensor, as a float32 device scalar (for grad clipping)."""
    device = _check_many(tensors, "multi_tensor_sum_of_squares")
    table = _chunk_table(tensors, device)
    partials = torch.zeros(max(1, len(table[2])), dtype=torch.float32, device=device)
    if len(table[2]):
        _sum_of_squares_kernel[len(table[2]), _threads(), stream(partials)](*[array(a) for a in table],
                                                                             array(partials))
    return partials.sum()


# ---- cast ----

def _make_cast(store):
    @cuda.jit
    def cast(src, dst, n):
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            store(dst, i, src[i])
    return cast


_CAST = {dt: _make_cast(_STORES[dt]) for dt in (torch.bfloat16, torch.float16)}


def cast_(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst <- src (fp32) rounded to nearest even into bf16 or fp16."""
    if src.dtype != torch.float32 or dst.dtype not in _CAST or src.numel() != dst.numel():
        raise ValueError(f"fbmt.kernels.cast_: expected fp32 -> bf16/fp16 of equal sizes, got {src.dtype} "
                         f"({src.numel()}) -> {dst.dtype} ({dst.numel()})")
    blocks, threads = launch_size(src.numel())
    _CAST[dst.dtype][blocks, threads, stream(src)](array(src), array(dst), src.numel())
    return dst

