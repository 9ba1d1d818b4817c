"""numba-CUDA kernels: fused Adam over a flat buffer, multi-tensor inf/nan check and sum of squares,
fp32 -> bf16/fp16 cast. Launched on torch's current stream; results stay on the device."""

from __future__ import annotations

import math

import numpy as np
import torch

from fbmt.kernels._device import (
    KIND,
    SIM,
    array,
    bf16_to_f32,
    f16_bits_to_f32,
    f32_of_bits,
    f32_to_bf16,
    launch_size,
    load_f16,
    load_u16,
    load_u32,
    load_v4,
    stream,
)
from fbmt.kernels._numba import cuda

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
    def adam(
        master, m, v, g, out, n, one_b1, b2, one_b2, eps, wd, decay, step_size, bc2_sqrt, inv_scale, decoupled, skip
    ):
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


def fused_adam_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    inv_scale: float = 1.0,
    decoupled: bool = True,
    skip: torch.Tensor | None = None,
) -> None:
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
    if n == 0:  # a rank's empty part of a sharded parameter: nothing to update, nothing to launch
        return
    key = (grad.dtype, None if out is None else out.dtype)
    if key not in _ADAM:
        _ADAM[key] = _make_adam(_LOADS[grad.dtype], _STORES[key[1]])
    if skip is None:
        skip = _constant(master.device, torch.int32)
    if out is None:  # the no-output kernel never touches this; never alias `master` (the simulator copies back)
        out = _constant(master.device, torch.float32)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    blocks, threads = launch_size(n)
    _ADAM[key][blocks, threads, stream(master)](
        array(master),
        array(exp_avg),
        array(exp_avg_sq),
        array(grad),
        array(out),
        n,
        np.float32(1 - beta1),
        np.float32(beta2),
        np.float32(1 - beta2),
        np.float32(eps),
        np.float32(weight_decay),
        np.float32(1 - lr * weight_decay),
        np.float32(lr / bc1),
        np.float32(math.sqrt(bc2)),
        np.float32(inv_scale),
        decoupled,
        array(skip),
    )


# ---- multi-tensor kernels: one launch, one block per chunk of one tensor ----

# NOTE: [Multi-tensor chunks]
# A block first reads its chunk's tensor, address and length (dependent loads: latency), then streams
# the chunk. Big chunks (64K elements) amortize that start-up. Each thread reads 16 bytes per load
# (4 fp32 or 8 bf16/fp16 values; 2-byte loads cap the bandwidth at a fraction of the copy's), keeps
# two such loads in flight and accumulates in registers, writing once at the end. A tensor whose
# chunk is not 16-byte aligned, and each chunk's last few elements, take the per-element path.
CHUNK = 1 << 16


_TABLES: dict = {}  # recent chunk tables by (pointer, size, dtype) of every tensor: steps reuse their buffers


def _cached_table(tensors: list[torch.Tensor], device: torch.device) -> list:
    """The chunk table as numba device arrays, built once per set of tensors (host work and an upload)."""
    key = (device, tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= 16:
            _TABLES.pop(next(iter(_TABLES)))
        tensors_ = _chunk_table(tensors, device)
        table = _TABLES[key] = (tensors_, [array(a) for a in tensors_])
    return table[1]


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
    return [
        torch.from_numpy(a) if SIM else torch.from_numpy(a).to(device) for a in (addrs, kinds, owner, start, length)
    ]


_EXP32, _EXPBF, _EXP16 = np.int32(0x7F800000), np.int32(0x7F80), np.int32(0x7C00)
_LOW16, _HIGH16, _SH16 = np.int32(0xFFFF), np.int32(-65536), np.int32(16)


@cuda.jit(device=True)
def _bad(addr, kind, idx):
    if kind == 0:
        return (np.int32(load_u32(addr, idx)) & _EXP32) == _EXP32
    if kind == 1:
        return (np.int32(load_u16(addr, idx)) & _EXPBF) == _EXPBF
    return (np.int32(load_u16(addr, idx)) & _EXP16) == _EXP16


@cuda.jit(device=True)
def _bad_word(w, kind):
    """Is any value packed in this 32-bit word (one fp32, or two 16-bit values) inf or nan?"""
    if kind == 0:
        return (w & _EXP32) == _EXP32
    mask = _EXPBF if kind == 1 else _EXP16
    return ((w & mask) == mask) | (((w >> _SH16) & mask) == mask)


@cuda.jit(device=True)
def _value(addr, kind, idx):
    if kind == 0:
        return f32_of_bits(np.int32(load_u32(addr, idx)))
    if kind == 1:
        return bf16_to_f32(load_u16(addr, idx))
    return load_f16(addr, idx)


@cuda.jit(device=True)
def _squares_word(w, kind):
    """Sum of the squares of the values packed in one 32-bit word."""
    if kind == 0:
        x = f32_of_bits(w)
        return x * x
    if kind == 1:
        lo, hi = f32_of_bits(w << _SH16), f32_of_bits(w & _HIGH16)
    else:
        lo, hi = f16_bits_to_f32(w & _LOW16), f16_bits_to_f32((w >> _SH16) & _LOW16)
    return lo * lo + hi * hi


@cuda.jit(device=True)
def _chunk(addrs, kinds, owner, start, length):
    """(address, kind, first element, length, vectorizable elements) of this block's chunk."""
    c = cuda.blockIdx.x
    t = owner[c]
    addr, kind, first, n = addrs[t], kinds[t], start[c], length[c]
    size = 4 if kind == 0 else 2
    per_vec = 16 // size
    aligned = (addr + first * size) % 16 == 0
    return addr, kind, first, n, (n // per_vec) * per_vec if aligned else 0, size, per_vec


@cuda.jit
def _nonfinite_kernel(addrs, kinds, owner, start, length, flag):
    addr, kind, first, n, nvec, size, per_vec = _chunk(addrs, kinds, owner, start, length)
    base, step = addr + first * size, cuda.blockDim.x
    bad = False
    v = cuda.threadIdx.x
    while (v + step) * per_vec < nvec:  # two 16-byte loads in flight per thread
        a0, a1, a2, a3 = load_v4(base + 16 * v)
        b0, b1, b2, b3 = load_v4(base + 16 * (v + step))
        bad = (
            bad
            | _bad_word(a0, kind)
            | _bad_word(a1, kind)
            | _bad_word(a2, kind)
            | _bad_word(a3, kind)
            | _bad_word(b0, kind)
            | _bad_word(b1, kind)
            | _bad_word(b2, kind)
            | _bad_word(b3, kind)
        )
        v += 2 * step
    if v * per_vec < nvec:
        a0, a1, a2, a3 = load_v4(base + 16 * v)
        bad = bad | _bad_word(a0, kind) | _bad_word(a1, kind) | _bad_word(a2, kind) | _bad_word(a3, kind)
    for j in range(nvec + cuda.threadIdx.x, n, step):  # unaligned chunk or the last few elements
        bad = bad | _bad(addr, kind, first + j)
    if bad:
        flag[0] = 1  # every writer writes 1: no atomic needed


@cuda.jit
def _sum_of_squares_kernel(addrs, kinds, owner, start, length, partials):
    buf = cuda.shared.array(256, dtype=np.float32)
    tid = cuda.threadIdx.x
    addr, kind, first, n, nvec, size, per_vec = _chunk(addrs, kinds, owner, start, length)
    base, step = addr + first * size, cuda.blockDim.x
    acc0 = acc1 = np.float32(0.0)
    v = tid
    while (v + step) * per_vec < nvec:
        a0, a1, a2, a3 = load_v4(base + 16 * v)
        b0, b1, b2, b3 = load_v4(base + 16 * (v + step))
        acc0 += (_squares_word(a0, kind) + _squares_word(a1, kind)) + (
            _squares_word(a2, kind) + _squares_word(a3, kind)
        )
        acc1 += (_squares_word(b0, kind) + _squares_word(b1, kind)) + (
            _squares_word(b2, kind) + _squares_word(b3, kind)
        )
        v += 2 * step
    if v * per_vec < nvec:
        a0, a1, a2, a3 = load_v4(base + 16 * v)
        acc0 += (_squares_word(a0, kind) + _squares_word(a1, kind)) + (
            _squares_word(a2, kind) + _squares_word(a3, kind)
        )
    for j in range(nvec + tid, n, step):
        x = _value(addr, kind, first + j)
        acc1 += x * x
    buf[tid] = acc0 + acc1
    cuda.syncthreads()
    width = cuda.blockDim.x // 2
    while width > 0:
        if tid < width:
            buf[tid] += buf[tid + width]
        cuda.syncthreads()
        width //= 2
    if tid == 0:
        partials[cuda.blockIdx.x] = buf[0]


def _check_many(tensors: list[torch.Tensor], what: str) -> torch.device:
    if not tensors:
        raise ValueError(f"fbmt.kernels.{what}: no tensors")
    device = tensors[0].device
    for t in tensors:
        if t.dtype not in KIND or not t.is_contiguous() or t.device != device:
            raise ValueError(
                f"fbmt.kernels.{what}: tensors must be contiguous fp32/bf16/fp16 on one device; "
                f"got {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
            )
    return device


def _threads() -> int:
    return 32 if SIM else 256


def multi_tensor_nonfinite(tensors: list[torch.Tensor], flag: torch.Tensor | None = None) -> torch.Tensor:
    """An int32 device tensor [1]: 1 if any element of any tensor is inf/nan (OR-ed into `flag` if given)."""
    device = _check_many(tensors, "multi_tensor_nonfinite")
    flag = torch.zeros(1, dtype=torch.int32, device=device) if flag is None else flag
    table = _cached_table(tensors, device)
    if len(table[2]):
        _nonfinite_kernel[len(table[2]), _threads(), stream(flag)](*table, array(flag))
    return flag


def multi_tensor_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element of every tensor, as a float32 device scalar (for grad clipping)."""
    device = _check_many(tensors, "multi_tensor_sum_of_squares")
    table = _cached_table(tensors, device)
    partials = torch.zeros(max(1, len(table[2])), dtype=torch.float32, device=device)
    if len(table[2]):
        _sum_of_squares_kernel[len(table[2]), _threads(), stream(partials)](*table, array(partials))
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
        raise ValueError(
            f"fbmt.kernels.cast_: expected fp32 -> bf16/fp16 of equal sizes, got {src.dtype} "
            f"({src.numel()}) -> {dst.dtype} ({dst.numel()})"
        )
    blocks, threads = launch_size(src.numel())
    _CAST[dst.dtype][blocks, threads, stream(src)](array(src), array(dst), src.numel())
    return dst
