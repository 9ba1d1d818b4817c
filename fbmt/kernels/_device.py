"""What every kernel shares: torch tensor -> numba array, torch's stream, raw loads, bit casts.

The kernels run on a real GPU and, for tests, under numba's CUDA simulator
(`NUMBA_ENABLE_CUDASIM=1`), where "device memory" is host memory: tensors are then CPU tensors,
passed as numpy views, and the raw-pointer loads below read host addresses through ctypes.

bf16 has no numba type: bf16 tensors travel as int16 bit patterns and are converted in the kernels
with integer arithmetic (round to nearest even), the same on both targets.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from fbmt.kernels._numba import config, cuda, types

SIM = bool(config.ENABLE_CUDASIM)
KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def array(t: torch.Tensor):
    """A zero-copy numba view of a contiguous tensor (bf16 as int16 bits)."""
    if not t.is_contiguous():
        raise ValueError("fbmt.kernels: tensors must be contiguous")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if SIM:
        if t.device.type != "cpu":
            raise ValueError("fbmt.kernels: under the CUDA simulator tensors must live on the CPU")
        return t.numpy()
    if t.device.type != "cuda":
        raise ValueError(f"fbmt.kernels: expected a CUDA tensor, got one on {t.device}")
    return cuda.as_cuda_array(t)


def stream(t: torch.Tensor):
    """torch's current stream on the tensor's device: kernels queue behind torch's work, no sync."""
    if SIM:
        return cuda.default_stream()
    return cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)


def launch_size(n: int, threads: int = 256, per_thread: int = 4) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over n elements; small under the simulator."""
    if SIM:
        return 2, 32
    return max(1, min(-(-n // (threads * per_thread)), 65535 * 8)), threads


if SIM:

    def bits_of_f32(x):
        return int(np.array(x, dtype=np.float32).view(np.uint32))

    def f32_of_bits(b):
        return float(np.array(int(b) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32))

    def load_u32(addr, i):  # an int32 holding the 32 bits, as on the device
        return ctypes.c_int32.from_address(int(addr) + 4 * int(i)).value

    def load_u16(addr, i):
        return ctypes.c_uint16.from_address(int(addr) + 2 * int(i)).value

    def load_f16(addr, i):
        return float(np.array(load_u16(addr, i), dtype=np.uint16).view(np.float16))

    def load_v4(byte_addr):  # four int32 words from a 16-byte-aligned address
        a = int(byte_addr)
        return tuple(ctypes.c_int32.from_address(a + 4 * k).value for k in range(4))

    def f16_bits_to_f32(b):
        return float(np.array(int(b) & 0xFFFF, dtype=np.uint16).view(np.float16))
else:
    import llvmlite.ir as ir

    try:
        from numba.cuda.extending import intrinsic
    except ImportError:  # older numba-cuda
        from numba.extending import intrinsic

    @intrinsic
    def bits_of_f32(typingctx, x):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.int32(types.float32), codegen

    @intrinsic
    def f32_of_bits(typingctx, b):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.int32), codegen

    def _raw_load(bits: int, extend):
        @intrinsic
        def load(typingctx, addr, index):
            def codegen(context, builder, sig, args):
                ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
                return extend(builder, builder.load(builder.gep(ptr, [args[1]])))

            return types.int32(types.int64, types.int64), codegen

        return load

    load_u32 = _raw_load(32, lambda b, v: v)
    load_u16 = _raw_load(16, lambda b, v: b.zext(v, ir.IntType(32)))

    @intrinsic
    def load_v4(typingctx, byte_addr):
        """One 16-byte vector load (ld.global.v4) from an aligned address: four int32 words."""
        ret = types.UniTuple(types.int32, 4)

        def codegen(context, builder, sig, args):
            vec = ir.VectorType(ir.IntType(32), 4)
            value = builder.load(builder.inttoptr(args[0], vec.as_pointer()), align=16)
            words = [builder.extract_element(value, ir.Constant(ir.IntType(32), k)) for k in range(4)]
            return context.make_tuple(builder, ret, words)

        return ret(types.int64), codegen

    @intrinsic
    def f16_bits_to_f32(typingctx, b):
        def codegen(context, builder, sig, args):
            half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
            return builder.fpext(half, ir.FloatType())

        return types.float32(types.int32), codegen

    @intrinsic
    def load_f16(typingctx, addr, index):
        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[0], ir.HalfType().as_pointer())
            return builder.fpext(builder.load(builder.gep(ptr, [args[1]])), ir.FloatType())

        return types.float32(types.int64, types.int64), codegen


# 32-bit integer arithmetic throughout: 64-bit integer ops are emulated on GPUs (several instructions each).
_U16, _SHIFT, _HALF, _ONE = np.uint32(0xFFFF), np.uint32(16), np.uint32(0x7FFF), np.uint32(1)
_ABS, _INF, _QUIET = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000), np.uint32(0x40)


@cuda.jit(device=True)
def bf16_to_f32(b16):
    return f32_of_bits(np.int32((np.uint32(b16) & _U16) << _SHIFT))


@cuda.jit(device=True)
def f32_to_bf16(x):
    """Round to nearest even; NaN stays NaN. Returns the bits as a signed int16 value."""
    u = np.uint32(bits_of_f32(np.float32(x)))
    if (u & _ABS) > _INF:
        r = (u >> _SHIFT) | _QUIET
    else:
        r = (u + _HALF + ((u >> _SHIFT) & _ONE)) >> _SHIFT
    return np.int16(np.int32(r) - 65536 if r >= 32768 else np.int32(r))
